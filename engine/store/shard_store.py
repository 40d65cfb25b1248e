"""The shard store of a run dir: the one object the run, its observers and the tools hold. It answers the queries of
state.sqlite (shards, samples, outcomes, meta, the brake's record, the raised alerts) and hands writing to
engine.store.part_writer, compaction to engine.store.compaction and the start's scan to engine.store.recovery.
One writer per run dir (an flock, engine.store.state_db); reading needs no lock.
"""
from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.store.compaction import Compaction, Compactor
from engine.store.names import AFTER_CUT, CUT_FINISHES, SHARD_FILE, SettleKind
from engine.store.part_writer import PartWriter
from engine.store.recovery import recover
from engine.store.state_db import UNCLOSED_SQL, PartInfo, StateDb, StoreError, chunks
from engine.text.answer_shape import THINK_STATES, SampleShape

BRAKE_KEY = "brake"  # meta: the data-quality brake's record (JSON, engine.run.brake) while the run is braked
BRAKE_FROM_KEY = "brake_window_from"  # meta: the brake's window holds only samples of a higher rowid (a resume)


@dataclass
class ShardProgress:
    shard_id: str
    total_conversations: int
    done_samples: int
    output_tokens: int
    empty: int
    truncated: int
    paused: bool
    parts: int
    total_samples: int | None = None  # when the planner knows the number of turns
    repetition: int = 0  # finish_reason "repetition": stopped by the runaway guard
    rejected: int = 0  # samples settled without a row, never generated: their input cannot be (outcomes table)
    failed: int = 0  # samples whose retries were spent in the last run (generated again by the next start)
    after_cut: int = 0  # of the rejected: later turns not generated after a cut turn (turns_after_cut = "stop")
    unclosed_reasoning: int = 0  # reasoning opened and never closed (SampleShape.reasoning_unclosed)


@dataclass(frozen=True)
class StoredAlert:
    """A row of the alerts table: a condition raised and not cleared (engine.store.alert_record)."""
    key: str
    severity: str
    text: str
    evidence: str
    raised_at: float


class ShardStore:
    def __init__(self, run_dir: Path):
        self.state = StateDb(run_dir)
        self.run_dir, self.shards_dir, self.db_path = self.state.run_dir, self.state.shards_dir, self.state.db_path
        self._writer = PartWriter(self.state)
        self._compactor = Compactor(self.state)

    def close(self) -> None:
        self.state.close()

    def __enter__(self) -> ShardStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def recover(self) -> list[str]:
        """Remove orphan files, un-commit parts missing on disk (engine.store.recovery); one line per thing removed."""
        return recover(self.state)

    def commit(self, shard_id: str, rows: list[dict], history: Mapping[str, str] = {}) -> PartInfo:  # noqa: B006
        """Write one immutable part with `rows` and commit it with its sample ids (and the `history` answers,
        sample_id -> text, kept for chaining multi-turn conversations): engine.store.part_writer."""
        return self._writer.commit(shard_id, rows, history)

    def compact(self, shard_id: str) -> Compaction | None:
        """Rewrite a shard settled for good as one file (engine.store.compaction); None when there is nothing to do."""
        return self._compactor.compact(shard_id)

    def compacted_shards(self) -> set[str]:
        """Shards whose committed rows are in one compacted file."""
        with self.state.lock:
            return {r[0] for r in self.state.db.execute("SELECT shard_id FROM parts WHERE path LIKE ?",
                                                   (f"%/{SHARD_FILE}",))}

    # --- shards ------------------------------------------------------------------------------

    def ensure_shards(self, totals: Mapping[str, int], sample_totals: Mapping[str, int] | None = None) -> None:
        """Declare shards with their planned conversations (and, optionally, samples = user turns)."""
        sample_totals = sample_totals or {}
        with self.state.lock:
            db = self.state.db
            db.execute("BEGIN IMMEDIATE")
            try:
                for shard_id, total in totals.items():
                    db.execute(
                        "INSERT INTO shards(shard_id, total, total_samples) VALUES(?,?,?)"
                        " ON CONFLICT(shard_id) DO UPDATE SET total=excluded.total,"
                        " total_samples=coalesce(excluded.total_samples, shards.total_samples)",
                        (shard_id, int(total), sample_totals.get(shard_id)))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def set_paused(self, shard_ids: Iterable[str] | None, paused: bool) -> list[str]:
        """Pause/resume shards (None = all); persisted. Returns the shard ids it applies to."""
        with self.state.lock:
            known = [r[0] for r in self.state.db.execute("SELECT shard_id FROM shards ORDER BY shard_id")]
            if shard_ids is None:
                targets = known
            else:
                targets = list(dict.fromkeys(shard_ids))
                unknown = sorted(set(targets) - set(known))
                if unknown:
                    raise KeyError(f"unknown shard(s): {', '.join(unknown)} (known: {_ranges(known)})")
            db = self.state.db
            db.execute("BEGIN IMMEDIATE")
            try:
                for chunk in chunks(targets):
                    db.execute(f"UPDATE shards SET paused=? WHERE shard_id IN ({','.join('?' * len(chunk))})",
                               (int(paused), *chunk))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            return targets

    def paused(self) -> set[str]:
        with self.state.lock:
            return {r[0] for r in self.state.db.execute("SELECT shard_id FROM shards WHERE paused=1")}

    def progress(self) -> list[ShardProgress]:
        with self.state.lock:
            rows = self.state.db.execute(
                "SELECT shard_id, total, done_samples, output_tokens, empty, truncated, paused, parts, total_samples,"
                " repetition FROM shards ORDER BY shard_id").fetchall()
            settled: dict[tuple[str, str], int] = {
                (r[0], r[1]): r[2] for r in self.state.db.execute(
                    "SELECT shard_id, outcome, count(*) FROM outcomes GROUP BY shard_id, outcome")}
            after_cut: dict[str, int] = {r[0]: r[1] for r in self.state.db.execute(
                "SELECT shard_id, count(*) FROM outcomes WHERE outcome='rejected' AND reason=? GROUP BY shard_id",
                (AFTER_CUT,))}
            unclosed: dict[str, int] = {r[0]: r[1] for r in self.state.db.execute(
                f"SELECT shard_id, count(*) FROM samples WHERE {UNCLOSED_SQL} GROUP BY shard_id")}
        return [ShardProgress(r[0], r[1], r[2], r[3], r[4], r[5], bool(r[6]), r[7], r[8], repetition=r[9],
                              rejected=settled.get((r[0], "rejected"), 0), failed=settled.get((r[0], "failed"), 0),
                              after_cut=after_cut.get(r[0], 0), unclosed_reasoning=unclosed.get(r[0], 0))
                for r in rows]

    # --- samples -----------------------------------------------------------------------------

    def is_committed(self, sample_id: str) -> bool:
        with self.state.lock:
            return self.state.db.execute("SELECT 1 FROM samples WHERE sample_id=?", (sample_id,)).fetchone() is not None

    def is_settled(self, sample_id: str) -> bool:
        """Committed, or settled without a row (rejected; failed in this run): not to be generated again."""
        with self.state.lock:
            return self.state.db.execute(
                "SELECT 1 FROM samples WHERE sample_id=? UNION ALL SELECT 1 FROM outcomes WHERE sample_id=? LIMIT 1",
                (sample_id, sample_id)).fetchone() is not None

    # --- outcomes of samples that get no row ---------------------------------------------------

    def settle(self, shard_id: str, sample_id: str, outcome: SettleKind, reason: str) -> None:
        """Record a sample settled without a row (outcome rejected | failed), so a status read from the run dir
        alone counts it and a restart does not generate a rejected one again."""
        if outcome not in tuple(SettleKind):
            raise ValueError(f"outcome {outcome!r}: a sample without a row is 'rejected' or 'failed'")
        try:
            with self.state.lock:
                self.state.db.execute("INSERT OR REPLACE INTO outcomes(sample_id, shard_id, outcome, reason, settled_at)"
                                 " VALUES(?,?,?,?,?)", (sample_id, shard_id, outcome, reason, time.time()))
        except sqlite3.Error as exc:
            raise StoreError(f"cannot record {sample_id} as {outcome} in {self.state.db_path}: {exc}") from exc

    def forget_failed(self) -> int:
        """At a start: samples that failed in an earlier run are generated again (their retries were that run's)."""
        try:
            with self.state.lock:
                return self.state.db.execute("DELETE FROM outcomes WHERE outcome='failed'").rowcount
        except sqlite3.Error as exc:
            raise StoreError(f"cannot clear the failed samples of an earlier run in {self.state.db_path}: {exc}") from exc

    def forget_outcomes(self, reasons: tuple[str, ...] | None = None, since: float = 0.0) -> int:
        """Outcomes that were the config's fault, not the samples' (a run refused run-wide, a corrected config on a
        run dir with nothing committed): those samples are generated again. reasons: their reject kinds (None: any);
        since: settled at or after this time."""
        where = "settled_at >= ?"
        args: list[float | str] = [since]
        if reasons is not None:
            where += f" AND reason IN ({','.join('?' * len(reasons))})"
            args += list(reasons)
        try:
            with self.state.lock:
                return self.state.db.execute(f"DELETE FROM outcomes WHERE {where}", args).rowcount
        except sqlite3.Error as exc:
            raise StoreError(f"cannot clear settled outcomes in {self.state.db_path}: {exc}") from exc

    def committed_samples(self) -> int:
        with self.state.lock:
            return self.state.db.execute("SELECT count(*) FROM samples").fetchone()[0]

    def history(self, conversation_id: str) -> dict[int, str]:
        with self.state.lock:
            rows = self.state.db.execute(
                "SELECT turn, answer FROM samples WHERE conversation_id=? AND answer IS NOT NULL ORDER BY turn",
                (conversation_id,)).fetchall()
        return {int(t): a for t, a in rows}

    def cut_turn(self, conversation_id: str) -> tuple[int, str] | None:
        """The conversation's first committed turn that was cut (CUT_FINISHES) and its finish reason, or None."""
        with self.state.lock:
            row = self.state.db.execute(
                f"SELECT turn, finish_reason FROM samples WHERE conversation_id=? AND finish_reason IN "
                f"({','.join('?' * len(CUT_FINISHES))}) ORDER BY turn LIMIT 1",
                (conversation_id, *CUT_FINISHES)).fetchone()
        return None if row is None else (int(row[0]), str(row[1]))

    def parts(self, shard_id: str | None = None) -> list[PartInfo]:
        return self.state.parts(shard_id)

    def get_meta(self, key: str) -> str | None:
        with self.state.lock:
            row = self.state.db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        with self.state.lock:
            self.state.db.execute("INSERT INTO meta(key, value) VALUES(?,?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                             (key, value))

    # --- the data-quality brake's committed inputs and its record ------------------------------

    def recent_shapes(self, limit: int, after: int = 0) -> list[SampleShape]:
        """The shapes of the last `limit` committed samples (of rowid > after), oldest first: rowid order is
        commit order (each commit inserts its rows in one transaction)."""
        with self.state.lock:
            rows = self.state.db.execute("SELECT empty, finish_reason, think FROM samples WHERE rowid > ?"
                                    " ORDER BY rowid DESC LIMIT ?", (after, limit)).fetchall()
        return [SampleShape(bool(e), fr, THINK_STATES[t] if t is not None and 0 <= t < len(THINK_STATES) else None)
                for e, fr, t in reversed(rows)]

    def last_sample_rowid(self) -> int:
        with self.state.lock:
            return self.state.db.execute("SELECT coalesce(max(rowid), 0) FROM samples").fetchone()[0]

    def brake(self) -> tuple[str | None, int]:
        """(the brake's record as JSON or None when not braked, the rowid its window starts after)."""
        with self.state.lock:
            rows = dict(self.state.db.execute("SELECT key, value FROM meta WHERE key IN (?, ?)", (BRAKE_KEY, BRAKE_FROM_KEY)))
        try:
            after = int(rows.get(BRAKE_FROM_KEY) or 0)
        except ValueError:
            after = 0  # not written by regen: the window takes every committed sample
        return rows.get(BRAKE_KEY), after

    def set_brake(self, record: str | None, window_from: int | None = None) -> None:
        """Record the brake (JSON), or clear it (None); window_from: the window starts after this rowid from now
        on. One transaction, durable (synchronous=FULL) before it returns."""
        try:
            with self.state.lock:
                db = self.state.db
                db.execute("BEGIN IMMEDIATE")
                try:
                    if record is None:
                        db.execute("DELETE FROM meta WHERE key=?", (BRAKE_KEY,))
                    else:
                        db.execute("INSERT INTO meta(key, value) VALUES(?,?) ON CONFLICT(key) DO UPDATE SET"
                                   " value=excluded.value", (BRAKE_KEY, record))
                    if window_from is not None:
                        db.execute("INSERT INTO meta(key, value) VALUES(?,?) ON CONFLICT(key) DO UPDATE SET"
                                   " value=excluded.value", (BRAKE_FROM_KEY, str(int(window_from))))
                    db.execute("COMMIT")
                except BaseException:
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    raise
        except sqlite3.Error as exc:
            raise StoreError(f"cannot {'record' if record is not None else 'clear'} the data-quality brake in "
                             f"{self.state.db_path}: {exc}") from exc

    # --- the alerts raised now (engine.store.alert_record) --------------------------------------------

    def raised_alerts(self) -> list[StoredAlert]:
        """Every alert raised and not cleared, oldest first."""
        try:
            with self.state.lock:
                rows = self.state.db.execute("SELECT key, severity, text, evidence, raised_at FROM alerts"
                                        " ORDER BY raised_at, key").fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read the raised alerts in {self.state.db_path}: {exc}") from exc
        return [StoredAlert(*r) for r in rows]

    def record_alert(self, alert: StoredAlert) -> None:
        """Record a raised alert (replacing the row of its key); durable (synchronous=FULL) before it returns."""
        try:
            with self.state.lock:
                self.state.db.execute("INSERT INTO alerts(key, severity, text, evidence, raised_at) VALUES(?,?,?,?,?)"
                                 " ON CONFLICT(key) DO UPDATE SET severity=excluded.severity, text=excluded.text,"
                                 " evidence=excluded.evidence, raised_at=excluded.raised_at",
                                 (alert.key, alert.severity, alert.text, alert.evidence, alert.raised_at))
        except sqlite3.Error as exc:
            raise StoreError(f"cannot record the alert {alert.key!r} in {self.state.db_path}: {exc}") from exc

    def drop_alert(self, key: str) -> None:
        """Remove a cleared alert's row (nothing when there is none)."""
        try:
            with self.state.lock:
                self.state.db.execute("DELETE FROM alerts WHERE key=?", (key,))
        except sqlite3.Error as exc:
            raise StoreError(f"cannot remove the cleared alert {key!r} from {self.state.db_path}: {exc}") from exc


def _ranges(ids: list[str]) -> str:
    if not ids:
        return "none"
    return ids[0] if len(ids) == 1 else f"{ids[0]} .. {ids[-1]} ({len(ids)} shards)"
