"""The writer of one part: validate the rows, refuse duplicates, write part-N.parquet.tmp and fsync, rename and fsync
the directory, then ONE sqlite transaction (the part's row, every sample id, the shard's counters). A crash anywhere
leaves a committed part or an orphan file that engine.store.recovery removes.
"""
from __future__ import annotations

import dataclasses
import os
import sqlite3
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from engine.api.wire import FinishReason
from engine.store.names import REPETITION, fsync_dir, publish, shard_file, withdraw
from engine.store.part_table import build_table, is_empty, think_code
from engine.store.shard_schema import PART_COMPRESSION, PART_DICTIONARY, PART_STATISTICS
from engine.store.state_db import PartInfo, StateDb, StoreError, chunks
from engine.text.answer_shape import THINK_STATES, SampleShape


class DuplicateSample(Exception):
    """A sample id already committed (or twice in one batch); nothing was written."""

    def __init__(self, message: str, sample_ids: list[str]):
        super().__init__(message)
        self.sample_ids = sample_ids


class PartWriter:
    def __init__(self, state: StateDb):
        self.state = state

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
        with self.state.commit_lock:
            with self.state.lock:
                self.state.acquire_writer()
                known = self.state.db.execute("SELECT paused FROM shards WHERE shard_id=?", (shard_id,)).fetchone()
                if known is None:
                    raise ValueError(f"commit to unknown shard {shard_id}: declare it with ensure_shards() first")
                if self.state.compacted(shard_id):
                    raise ValueError(f"commit to shard {shard_id}: it is compacted into {shard_file(shard_id)} "
                                     "and takes no more parts (a shard is compacted only once every sample of it "
                                     "is committed or rejected)")
                self._check_duplicates(ids)
                seq = self.state.take_seq(shard_id)
            shard_dir = self.state.shards_dir / shard_id
            final = shard_dir / f"part-{seq:06d}.parquet"
            rel = final.relative_to(self.state.run_dir).as_posix()
            tmp = shard_dir / (final.name + ".tmp")
            nbytes = self._write_tmp(table, tmp)
            self._publish(tmp, final)
            info = PartInfo(shard_id, rel, len(ids), time.time(), seq, nbytes)
            try:
                try:
                    info = self._record(info, table, history, rows)  # takes _lock for its transaction only
                except sqlite3.Error as exc:
                    raise StoreError(f"commit of {rel} ({len(ids)} samples) failed in {self.state.db_path}: {exc}; "
                                     "nothing was committed") from exc
            except BaseException as exc:
                # nothing is committed; the file must not outlive the failure
                if (unlink_exc := withdraw(final)) is not None:
                    raise StoreError(f"commit of {rel} failed ({exc!r}) and the uncommitted file could not be "
                                     f"removed ({unlink_exc}); recover() removes it at the next start") from exc
                raise
            return info

    def _check_duplicates(self, ids: list[str]) -> None:
        repeated = sorted(i for i, n in Counter(ids).items() if n > 1)
        if repeated:
            raise DuplicateSample(f"sample id(s) repeated in one commit: {', '.join(repeated[:5])}"
                                  + (f" and {len(repeated) - 5} more" if len(repeated) > 5 else ""), repeated)
        found: list[tuple[str, str]] = []
        for chunk in chunks(ids):
            found += self.state.db.execute(
                f"SELECT sample_id, part_path FROM samples WHERE sample_id IN ({','.join('?' * len(chunk))})",
                chunk).fetchall()
        if found:
            found.sort()
            shown = ", ".join(f"{sid} (in {part})" for sid, part in found[:5])
            raise DuplicateSample(f"sample(s) already committed: {shown}"
                                  + (f" and {len(found) - 5} more" if len(found) > 5 else ""), [f[0] for f in found])

    def _write_tmp(self, table: pa.Table, tmp: Path) -> int:
        new_dir = not tmp.parent.is_dir()
        if new_dir:
            self.state.shards_dir.mkdir(mode=0o700, exist_ok=True)
            tmp.parent.mkdir(mode=0o700, exist_ok=True)
            fsync_dir(self.state.shards_dir)
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
        publish(tmp, final)

    def _record(self, info: PartInfo, table: pa.Table, history: Mapping[str, str], rows: list[dict]) -> PartInfo:
        """The one sqlite transaction that makes the part (and every sample in it) committed."""
        cols = {name: table.column(name).to_pylist() for name in
                ("sample_id", "conversation_id", "turn", "output_len", "finish_reason", "prompt_len",
                 "reasoning_tokens", "prompt_opened")}
        # the rows' own texts when they are str (the column holds exactly them): not ~4 MB a part decoded again
        texts = [r["text"] for r in rows]
        cols["text"] = texts if all(type(t) is str for t in texts) else table.column("text").to_pylist()
        empty = [int(is_empty(t, opened)) for t, opened in zip(cols["text"], cols["prompt_opened"])]
        think = [think_code(t, opened) for t, opened in zip(cols["text"], cols["prompt_opened"])]
        samples = [
            (sid, info.shard_id, info.path, cid, turn, olen, fr, e, history.get(sid), plen, rt, th)
            for sid, cid, turn, olen, fr, e, plen, rt, th in zip(
                cols["sample_id"], cols["conversation_id"], cols["turn"], cols["output_len"],
                cols["finish_reason"], empty, cols["prompt_len"], cols["reasoning_tokens"], think)
        ]
        tokens = sum(cols["output_len"])
        truncated = sum(1 for fr in cols["finish_reason"] if fr == FinishReason.LENGTH)
        repetition = sum(1 for fr in cols["finish_reason"] if fr == REPETITION)
        with self.state.lock:
            db = self.state.db
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
