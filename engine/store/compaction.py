"""Compaction of a finished shard: its committed parts streamed, in commit order, into shard.parquet (tmp, fsync,
rename), then ONE sqlite transaction swaps the parts' rows for the shard file's, then the parts are unlinked. sqlite
decides which copy is committed, so a SIGKILL at any step leaves exactly one; recovery removes the other.
"""
from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from engine.store.names import SHARD_FILE, STATE_DB, fsync_dir, publish, shard_file, withdraw
from engine.store.shard_schema import PART_COMPRESSION, PART_DICTIONARY, PART_STATISTICS, SHARD_SCHEMA
from engine.store.state_db import PartInfo, StateDb, StoreError

# rows per row group of a compacted shard file: the rewrite holds this many rows in memory (a 4,000-token
# sample is ~20 KB of ids and mask), and readers get row groups of a useful size, not one per part
COMPACT_ROW_GROUP_ROWS = 1024


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


class Compactor:
    def __init__(self, state: StateDb):
        self.state = state

    def compact(self, shard_id: str) -> Compaction | None:
        """Rewrite the shard's committed parts as one file, shards/<shard_id>/shard.parquet, and swap it in
        (the protocol and its crash cases are in the module docstring). None when there is nothing to do: no
        committed row, or already compacted. Call it only for a shard whose samples are all settled for good
        (committed or rejected): commit() refuses parts to a compacted shard.

        Locks: the writer flock, and the commit lock only for the swap transaction, so commits of other
        shards go on while the file is rewritten. Raises CompactionConflict (nothing swapped, the new file
        removed) if the shard's parts changed meanwhile, StoreError on an I/O or database failure."""
        started = time.monotonic()
        with self.state.commit_lock, self.state.lock:
            self.state.acquire_writer()
            parts = self.state.parts(shard_id)
        if not parts or (len(parts) == 1 and parts[0].path == shard_file(shard_id)):
            return None
        shard_dir = self.state.shards_dir / shard_id
        final = shard_dir / SHARD_FILE
        rel = final.relative_to(self.state.run_dir).as_posix()
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
            # the parts stay committed; the new file must not outlive the failure
            if (unlink_exc := withdraw(final)) is not None:
                raise StoreError(f"compaction of {shard_id} failed ({exc!r}) and {rel} could not be removed "
                                 f"({unlink_exc}); recover() removes it at the next start") from exc
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"compaction of {shard_id} failed in {self.state.db_path}: {exc}; its parts stay "
                                 "committed") from exc
            raise
        # committed: the parts are orphans now, removed here (or by recover() after a crash)
        for p in parts:
            (self.state.run_dir / p.path).unlink(missing_ok=True)
        fsync_dir(shard_dir)
        return Compaction(shard_id, rel, rows, nbytes, len(parts), time.monotonic() - started)

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
                        table = _conform(pq.read_table(self.state.run_dir / p.path), p.path)
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

    def _publish(self, tmp: Path, final: Path) -> None:
        publish(tmp, final)

    def _swap(self, shard_id: str, parts: list[PartInfo], info: PartInfo) -> None:
        """The one sqlite transaction that makes the shard file committed in place of the parts."""
        with self.state.commit_lock, self.state.lock:
            db = self.state.db
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
                seq = self.state.take_seq(shard_id)
                db.execute("DELETE FROM parts WHERE shard_id=?", (shard_id,))
                db.execute("INSERT INTO parts(path, shard_id, rows, committed_at, seq, bytes) VALUES(?,?,?,?,?,?)",
                           (info.path, shard_id, info.rows, info.committed_at, seq, info.bytes))
                db.execute("UPDATE samples SET part_path=? WHERE shard_id=?", (info.path, shard_id))
                db.execute("UPDATE shards SET parts=1, next_seq=max(next_seq, ?) WHERE shard_id=?", (seq + 1, shard_id))
                db.execute("COMMIT")
            except BaseException:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                self.state.next_seq.pop(shard_id, None)
                raise


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
