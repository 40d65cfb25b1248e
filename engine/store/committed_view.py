"""The read side beside a running writer: what state.sqlite records as committed, read with the database opened
read-only and without the writer lock (regen stats). Every committed sample is in exactly one listed file.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import sqlite3
import urllib.parse
from pathlib import Path

from engine.store.names import AFTER_CUT, STATE_DB, SettleKind


@dataclass(frozen=True)
class CommittedParts:
    """What state.sqlite records as committed: the only parts a reader may count."""

    parts: list[tuple[str, str, int]]  # (path relative to the run dir, shard_id, rows), by shard then path
    recorded: dict[str, tuple[int, int, int]]  # part path -> (samples, empty, truncated) recorded at commit
    shards: dict[str, tuple[int | None, bool]]  # shard_id -> (total conversations, paused)
    not_generated: dict[str, int] = dataclasses.field(default_factory=dict)  # rejected | failed | after_cut -> samples


def read_committed(run_dir: Path) -> CommittedParts:
    """Read state.sqlite opened read-only, without the writer lock, so a running supervisor keeps writing it.
    A store from an older regen may lack the samples figures or the shards table: those come back empty.
    Raises sqlite3.Error (the caller names the file)."""
    uri = "file:" + urllib.parse.quote(str((Path(run_dir) / STATE_DB).resolve())) + "?mode=ro"
    db = sqlite3.connect(uri, uri=True, timeout=10.0)
    try:
        db.execute("PRAGMA busy_timeout=10000")
        parts = [(r[0], r[1], int(r[2])) for r in
                 db.execute("SELECT path, shard_id, rows FROM parts ORDER BY shard_id, path")]
        recorded = {}
        if {r[1] for r in db.execute("PRAGMA table_info(samples)")} >= {"part_path", "empty", "finish_reason"}:
            recorded = {r[0]: (int(r[1]), int(r[2] or 0), int(r[3] or 0)) for r in db.execute(
                "SELECT part_path, count(*), sum(empty), sum(finish_reason='length') FROM samples GROUP BY part_path")}
        shards: dict[str, tuple[int | None, bool]] = {}
        if {r[1] for r in db.execute("PRAGMA table_info(shards)")}:
            for sid, total, paused in db.execute("SELECT shard_id, total, paused FROM shards"):
                shards[sid] = (int(total) if total is not None else None, bool(paused))
        not_generated: dict[str, int] = {}
        if {r[1] for r in db.execute("PRAGMA table_info(outcomes)")}:
            for outcome, reason, n in db.execute("SELECT outcome, reason, count(*) FROM outcomes GROUP BY outcome, reason"):
                not_generated[outcome] = not_generated.get(outcome, 0) + int(n)
                if outcome == SettleKind.REJECTED and reason == AFTER_CUT:
                    not_generated[AFTER_CUT] = int(n)
    finally:
        db.close()
    return CommittedParts(parts, recorded, shards, not_generated)
