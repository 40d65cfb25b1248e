"""The shard store's names: where its files lie under a run dir, and the finish / reject words its tables hold.
Layout: shards/<shard_id>/part-<seq:06d>.parquet while a shard is generated, shards/<shard_id>/shard.parquet once
compacted, state.sqlite beside them (engine.store.state_db).
"""
from __future__ import annotations

import os
import re
from enum import StrEnum
from pathlib import Path

from engine.api.wire import FinishReason
STATE_DB = "state.sqlite"
SHARDS_DIR = "shards"
WRITER_LOCK = "state.sqlite.writer.lock"
PART_RE = re.compile(r"^part-(\d+)\.parquet(\.tmp)?$")
SHARD_FILE = "shard.parquet"  # a compacted shard's one file
SHARD_FILE_RE = re.compile(r"^shard\.parquet(\.tmp)?$")
# finish_reason of an answer the runaway guard stopped (engine.run.runaway): degenerate repetition, its ids exact up
# to the stop; counted per shard like "length" (truncated), dropped by exports by default
REPETITION = "repetition"
# finish reasons of a cut turn: it ended at max_new_tokens, or the runaway guard stopped it (turns_after_cut)
CUT_FINISHES = (FinishReason.LENGTH, REPETITION)
# the reject kind (outcomes.reason) of a later turn not generated because an earlier turn was cut (turns_after_cut
# = "stop"): rejected, so a restart keeps the decision
AFTER_CUT = "after_cut"


class SettleKind(StrEnum):
    """How a sample settled without a row (outcomes.outcome): a server refused it, or its retries were spent."""
    REJECTED = "rejected"
    FAILED = "failed"


def shard_id_for(index: int, shard_size: int) -> str:
    return f"s{index // shard_size:05d}"


def shard_file(shard_id: str) -> str:
    """A compacted shard's file, relative to the run dir."""
    return f"{SHARDS_DIR}/{shard_id}/{SHARD_FILE}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Rename a written, fsynced file to its final name, durably."""
    os.replace(tmp, final)
    fsync_dir(final.parent)


def withdraw(final: Path) -> OSError | None:
    """Remove a published file whose commit failed, durably (readers trust sqlite, but no glob over the shard dirs
    should see it either); the OSError if it could not be removed (recover() removes it at the next start)."""
    try:
        final.unlink()
        fsync_dir(final.parent)
    except OSError as exc:
        return exc
    return None
