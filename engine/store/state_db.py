"""The store's state database, state.sqlite (WAL, synchronous=FULL): its schema, the connection and its locks, the
writer's flock (one writer per run dir), the part numbers (never reused) and the listing of committed files.
A file is committed iff its row is in `parts`; readers list files from here, never by globbing during a run.
"""
from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from engine.store.names import PART_RE, REPETITION, SHARDS_DIR, STATE_DB, WRITER_LOCK, shard_file
from engine.text.answer_shape import THINK_STATES, SampleShape

# SampleShape.reasoning_unclosed over the samples table (counted per shard when the store's progress is read)
UNCLOSED_SQL = f"think={THINK_STATES.index('unterminated')} AND finish_reason!='{REPETITION}'"
_SQL_CHUNK = 500

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


class StoreBusy(Exception):
    """Another live process holds the writer lock of this run dir."""


class StoreError(OSError):
    """The store's files or database failed (disk full, I/O error, locked): nothing was committed.
    An OSError, so callers that keep rows and retry on I/O errors handle it the same way."""


class StateDb:
    """state.sqlite of one run dir, shared by the store's writer, compaction, recovery and queries."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.shards_dir = self.run_dir / SHARDS_DIR
        self.db_path = self.run_dir / STATE_DB
        if not self.run_dir.is_dir():
            raise StoreError(f"run dir {self.run_dir} does not exist (prepare_run_dir creates it)")
        self.lock = threading.RLock()  # the sqlite connection and the seq numbers
        self.commit_lock = threading.RLock()  # writers: commit, recover, close (taken before lock)
        self.writer_fd: int | None = None
        self.next_seq: dict[str, int] = {}
        try:
            self.db = sqlite3.connect(str(self.db_path), isolation_level=None, check_same_thread=False,
                                      timeout=30.0)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("PRAGMA busy_timeout=30000")
            self.db.executescript(SCHEMA_SQL)
            self.migrate()
            if "think" not in {r[1] for r in self.db.execute("PRAGMA table_info(samples)")}:
                self.db.execute("ALTER TABLE samples ADD COLUMN think INT")  # a store from before the column
            # only the unclosed rows: progress() counts them per shard without reading every sample (a full
            # scan of samples took ~0.15 s at 10^6 samples, twice before a resumed run's servers were launched)
            self.db.execute(f"CREATE INDEX IF NOT EXISTS samples_unclosed ON samples(shard_id) WHERE {UNCLOSED_SQL}")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open {self.db_path}: {exc}") from exc
        mode = self.db.execute("PRAGMA journal_mode").fetchone()[0]
        if mode.lower() != "wal":
            raise StoreError(f"{self.db_path}: journal_mode is {mode!r}, WAL could not be enabled "
                             "(network file systems do not support it; put the run dir on a local disk)")

    def migrate(self) -> None:
        """A store from before the runaway guard: its shards table gains the repetition counter, counted from its
        samples (none of them is "repetition" unless a newer regen wrote them)."""
        if "repetition" in {r[1] for r in self.db.execute("PRAGMA table_info(shards)")}:
            return
        db = self.db
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

    def close(self) -> None:
        with self.commit_lock, self.lock:
            self.db.close()
            if self.writer_fd is not None:
                os.close(self.writer_fd)
                self.writer_fd = None

    def acquire_writer(self) -> None:
        if self.writer_fd is not None:
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
        self.writer_fd = fd

    def take_seq(self, shard_id: str) -> int:
        """Never reuse a sequence number, not even one of a file a crash left behind."""
        seq = self.next_seq.get(shard_id)
        if seq is None:
            on_disk = -1
            shard_dir = self.shards_dir / shard_id
            if shard_dir.is_dir():
                for f in shard_dir.iterdir():
                    m = PART_RE.match(f.name)
                    if m:
                        on_disk = max(on_disk, int(m.group(1)))
            row = self.db.execute("SELECT max(seq) FROM parts WHERE shard_id=?", (shard_id,)).fetchone()
            committed = row[0] if row[0] is not None else -1
            floor = self.db.execute("SELECT next_seq FROM shards WHERE shard_id=?", (shard_id,)).fetchone()
            seq = max(on_disk + 1, committed + 1, floor[0] if floor else 0)
        self.next_seq[shard_id] = seq + 1
        return seq

    def parts(self, shard_id: str | None = None) -> list[PartInfo]:
        with self.lock:
            sql = "SELECT shard_id, path, rows, committed_at, seq, bytes FROM parts"
            args: tuple = ()
            if shard_id is not None:
                sql += " WHERE shard_id=?"
                args = (shard_id,)
            rows = self.db.execute(sql + " ORDER BY shard_id, seq", args).fetchall()
        return [PartInfo(*r) for r in rows]

    def compacted(self, shard_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM parts WHERE path=?", (shard_file(shard_id),)).fetchone() is not None


def chunks(items: list) -> Iterable[list]:
    items = list(items)
    for i in range(0, len(items), _SQL_CHUNK):
        yield items[i:i + _SQL_CHUNK]
