"""The shard store: immutable Parquet part files committed in state.sqlite, and each finished shard compacted.

Layout: run_dir/shards/<shard_id>/part-<seq:06d>.parquet (zstd, SHARD_SCHEMA) while a shard is being
generated; run_dir/shards/<shard_id>/shard.parquet (the same rows, one file) once it is finished and
compacted; and run_dir/state.sqlite (WAL, synchronous=FULL) with the tables

    parts(path TEXT PRIMARY KEY, shard_id, rows, committed_at, seq, bytes)   -- part files and shard files
    samples(sample_id TEXT PRIMARY KEY, shard_id, part_path, conversation_id, turn, output_len,
            finish_reason, empty, answer NULL, prompt_len, reasoning_tokens,
            think NULL)     -- engine.text.answer_shape.THINK_STATES index; NULL: committed before it was kept
                            -- (rowid order is commit order: the data-quality brake's window reads the last rows)
    shards(shard_id TEXT PRIMARY KEY, total, paused, total_samples NULL,
           done_samples, output_tokens, empty, truncated, parts,   -- counters kept in the commit txn
           next_seq,                                               -- part numbers are never reused
           repetition)                                 -- finish_reason "repetition" (added to older stores)
    outcomes(sample_id TEXT PRIMARY KEY, shard_id, outcome, reason, settled_at)
                                                           -- samples settled without a row: rejected | failed
    meta(key TEXT PRIMARY KEY, value)   -- also the data-quality brake's record (brake(), set_brake())
    alerts(key TEXT PRIMARY KEY, severity, text, evidence, raised_at)
                                        -- the alerts raised now (engine.store.alert_record): a row per condition that
                                        -- holds, removed when it is cleared; a restarted supervisor loads them

A commit is: validate rows -> refuse duplicates -> write part-N.parquet.tmp, fsync -> rename to
part-N.parquet, fsync the directory -> ONE sqlite transaction (part row, every sample id, the
shard's counters). A part file is committed iff its row is in `parts`; a crash anywhere leaves
either a committed part or an orphan file that recover() removes.

A compaction (compact(), once every sample of the shard is settled for good) is: stream the shard's
committed parts, in commit order, into shard.parquet.tmp, fsync -> rename to shard.parquet, fsync the
directory -> ONE sqlite transaction that checks the shard's parts are still the ones it read and swaps
them for shard.parquet (the parts rows deleted, the shard file's row inserted, samples.part_path of
every sample moved to it) -> the old part files unlinked. sqlite decides which copy is committed, so a
SIGKILL at any step leaves exactly one: before the transaction the parts are committed and
shard.parquet is the orphan; after it shard.parquet is committed and the parts left on disk are the
orphans; recover() removes whichever is the orphan. Never both committed, never neither. A compacted
shard takes no more parts (commit() refuses): it is finished, so the fixed name cannot collide.

Readers: list files from sqlite (parts(), read_committed()): every committed sample is in exactly one
listed file at every instant. A reader that lists, then opens, may find a part gone (compacted in
between): list again (engine.store.stats does). Readers that glob instead of asking sqlite:
  shards/*/shard.parquet   safe at any moment, even during a run: each file is one finished shard,
                           whole (renamed only once written and fsynced), never duplicating another
                           (a shard.parquet not yet committed holds exactly its shard's committed rows)
  shards/*/*.parquet       safe only when no supervisor is running and the last one exited cleanly
                           (or after recover()): during a run, a part exists between its rename and its
                           commit, and a shard's parts and its shard.parquet exist side by side for the
                           moment between the rename and the unlinks of a compaction.

One writer per run dir: commit(), compact() and recover() take an exclusive flock on
run_dir/state.sqlite.writer.lock (released when the process dies), so a second supervisor cannot
interleave part files or remove another's in-flight part. Reading (progress, history, meta,
pause flags) needs no lock.
"""
from __future__ import annotations

import dataclasses
import fcntl
import os
from array import array
import re
import sqlite3
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from engine.text.answer_shape import THINK_CLOSE, THINK_OPEN, THINK_STATES, SampleShape, is_empty_answer, think_state
from engine.store.shard_schema import PART_COMPRESSION, PART_DICTIONARY, PART_STATISTICS, SHARD_SCHEMA

STATE_DB = "state.sqlite"
SHARDS_DIR = "shards"
WRITER_LOCK = "state.sqlite.writer.lock"
PART_RE = re.compile(r"^part-(\d+)\.parquet(\.tmp)?$")
SHARD_FILE = "shard.parquet"  # a compacted shard's one file
SHARD_FILE_RE = re.compile(r"^shard\.parquet(\.tmp)?$")
# finish_reason of an answer the runaway guard stopped (engine.run.runaway): degenerate repetition, its ids exact up
# to the stop; counted per shard like "length" (truncated), dropped by exports by default
REPETITION = "repetition"
# SampleShape.reasoning_unclosed over the samples table (counted per shard when the store's progress is read)
UNCLOSED_SQL = f"think={THINK_STATES.index('unterminated')} AND finish_reason!='{REPETITION}'"
# finish reasons of a cut turn: it ended at max_new_tokens, or the runaway guard stopped it (turns_after_cut)
CUT_FINISHES = ("length", REPETITION)
# the reject kind (outcomes.reason) of a later turn not generated because an earlier turn was cut (turns_after_cut
# = "stop"): rejected, so a restart keeps the decision
AFTER_CUT = "after_cut"
# rows per row group of a compacted shard file: the rewrite holds this many rows in memory (a 4,000-token
# sample is ~20 KB of ids and mask), and readers get row groups of a useful size, not one per part
COMPACT_ROW_GROUP_ROWS = 1024
_SQL_CHUNK = 500
BRAKE_KEY = "brake"  # meta: the data-quality brake's record (JSON, engine.run.brake) while the run is braked
BRAKE_FROM_KEY = "brake_window_from"  # meta: the brake's window holds only samples of a higher rowid (a resume)
_NON_SPACE = re.compile(r"\S")

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS parts(
    path TEXT PRIMARY KEY, shard_id TEXT NOT NULL, rows INT NOT NULL, committed_at REAL NOT NULL,
    seq INT NOT NULL, bytes INT NOT NULL);
CREATE INDEX IF NOT EXISTS parts_shard ON parts(shard_id, seq);
CREATE TABLE IF NOT EXISTS samples(
    sample_id TEXT PRIMARY KEY, shard_id TEXT NOT NULL, part_path TEXT NOT NULL, conversation_id TEXT NOT NULL,
    turn INT NOT NULL, output_len INT NOT NULL, finish_reason TEXT NOT NULL, empty INT NOT NULL, answer TEXT,
    prompt_len INT NOT NULL DEFAULT 0, reasoning_tokens INT NOT NULL DEFAULT 0, think INT);
CREATE INDEX IF NOT EXISTS samples_shard ON samples(shard_id, output_len, empty, finish_reason);
CREATE INDEX IF NOT EXISTS samples_conversation ON samples(conversation_id, turn);
CREATE INDEX IF NOT EXISTS samples_part ON samples(part_path);
CREATE TABLE IF NOT EXISTS shards(
    shard_id TEXT PRIMARY KEY, total INT NOT NULL, paused INT NOT NULL DEFAULT 0, total_samples INT,
    done_samples INT NOT NULL DEFAULT 0, output_tokens INT NOT NULL DEFAULT 0, empty INT NOT NULL DEFAULT 0,
    truncated INT NOT NULL DEFAULT 0, parts INT NOT NULL DEFAULT 0, next_seq INT NOT NULL DEFAULT 0,
    repetition INT NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS outcomes(
    sample_id TEXT PRIMARY KEY, shard_id TEXT NOT NULL, outcome TEXT NOT NULL, reason TEXT NOT NULL,
    settled_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS outcomes_shard ON outcomes(shard_id, outcome);
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS alerts(
    key TEXT PRIMARY KEY, severity TEXT NOT NULL, text TEXT NOT NULL, evidence TEXT NOT NULL, raised_at REAL NOT NULL);
"""


def shard_id_for(index: int, shard_size: int) -> str:
    return f"s{index // shard_size:05d}"


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


@dataclass
class PartInfo:
    shard_id: str
    path: str  # relative to the run dir
    rows: int
    committed_at: float
    seq: int = 0
    bytes: int = 0
    # sums over the part's rows, set by commit() (parts() leaves them 0: the shards table keeps the totals)
    output_tokens: int = field(default=0, compare=False)
    empty: int = field(default=0, compare=False)
    truncated: int = field(default=0, compare=False)
    repetition: int = field(default=0, compare=False)
    shapes: tuple[SampleShape, ...] = field(default=(), compare=False, repr=False)  # each row's, in commit order


@dataclass(frozen=True)
class StoredAlert:
    """A row of the alerts table: a condition raised and not cleared (engine.store.alert_record)."""
    key: str
    severity: str
    text: str
    evidence: str
    raised_at: float


class DuplicateSample(Exception):
    """A sample id already committed (or twice in one batch); nothing was written."""

    def __init__(self, message: str, sample_ids: list[str]):
        super().__init__(message)
        self.sample_ids = sample_ids


@dataclass(frozen=True)
class Compaction:
    """A shard rewritten as one file (ShardStore.compact)."""
    shard_id: str
    path: str  # the shard's file, relative to the run dir
    rows: int
    bytes: int
    parts_removed: int
    seconds: float


class CompactionConflict(Exception):
    """The shard's parts changed while it was being compacted: nothing was swapped (a caller's bug: only a
    shard settled for good is compacted)."""


class StoreBusy(Exception):
    """Another live process holds the writer lock of this run dir."""


class StoreError(OSError):
    """The store's files or database failed (disk full, I/O error, locked): nothing was committed.
    An OSError, so callers that keep rows and retry on I/O errors handle it the same way."""


class ShardStore:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.shards_dir = self.run_dir / SHARDS_DIR
        self.db_path = self.run_dir / STATE_DB
        if not self.run_dir.is_dir():
            raise StoreError(f"run dir {self.run_dir} does not exist (prepare_run_dir creates it)")
        self._lock = threading.RLock()  # the sqlite connection and the seq numbers
        self._commit_lock = threading.RLock()  # writers: commit, recover, close (taken before _lock)
        self._writer_fd: int | None = None
        self._next_seq: dict[str, int] = {}
        try:
            self._db = sqlite3.connect(str(self.db_path), isolation_level=None, check_same_thread=False,
                                       timeout=30.0)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA busy_timeout=30000")
            self._db.executescript(SCHEMA_SQL)
            self._migrate()
            if "think" not in {r[1] for r in self._db.execute("PRAGMA table_info(samples)")}:
                self._db.execute("ALTER TABLE samples ADD COLUMN think INT")  # a store from before the column
            # only the unclosed rows: progress() counts them per shard without reading every sample (a full
            # scan of samples took ~0.15 s at 10^6 samples, twice before a resumed run's servers were launched)
            self._db.execute(f"CREATE INDEX IF NOT EXISTS samples_unclosed ON samples(shard_id) WHERE {UNCLOSED_SQL}")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open {self.db_path}: {exc}") from exc
        mode = self._db.execute("PRAGMA journal_mode").fetchone()[0]
        if mode.lower() != "wal":
            raise StoreError(f"{self.db_path}: journal_mode is {mode!r}, WAL could not be enabled "
                             "(network file systems do not support it; put the run dir on a local disk)")

    def _migrate(self) -> None:
        """A store from before the runaway guard: its shards table gains the repetition counter, counted from its
        samples (none of them is "repetition" unless a newer regen wrote them)."""
        if "repetition" in {r[1] for r in self._db.execute("PRAGMA table_info(shards)")}:
            return
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("ALTER TABLE shards ADD COLUMN repetition INT NOT NULL DEFAULT 0")
            db.execute("UPDATE shards SET repetition=(SELECT count(*) FROM samples WHERE samples.shard_id="
                       "shards.shard_id AND finish_reason=?)", (REPETITION,))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise

    # --- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        with self._commit_lock, self._lock:
            self._db.close()
            if self._writer_fd is not None:
                os.close(self._writer_fd)
                self._writer_fd = None

    def __enter__(self) -> ShardStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _acquire_writer(self) -> None:
        if self._writer_fd is not None:
            return
        path = self.run_dir / WRITER_LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StoreBusy(f"{self.run_dir} is being written by another process (pid {holder}, lock {path}); "
                            "stop that supervisor first") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._writer_fd = fd

    # --- recovery ----------------------------------------------------------------------------

    def recover(self) -> list[str]:
        """Remove *.tmp and uncommitted part and shard files (a compaction cut short leaves one side as
        the orphan); un-commit samples of parts missing on disk.
        Returns one line per thing removed (paths relative to the run dir)."""
        with self._commit_lock, self._lock:
            self._acquire_writer()
            removed: list[str] = []
            committed = {row[0] for row in self._db.execute("SELECT path FROM parts")}
            if self.shards_dir.is_dir():
                for shard_dir in sorted(p for p in self.shards_dir.iterdir() if p.is_dir()):
                    orphans = []  # (part number or -1 for a shard file, path)
                    for f in sorted(shard_dir.iterdir()):
                        m = PART_RE.match(f.name)
                        if (m or SHARD_FILE_RE.match(f.name)) and f.relative_to(self.run_dir).as_posix() not in committed:
                            orphans.append((int(m.group(1)) if m else -1, f))
                    if not orphans:
                        continue
                    # remember the orphans' numbers first, so no later part is ever named like one
                    self._db.execute("UPDATE shards SET next_seq=max(next_seq, ?) WHERE shard_id=?",
                                     (max(seq for seq, _ in orphans) + 1, shard_dir.name))
                    for _, f in orphans:
                        f.unlink()
                        removed.append(f.relative_to(self.run_dir).as_posix())
                    _fsync_dir(shard_dir)
            missing = [p for p in sorted(committed) if not (self.run_dir / p).is_file()]
            for rel in missing:
                n = self._uncommit_part(rel)
                removed.append(f"{rel} (committed part missing on disk: {n} samples un-committed, to be regenerated)")
            self._next_seq.clear()
            return removed

    def _uncommit_part(self, rel: str) -> int:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            shard_id = db.execute("SELECT shard_id FROM parts WHERE path=?", (rel,)).fetchone()[0]
            n, tokens, empty, truncated, repetition = db.execute(
                "SELECT count(*), coalesce(sum(output_len),0), coalesce(sum(empty),0),"
                " coalesce(sum(finish_reason='length'),0), coalesce(sum(finish_reason=?),0)"
                " FROM samples WHERE part_path=?", (REPETITION, rel)).fetchone()
            db.execute("DELETE FROM samples WHERE part_path=?", (rel,))
            db.execute("DELETE FROM parts WHERE path=?", (rel,))
            db.execute("UPDATE shards SET done_samples=done_samples-?, output_tokens=output_tokens-?, empty=empty-?,"
                       " truncated=truncated-?, repetition=repetition-?, parts=parts-1 WHERE shard_id=?",
                       (n, tokens, empty, truncated, repetition, shard_id))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return n

    # --- shards ------------------------------------------------------------------------------

    def ensure_shards(self, totals: Mapping[str, int], sample_totals: Mapping[str, int] | None = None) -> None:
        """Declare shards with their planned conversations (and, optionally, samples = user turns)."""
        sample_totals = sample_totals or {}
        with self._lock:
            db = self._db
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
        with self._lock:
            known = [r[0] for r in self._db.execute("SELECT shard_id FROM shards ORDER BY shard_id")]
            if shard_ids is None:
                targets = known
            else:
                targets = list(dict.fromkeys(shard_ids))
                unknown = sorted(set(targets) - set(known))
                if unknown:
                    raise KeyError(f"unknown shard(s): {', '.join(unknown)} (known: {_ranges(known)})")
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                for chunk in _chunks(targets):
                    db.execute(f"UPDATE shards SET paused=? WHERE shard_id IN ({','.join('?' * len(chunk))})",
                               (int(paused), *chunk))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            return targets

    def paused(self) -> set[str]:
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT shard_id FROM shards WHERE paused=1")}

    def progress(self) -> list[ShardProgress]:
        with self._lock:
            rows = self._db.execute(
                "SELECT shard_id, total, done_samples, output_tokens, empty, truncated, paused, parts, total_samples,"
                " repetition FROM shards ORDER BY shard_id").fetchall()
            settled: dict[tuple[str, str], int] = {
                (r[0], r[1]): r[2] for r in self._db.execute(
                    "SELECT shard_id, outcome, count(*) FROM outcomes GROUP BY shard_id, outcome")}
            after_cut: dict[str, int] = {r[0]: r[1] for r in self._db.execute(
                "SELECT shard_id, count(*) FROM outcomes WHERE outcome='rejected' AND reason=? GROUP BY shard_id",
                (AFTER_CUT,))}
            unclosed: dict[str, int] = {r[0]: r[1] for r in self._db.execute(
                f"SELECT shard_id, count(*) FROM samples WHERE {UNCLOSED_SQL} GROUP BY shard_id")}
        return [ShardProgress(r[0], r[1], r[2], r[3], r[4], r[5], bool(r[6]), r[7], r[8], repetition=r[9],
                              rejected=settled.get((r[0], "rejected"), 0), failed=settled.get((r[0], "failed"), 0),
                              after_cut=after_cut.get(r[0], 0), unclosed_reasoning=unclosed.get(r[0], 0))
                for r in rows]

    # --- samples -----------------------------------------------------------------------------

    def is_committed(self, sample_id: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM samples WHERE sample_id=?", (sample_id,)).fetchone() is not None

    def is_settled(self, sample_id: str) -> bool:
        """Committed, or settled without a row (rejected; failed in this run): not to be generated again."""
        with self._lock:
            return self._db.execute(
                "SELECT 1 FROM samples WHERE sample_id=? UNION ALL SELECT 1 FROM outcomes WHERE sample_id=? LIMIT 1",
                (sample_id, sample_id)).fetchone() is not None

    # --- outcomes of samples that get no row ---------------------------------------------------

    def settle(self, shard_id: str, sample_id: str, outcome: str, reason: str) -> None:
        """Record a sample settled without a row (outcome rejected | failed), so a status read from the run dir
        alone counts it and a restart does not generate a rejected one again."""
        if outcome not in ("rejected", "failed"):
            raise ValueError(f"outcome {outcome!r}: a sample without a row is 'rejected' or 'failed'")
        try:
            with self._lock:
                self._db.execute("INSERT OR REPLACE INTO outcomes(sample_id, shard_id, outcome, reason, settled_at)"
                                 " VALUES(?,?,?,?,?)", (sample_id, shard_id, outcome, reason, time.time()))
        except sqlite3.Error as exc:
            raise StoreError(f"cannot record {sample_id} as {outcome} in {self.db_path}: {exc}") from exc

    def forget_failed(self) -> int:
        """At a start: samples that failed in an earlier run are generated again (their retries were that run's)."""
        try:
            with self._lock:
                return self._db.execute("DELETE FROM outcomes WHERE outcome='failed'").rowcount
        except sqlite3.Error as exc:
            raise StoreError(f"cannot clear the failed samples of an earlier run in {self.db_path}: {exc}") from exc

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
            with self._lock:
                return self._db.execute(f"DELETE FROM outcomes WHERE {where}", args).rowcount
        except sqlite3.Error as exc:
            raise StoreError(f"cannot clear settled outcomes in {self.db_path}: {exc}") from exc

    def committed_samples(self) -> int:
        with self._lock:
            return self._db.execute("SELECT count(*) FROM samples").fetchone()[0]

    def history(self, conversation_id: str) -> dict[int, str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT turn, answer FROM samples WHERE conversation_id=? AND answer IS NOT NULL ORDER BY turn",
                (conversation_id,)).fetchall()
        return {int(t): a for t, a in rows}

    def cut_turn(self, conversation_id: str) -> tuple[int, str] | None:
        """The conversation's first committed turn that was cut (CUT_FINISHES) and its finish reason, or None."""
        with self._lock:
            row = self._db.execute(
                f"SELECT turn, finish_reason FROM samples WHERE conversation_id=? AND finish_reason IN "
                f"({','.join('?' * len(CUT_FINISHES))}) ORDER BY turn LIMIT 1",
                (conversation_id, *CUT_FINISHES)).fetchone()
        return None if row is None else (int(row[0]), str(row[1]))

    def parts(self, shard_id: str | None = None) -> list[PartInfo]:
        with self._lock:
            sql = "SELECT shard_id, path, rows, committed_at, seq, bytes FROM parts"
            args: tuple = ()
            if shard_id is not None:
                sql += " WHERE shard_id=?"
                args = (shard_id,)
            rows = self._db.execute(sql + " ORDER BY shard_id, seq", args).fetchall()
        return [PartInfo(*r) for r in rows]

    def get_meta(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        with self._lock:
            self._db.execute("INSERT INTO meta(key, value) VALUES(?,?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                             (key, value))

    # --- the data-quality brake's committed inputs and its record ------------------------------

    def recent_shapes(self, limit: int, after: int = 0) -> list[SampleShape]:
        """The shapes of the last `limit` committed samples (of rowid > after), oldest first: rowid order is
        commit order (each commit inserts its rows in one transaction)."""
        with self._lock:
            rows = self._db.execute("SELECT empty, finish_reason, think FROM samples WHERE rowid > ?"
                                    " ORDER BY rowid DESC LIMIT ?", (after, limit)).fetchall()
        return [SampleShape(bool(e), fr, THINK_STATES[t] if t is not None and 0 <= t < len(THINK_STATES) else None)
                for e, fr, t in reversed(rows)]

    def last_sample_rowid(self) -> int:
        with self._lock:
            return self._db.execute("SELECT coalesce(max(rowid), 0) FROM samples").fetchone()[0]

    def brake(self) -> tuple[str | None, int]:
        """(the brake's record as JSON or None when not braked, the rowid its window starts after)."""
        with self._lock:
            rows = dict(self._db.execute("SELECT key, value FROM meta WHERE key IN (?, ?)", (BRAKE_KEY, BRAKE_FROM_KEY)))
        try:
            after = int(rows.get(BRAKE_FROM_KEY) or 0)
        except ValueError:
            after = 0  # not written by regen: the window takes every committed sample
        return rows.get(BRAKE_KEY), after

    def set_brake(self, record: str | None, window_from: int | None = None) -> None:
        """Record the brake (JSON), or clear it (None); window_from: the window starts after this rowid from now
        on. One transaction, durable (synchronous=FULL) before it returns."""
        try:
            with self._lock:
                db = self._db
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
                             f"{self.db_path}: {exc}") from exc

    # --- the alerts raised now (engine.store.alert_record) --------------------------------------------

    def raised_alerts(self) -> list[StoredAlert]:
        """Every alert raised and not cleared, oldest first."""
        try:
            with self._lock:
                rows = self._db.execute("SELECT key, severity, text, evidence, raised_at FROM alerts"
                                        " ORDER BY raised_at, key").fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read the raised alerts in {self.db_path}: {exc}") from exc
        return [StoredAlert(*r) for r in rows]

    def record_alert(self, alert: StoredAlert) -> None:
        """Record a raised alert (replacing the row of its key); durable (synchronous=FULL) before it returns."""
        try:
            with self._lock:
                self._db.execute("INSERT INTO alerts(key, severity, text, evidence, raised_at) VALUES(?,?,?,?,?)"
                                 " ON CONFLICT(key) DO UPDATE SET severity=excluded.severity, text=excluded.text,"
                                 " evidence=excluded.evidence, raised_at=excluded.raised_at",
                                 (alert.key, alert.severity, alert.text, alert.evidence, alert.raised_at))
        except sqlite3.Error as exc:
            raise StoreError(f"cannot record the alert {alert.key!r} in {self.db_path}: {exc}") from exc

    def drop_alert(self, key: str) -> None:
        """Remove a cleared alert's row (nothing when there is none)."""
        try:
            with self._lock:
                self._db.execute("DELETE FROM alerts WHERE key=?", (key,))
        except sqlite3.Error as exc:
            raise StoreError(f"cannot remove the cleared alert {key!r} from {self.db_path}: {exc}") from exc

    # --- commit ------------------------------------------------------------------------------

    def commit(self, shard_id: str, rows: list[dict], history: Mapping[str, str] = {}) -> PartInfo:  # noqa: B006
        """Write one immutable part with `rows` and commit it with its sample ids (and the
        `history` answers, sample_id -> text, kept for chaining multi-turn conversations)."""
        if not rows:
            raise ValueError(f"commit to shard {shard_id}: no rows")
        table = build_table(rows)  # CPU only: no lock held, readers on other threads go on
        ids = table.column("sample_id").to_pylist()
        extra = sorted(set(history) - set(ids))
        if extra:
            raise ValueError(f"commit to shard {shard_id}: history given for sample(s) not in this part: {extra[:5]}")
        # _commit_lock: one commit at a time (so the duplicate check still holds at the insert);
        # _lock (the sqlite connection) only around the database steps, not the Parquet write
        # and fsyncs, so a commit in the committer's thread never stalls readers on the loop
        with self._commit_lock:
            with self._lock:
                self._acquire_writer()
                known = self._db.execute("SELECT paused FROM shards WHERE shard_id=?", (shard_id,)).fetchone()
                if known is None:
                    raise ValueError(f"commit to unknown shard {shard_id}: declare it with ensure_shards() first")
                if self._compacted(shard_id):
                    raise ValueError(f"commit to shard {shard_id}: it is compacted into {self._shard_file(shard_id)} "
                                     "and takes no more parts (a shard is compacted only once every sample of it "
                                     "is committed or rejected)")
                self._check_duplicates(ids)
                seq = self._take_seq(shard_id)
            shard_dir = self.shards_dir / shard_id
            final = shard_dir / f"part-{seq:06d}.parquet"
            rel = final.relative_to(self.run_dir).as_posix()
            tmp = shard_dir / (final.name + ".tmp")
            nbytes = self._write_tmp(table, tmp)
            self._publish(tmp, final)
            info = PartInfo(shard_id, rel, len(ids), time.time(), seq, nbytes)
            try:
                try:
                    info = self._record(info, table, history, rows)  # takes _lock for its transaction only
                except sqlite3.Error as exc:
                    raise StoreError(f"commit of {rel} ({len(ids)} samples) failed in {self.db_path}: {exc}; "
                                     "nothing was committed") from exc
            except BaseException as exc:
                # nothing is committed; the file must not outlive the failure (readers trust sqlite,
                # but a glob over the shard dirs should not see it either)
                try:
                    final.unlink()
                    _fsync_dir(shard_dir)
                except OSError as unlink_exc:
                    raise StoreError(f"commit of {rel} failed ({exc!r}) and the uncommitted file could not be "
                                     f"removed ({unlink_exc}); recover() removes it at the next start") from exc
                raise
            return info

    # --- compaction ----------------------------------------------------------------------------

    def compact(self, shard_id: str) -> Compaction | None:
        """Rewrite the shard's committed parts as one file, shards/<shard_id>/shard.parquet, and swap it in
        (the protocol and its crash cases are in the module docstring). None when there is nothing to do: no
        committed row, or already compacted. Call it only for a shard whose samples are all settled for good
        (committed or rejected): commit() refuses parts to a compacted shard.

        Locks: the writer flock, and the commit lock only for the swap transaction, so commits of other
        shards go on while the file is rewritten. Raises CompactionConflict (nothing swapped, the new file
        removed) if the shard's parts changed meanwhile, StoreError on an I/O or database failure."""
        started = time.monotonic()
        with self._commit_lock, self._lock:
            self._acquire_writer()
            parts = self.parts(shard_id)
        if not parts or (len(parts) == 1 and parts[0].path == self._shard_file(shard_id)):
            return None
        shard_dir = self.shards_dir / shard_id
        final = shard_dir / SHARD_FILE
        rel = final.relative_to(self.run_dir).as_posix()
        if rel in {p.path for p in parts}:
            raise StoreError(f"{rel} is committed beside {len(parts) - 1} part(s) of {shard_id}: a compacted shard "
                             "takes no more parts; this store was written by something else than regen")
        tmp = shard_dir / (SHARD_FILE + ".tmp")
        try:
            rows, nbytes = self._write_compacted(parts, tmp)
            self._publish(tmp, final)
        except StoreError:
            raise
        except OSError as exc:
            raise StoreError(f"compaction of {shard_id}: cannot rewrite its parts into {rel}: {exc}; "
                             "its parts stay committed") from exc
        try:
            self._swap(shard_id, parts, PartInfo(shard_id, rel, rows, time.time(), 0, nbytes))
        except BaseException as exc:
            # the parts stay committed; the new file must not outlive the failure (recover() would remove it)
            try:
                final.unlink()
                _fsync_dir(shard_dir)
            except OSError as unlink_exc:
                raise StoreError(f"compaction of {shard_id} failed ({exc!r}) and {rel} could not be removed "
                                 f"({unlink_exc}); recover() removes it at the next start") from exc
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"compaction of {shard_id} failed in {self.db_path}: {exc}; its parts stay "
                                 "committed") from exc
            raise
        # committed: the parts are orphans now, removed here (or by recover() after a crash)
        for p in parts:
            (self.run_dir / p.path).unlink(missing_ok=True)
        _fsync_dir(shard_dir)
        return Compaction(shard_id, rel, rows, nbytes, len(parts), time.monotonic() - started)

    def compacted_shards(self) -> set[str]:
        """Shards whose committed rows are in one compacted file."""
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT shard_id FROM parts WHERE path LIKE ?",
                                                   (f"%/{SHARD_FILE}",))}

    def _compacted(self, shard_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM parts WHERE path=?", (self._shard_file(shard_id),)).fetchone() is not None

    def _shard_file(self, shard_id: str) -> str:
        return f"{SHARDS_DIR}/{shard_id}/{SHARD_FILE}"

    def _write_compacted(self, parts: list[PartInfo], tmp: Path) -> tuple[int, int]:
        """The parts' rows, in commit order, into `tmp` (fsynced): one part in memory at a time, written in row
        groups of COMPACT_ROW_GROUP_ROWS. Returns (rows, bytes)."""
        rows = 0
        try:
            with open(tmp, "xb") as f:
                writer = pq.ParquetWriter(f, SHARD_SCHEMA, compression=PART_COMPRESSION,
                                          use_dictionary=PART_DICTIONARY, write_statistics=PART_STATISTICS)
                try:  # closed before the file either way (on a failure, the file is removed below)
                    pending: list[pa.Table] = []
                    buffered = 0
                    for p in parts:
                        table = _conform(pq.read_table(self.run_dir / p.path), p.path)
                        if table.num_rows != p.rows:
                            raise StoreError(f"{p.path} has {table.num_rows} rows, {STATE_DB} says {p.rows}: "
                                             "not compacting a shard whose files disagree with the store")
                        pending.append(table)
                        buffered += table.num_rows
                        if buffered >= COMPACT_ROW_GROUP_ROWS:
                            writer.write_table(pa.concat_tables(pending), row_group_size=buffered)
                            rows += buffered
                            pending, buffered = [], 0
                    if pending:
                        writer.write_table(pa.concat_tables(pending), row_group_size=buffered)
                        rows += buffered
                finally:
                    writer.close()
                f.flush()
                os.fsync(f.fileno())
                return rows, f.tell()
        except BaseException:
            if tmp.exists():
                tmp.unlink()
            raise

    def _swap(self, shard_id: str, parts: list[PartInfo], info: PartInfo) -> None:
        """The one sqlite transaction that makes the shard file committed in place of the parts."""
        with self._commit_lock, self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                now = [r[0] for r in db.execute("SELECT path FROM parts WHERE shard_id=? ORDER BY seq", (shard_id,))]
                if now != [p.path for p in parts]:
                    raise CompactionConflict(f"compaction of {shard_id}: its parts changed while it was rewritten "
                                             f"({len(parts)} read, {len(now)} now): nothing swapped")
                samples = db.execute("SELECT count(*) FROM samples WHERE shard_id=?", (shard_id,)).fetchone()[0]
                if samples != info.rows:
                    raise StoreError(f"compaction of {shard_id}: {info.rows} rows written, {STATE_DB} has {samples} "
                                     "samples of the shard: nothing swapped")
                seq = self._take_seq(shard_id)
                db.execute("DELETE FROM parts WHERE shard_id=?", (shard_id,))
                db.execute("INSERT INTO parts(path, shard_id, rows, committed_at, seq, bytes) VALUES(?,?,?,?,?,?)",
                           (info.path, shard_id, info.rows, info.committed_at, seq, info.bytes))
                db.execute("UPDATE samples SET part_path=? WHERE shard_id=?", (info.path, shard_id))
                db.execute("UPDATE shards SET parts=1, next_seq=max(next_seq, ?) WHERE shard_id=?", (seq + 1, shard_id))
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                self._next_seq.pop(shard_id, None)
                raise

    def _check_duplicates(self, ids: list[str]) -> None:
        repeated = sorted(i for i, n in Counter(ids).items() if n > 1)
        if repeated:
            raise DuplicateSample(f"sample id(s) repeated in one commit: {', '.join(repeated[:5])}"
                                  + (f" and {len(repeated) - 5} more" if len(repeated) > 5 else ""), repeated)
        found: list[tuple[str, str]] = []
        for chunk in _chunks(ids):
            found += self._db.execute(
                f"SELECT sample_id, part_path FROM samples WHERE sample_id IN ({','.join('?' * len(chunk))})",
                chunk).fetchall()
        if found:
            found.sort()
            shown = ", ".join(f"{sid} (in {part})" for sid, part in found[:5])
            raise DuplicateSample(f"sample(s) already committed: {shown}"
                                  + (f" and {len(found) - 5} more" if len(found) > 5 else ""), [f[0] for f in found])

    def _take_seq(self, shard_id: str) -> int:
        """Never reuse a sequence number, not even one of a file a crash left behind."""
        seq = self._next_seq.get(shard_id)
        if seq is None:
            on_disk = -1
            shard_dir = self.shards_dir / shard_id
            if shard_dir.is_dir():
                for f in shard_dir.iterdir():
                    m = PART_RE.match(f.name)
                    if m:
                        on_disk = max(on_disk, int(m.group(1)))
            row = self._db.execute("SELECT max(seq) FROM parts WHERE shard_id=?", (shard_id,)).fetchone()
            committed = row[0] if row[0] is not None else -1
            floor = self._db.execute("SELECT next_seq FROM shards WHERE shard_id=?", (shard_id,)).fetchone()
            seq = max(on_disk + 1, committed + 1, floor[0] if floor else 0)
        self._next_seq[shard_id] = seq + 1
        return seq

    def _write_tmp(self, table: pa.Table, tmp: Path) -> int:
        new_dir = not tmp.parent.is_dir()
        if new_dir:
            self.shards_dir.mkdir(mode=0o700, exist_ok=True)
            tmp.parent.mkdir(mode=0o700, exist_ok=True)
            _fsync_dir(self.shards_dir)
        try:
            with open(tmp, "xb") as f:
                pq.write_table(table, f, compression=PART_COMPRESSION, use_dictionary=PART_DICTIONARY,
                               write_statistics=PART_STATISTICS)
                f.flush()
                os.fsync(f.fileno())
                return f.tell()
        except BaseException:
            if tmp.exists():
                tmp.unlink()
            raise

    def _publish(self, tmp: Path, final: Path) -> None:
        os.replace(tmp, final)
        _fsync_dir(final.parent)

    def _record(self, info: PartInfo, table: pa.Table, history: Mapping[str, str], rows: list[dict]) -> PartInfo:
        """The one sqlite transaction that makes the part (and every sample in it) committed."""
        cols = {name: table.column(name).to_pylist() for name in
                ("sample_id", "conversation_id", "turn", "output_len", "finish_reason", "prompt_len",
                 "reasoning_tokens", "prompt_opened")}
        # the rows' own texts when they are str (the column holds exactly them): not ~4 MB a part decoded again
        texts = [r["text"] for r in rows]
        cols["text"] = texts if all(type(t) is str for t in texts) else table.column("text").to_pylist()
        empty = [int(_is_empty(t, opened)) for t, opened in zip(cols["text"], cols["prompt_opened"])]
        think = [_think_code(t, opened) for t, opened in zip(cols["text"], cols["prompt_opened"])]
        samples = [
            (sid, info.shard_id, info.path, cid, turn, olen, fr, e, history.get(sid), plen, rt, th)
            for sid, cid, turn, olen, fr, e, plen, rt, th in zip(
                cols["sample_id"], cols["conversation_id"], cols["turn"], cols["output_len"],
                cols["finish_reason"], empty, cols["prompt_len"], cols["reasoning_tokens"], think)
        ]
        tokens = sum(cols["output_len"])
        truncated = sum(1 for fr in cols["finish_reason"] if fr == "length")
        repetition = sum(1 for fr in cols["finish_reason"] if fr == REPETITION)
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("INSERT INTO parts(path, shard_id, rows, committed_at, seq, bytes) VALUES(?,?,?,?,?,?)",
                           (info.path, info.shard_id, info.rows, info.committed_at, info.seq, info.bytes))
                db.executemany("INSERT INTO samples(sample_id, shard_id, part_path, conversation_id, turn, output_len,"
                               " finish_reason, empty, answer, prompt_len, reasoning_tokens, think)"
                               " VALUES(?,?,?,?,?,?,?,?,?,?,?,?)", samples)
                db.execute("UPDATE shards SET done_samples=done_samples+?, output_tokens=output_tokens+?,"
                           " empty=empty+?, truncated=truncated+?, repetition=repetition+?, parts=parts+1,"
                           " next_seq=max(next_seq, ?) WHERE shard_id=?",
                           (len(samples), tokens, sum(empty), truncated, repetition, info.seq + 1, info.shard_id))
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise
        shapes = tuple(SampleShape(bool(e), fr, THINK_STATES[th]) for e, fr, th in zip(empty, cols["finish_reason"], think))
        return dataclasses.replace(info, output_tokens=tokens, empty=sum(empty), truncated=truncated,
                                   repetition=repetition, shapes=shapes)


def build_table(rows: list[dict]) -> pa.Table:
    """Rows -> a SHARD_SCHEMA table, validating the token/mask invariants of every sample.

    The usual row (loss_mask exactly `[0] * prompt_len + [1] * output_len`, checked per row with
    list.count/index at C speed) gets its loss_mask column built from the lengths with numpy
    instead of converting ~10^6 Python ints per part; any other row takes the general path, which
    converts every value and names the first bad sample and position."""
    names = SHARD_SCHEMA.names
    for i, r in enumerate(rows):
        missing = [n for n in names if n not in r]
        if missing:
            raise ValueError(f"sample {r.get('sample_id', f'#{i}')!r}: missing field(s) {', '.join(missing)}")
    masks_from_lengths = _standard_masks(rows)
    arrays: list[Any] = []  # pyarrow arrays (pyarrow is untyped); None: loss_mask, until built from the lengths
    for fld in SHARD_SCHEMA:
        if fld.name == "loss_mask" and masks_from_lengths:
            arrays.append(None)  # built below from the (validated) prompt/output lengths
            continue
        if fld.name == "input_ids" and _INT32_ARRAYS and all(
                type(v) is array and v.typecode == "i" for v in (r["input_ids"] for r in rows)):
            arrays.append(_int32_lists([r["input_ids"] for r in rows]))  # int32 already: one copy
            continue
        values = [r[fld.name] for r in rows]
        if fld.name == "loss_mask":  # the general path: a compacted row's mask written out again
            values = [[0] * r["prompt_len"] + [1] * r["output_len"] if v is STANDARD_MASK else v
                      for r, v in zip(rows, values)]
        try:
            arrays.append(pa.array(values, type=fld.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
            bad = _first_bad(values, fld.type)
            sid = rows[bad].get("sample_id") if bad is not None else None
            raise ValueError(f"sample {sid!r}: field {fld.name} is not {fld.type}: {exc}") from exc
        if arrays[-1].null_count:
            bad = next(i for i, v in enumerate(values) if v is None)
            raise ValueError(f"sample {rows[bad].get('sample_id')!r}: field {fld.name} is null")
    if masks_from_lengths:
        prompt_len = arrays[names.index("prompt_len")].to_numpy()
        output_len = arrays[names.index("output_len")].to_numpy()
        ids = arrays[names.index("input_ids")]
        n_ids = np.diff(ids.offsets.to_numpy())
        n_mask = prompt_len + output_len
        mismatched = np.flatnonzero(n_ids != n_mask)  # the masks are right by construction; the ids' lengths are not
        if mismatched.size:
            i = int(mismatched[0])
            raise ValueError(f"sample {rows[i]['sample_id']!r}: len(input_ids)={n_ids[i]} != len(loss_mask)={n_mask[i]}")
        arrays[names.index("loss_mask")] = _masks_array(prompt_len, output_len)
        return pa.Table.from_arrays(arrays, schema=SHARD_SCHEMA)
    table = pa.Table.from_arrays(arrays, schema=SHARD_SCHEMA)
    _validate_masks(table)
    return table


_INT32_ARRAYS = array("i").itemsize == 4


class _StandardMask:
    """Stands for a loss_mask already checked to be [0] * prompt_len + [1] * output_len (compact_row)."""
    __slots__ = ()

    def __repr__(self) -> str:
        return "STANDARD_MASK"


STANDARD_MASK = _StandardMask()


def compact_row(row: dict) -> dict:
    """The same row, smaller while it waits in memory for its commit (in place): input_ids as an
    int32 array, a standard loss_mask (checked here) as STANDARD_MASK. Neither is a container the
    garbage collector scans: ~8000 fewer references per 4000-token answer each time it walks
    the young generations. A value that does not convert is left as it is, so build_table names
    it in its error exactly as before."""
    ids = row.get("input_ids")
    if _INT32_ARRAYS and type(ids) is list:
        try:
            row["input_ids"] = array("i", ids)
        except (TypeError, OverflowError):
            pass
    if "loss_mask" in row and "prompt_len" in row and "output_len" in row and _standard_mask(row):
        row["loss_mask"] = STANDARD_MASK
    return row


def _int32_lists(values: list[array]) -> pa.ListArray:
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum([len(v) for v in values], out=offsets[1:])
    flat = np.frombuffer(b"".join(values), dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), pa.array(flat, type=pa.int32()))


def _standard_masks(rows: list[dict]) -> bool:
    """True when every row's loss_mask is STANDARD_MASK or a list equal to [0] * prompt_len +
    [1] * output_len (non-negative int lengths)."""
    return all(r["loss_mask"] is STANDARD_MASK or _standard_mask(r) for r in rows)


def _standard_mask(r: dict) -> bool:
    """Exactly p zeros and o ones, the first 1 at position p (list.count / index run at C speed)."""
    mask, p, o = r["loss_mask"], r["prompt_len"], r["output_len"]
    if type(mask) is not list or type(p) is not int or type(o) is not int or p < 0 or o < 0:
        return False
    return len(mask) == p + o and mask.count(0) == p and mask.count(1) == o and (not o or mask.index(1) == p)


def _masks_array(prompt_len: np.ndarray, output_len: np.ndarray) -> pa.ListArray:
    n = len(prompt_len)
    lengths = np.column_stack([prompt_len, output_len]).ravel()
    values = np.repeat(np.tile(np.array([0, 1], dtype=np.uint8), n), lengths)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(prompt_len + output_len, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), pa.array(values, type=pa.uint8()))


def _first_bad(values: list, typ: pa.DataType) -> int | None:
    for i, v in enumerate(values):
        try:
            pa.array([v], type=typ)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
            return i
    return None


def _validate_masks(table: pa.Table) -> None:
    ids = table.column("input_ids").combine_chunks()
    mask = table.column("loss_mask").combine_chunks()
    n_ids = np.diff(ids.offsets.to_numpy())
    n_mask = np.diff(mask.offsets.to_numpy())
    prompt_len = table.column("prompt_len").to_numpy()
    output_len = table.column("output_len").to_numpy()
    sample_ids = table.column("sample_id")

    def fail(i: int, what: str):
        raise ValueError(f"sample {sample_ids[int(i)].as_py()!r}: {what}")

    bad = np.flatnonzero(n_ids != n_mask)
    if bad.size:
        i = bad[0]
        fail(i, f"len(input_ids)={n_ids[i]} != len(loss_mask)={n_mask[i]}")
    bad = np.flatnonzero((prompt_len < 0) | (output_len < 0) | (prompt_len + output_len != n_ids))
    if bad.size:
        i = bad[0]
        fail(i, f"prompt_len {prompt_len[i]} + output_len {output_len[i]} != len(input_ids) {n_ids[i]}")
    values = mask.flatten().to_numpy(zero_copy_only=False)
    offsets = mask.offsets.to_numpy()
    cumulative = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
    sums = cumulative[offsets[1:]] - cumulative[offsets[:-1]]
    bad = np.flatnonzero(sums != output_len)
    if bad.size:
        i = bad[0]
        fail(i, f"sum(loss_mask)={int(sums[i])} != output_len={output_len[i]}")
    expected = np.repeat(np.tile(np.array([0, 1], dtype=values.dtype), len(n_mask)),
                         np.column_stack([prompt_len, output_len]).ravel())
    wrong = np.flatnonzero(values != expected)
    if wrong.size:
        row = int(np.searchsorted(offsets, wrong[0], side="right") - 1)
        pos = int(wrong[0] - offsets[row])
        fail(row, f"loss_mask[{pos}]={int(values[wrong[0]])}: must be 0 on the prompt "
                  f"(first {prompt_len[row]} tokens) and 1 on the output")


def _is_empty(text: str, prompt_opened: bool) -> bool:
    """is_empty_answer(text, prompt_opened), without copying a long answer: a reasoning block with any
    non-space character is never empty (the common case, decided by two searches)."""
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        opened = text.find(THINK_OPEN, 0, close)
        if _NON_SPACE.search(text, opened + len(THINK_OPEN) if opened >= 0 else 0, close):
            return False
    return is_empty_answer(text, prompt_opened)


def _think_code(text: str, prompt_opened: bool) -> int:
    """think_state(text, prompt_opened) as its index in THINK_STATES (the samples table's `think` column)."""
    return THINK_STATES.index(think_state(text, prompt_opened))


def _conform(table: pa.Table, rel: str) -> pa.Table:
    """A part's table in SHARD_SCHEMA: a part written before the prompt_opened column existed gets it as False
    (as every reader reads it); any other missing column is an error naming it."""
    if "prompt_opened" not in table.column_names:
        table = table.append_column("prompt_opened", pa.array([False] * table.num_rows, pa.bool_()))
    missing = [n for n in SHARD_SCHEMA.names if n not in table.column_names]
    if missing:
        raise StoreError(f"{rel} lacks column(s) {', '.join(missing)}: not compacting a shard with a part of "
                         "another schema")
    return table.select(SHARD_SCHEMA.names).cast(SHARD_SCHEMA)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _chunks(items: list) -> Iterable[list]:
    items = list(items)
    for i in range(0, len(items), _SQL_CHUNK):
        yield items[i:i + _SQL_CHUNK]


def _ranges(ids: list[str]) -> str:
    if not ids:
        return "none"
    return ids[0] if len(ids) == 1 else f"{ids[0]} .. {ids[-1]} ({len(ids)} shards)"


# --- read-only view, for readers beside a running writer (stats) --------------------------------


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
                if outcome == "rejected" and reason == AFTER_CUT:
                    not_generated[AFTER_CUT] = int(n)
    finally:
        db.close()
    return CommittedParts(parts, recorded, shards, not_generated)
