"""The recovery scan at a start: remove *.tmp and uncommitted part and shard files (a write or a compaction cut
short leaves one side as the orphan), remembering their numbers; un-commit the samples of a committed part missing
on disk (they are generated again).
"""
from __future__ import annotations

from engine.store.names import PART_RE, REPETITION, SHARD_FILE_RE, fsync_dir
from engine.store.state_db import StateDb


def recover(state: StateDb) -> list[str]:
    """Remove *.tmp and uncommitted part and shard files (a compaction cut short leaves one side as
    the orphan); un-commit samples of parts missing on disk.
    Returns one line per thing removed (paths relative to the run dir)."""
    with state.commit_lock, state.lock:
        state.acquire_writer()
        removed: list[str] = []
        committed = {row[0] for row in state.db.execute("SELECT path FROM parts")}
        if state.shards_dir.is_dir():
            for shard_dir in sorted(p for p in state.shards_dir.iterdir() if p.is_dir()):
                orphans = []  # (part number or -1 for a shard file, path)
                for f in sorted(shard_dir.iterdir()):
                    m = PART_RE.match(f.name)
                    if (m or SHARD_FILE_RE.match(f.name)) and f.relative_to(state.run_dir).as_posix() not in committed:
                        orphans.append((int(m.group(1)) if m else -1, f))
                if not orphans:
                    continue
                # remember the orphans' numbers first, so no later part is ever named like one
                state.db.execute("UPDATE shards SET next_seq=max(next_seq, ?) WHERE shard_id=?",
                                 (max(seq for seq, _ in orphans) + 1, shard_dir.name))
                for _, f in orphans:
                    f.unlink()
                    removed.append(f.relative_to(state.run_dir).as_posix())
                fsync_dir(shard_dir)
        missing = [p for p in sorted(committed) if not (state.run_dir / p).is_file()]
        for rel in missing:
            n = _uncommit_part(state, rel)
            removed.append(f"{rel} (committed part missing on disk: {n} samples un-committed, to be regenerated)")
        state.next_seq.clear()
        return removed


def _uncommit_part(state: StateDb, rel: str) -> int:
    db = state.db
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
