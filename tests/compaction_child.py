"""A writer for tests/test_compaction_kill.py: commits the parts of a few shards and compacts each, resuming
what a killed predecessor left (recover() first, committed samples skipped), until it is SIGKILLed.

    python -m tests.compaction_child RUN_DIR [--kill-at STEP] [--kill-after S]

--kill-at kills this process (SIGKILL, from inside) at one step of the compaction of TARGET_SHARD:
  tmp_written  shard.parquet.tmp written and fsynced, not renamed
  renamed      shard.parquet renamed into place, not swapped in
  swapped      the sqlite swap committed, no part unlinked yet
  unlinking    the first old part unlinked, the others not
--kill-after kills it S seconds after it starts writing, --kill-in-compaction S seconds after its first
compaction begins (random moments, chosen by the test).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from engine.store.compaction import Compactor
from engine.store.part_table import build_table

from engine.store.shard_store import ShardStore

SHARDS = ["s00000", "s00001", "s00002", "s00003"]
PARTS_PER_SHARD = 6
ROWS_PER_PART = 20
TARGET_SHARD = "s00001"
STEPS = ("tmp_written", "renamed", "swapped", "unlinking")


def sample_ids() -> dict[str, list[str]]:
    return {sid: [f"{sid}-p{p}-r{i}#turn0" for p in range(PARTS_PER_SHARD) for i in range(ROWS_PER_PART)]
            for sid in SHARDS}


def row(sid: str, part: int, i: int) -> dict:
    prompt_len, output_len = 40, 200 + 7 * i
    conv = f"{sid}-p{part}-r{i}"
    return {
        "sample_id": f"{conv}#turn0", "conversation_id": conv, "turn": 0, "source": "p.jsonl",
        "origin": f"p.jsonl:{part * ROWS_PER_PART + i + 1}",
        "input_ids": [(part * 7919 + i * 104729 + k) % 150000 for k in range(prompt_len + output_len)],
        "loss_mask": [0] * prompt_len + [1] * output_len, "prompt_len": prompt_len, "output_len": output_len,
        "reasoning_tokens": 3, "prompt_opened": False, "finish_reason": "stop", "completion_tokens": output_len, "cached_tokens": 0,
        "latency_s": 0.1, "worker": "gpu0", "text": f"<think>\nsample {conv}\n</think>\n\n" + "words " * output_len,
    }


def _timer(seconds: float) -> None:
    timer = threading.Timer(seconds, _die)
    timer.daemon = True
    timer.start()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill(step: str) -> None:
    real_write, real_publish, real_swap, real_unlink = (Compactor._write_compacted, Compactor._publish,
                                                        Compactor._swap, Path.unlink)

    def write(self, parts, tmp):
        out = real_write(self, parts, tmp)
        if step == "tmp_written" and tmp.parent.name == TARGET_SHARD:
            _die()
        return out

    def publish(self, tmp, final):
        real_publish(self, tmp, final)
        if step == "renamed" and final.name == "shard.parquet" and final.parent.name == TARGET_SHARD:
            _die()

    def swap(self, shard_id, parts, info):
        real_swap(self, shard_id, parts, info)
        if step == "swapped" and shard_id == TARGET_SHARD:
            _die()

    def unlink(self, missing_ok=False):
        real_unlink(self, missing_ok=missing_ok)
        if step == "unlinking" and self.parent.name == TARGET_SHARD and self.name.startswith("part-"):
            _die()

    Compactor._write_compacted, Compactor._publish, Compactor._swap = write, publish, swap
    Path.unlink = unlink


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--kill-at", choices=STEPS)
    ap.add_argument("--kill-after", type=float)
    ap.add_argument("--kill-in-compaction", type=float)
    args = ap.parse_args(argv)
    store = ShardStore(args.run_dir)
    store.recover()
    store.ensure_shards({sid: PARTS_PER_SHARD * ROWS_PER_PART for sid in SHARDS})
    if args.kill_at:
        install_kill(args.kill_at)
    build_table([row(SHARDS[0], 0, 0)])  # pyarrow's first conversion imports pandas (~0.6 s): not in the window
    if args.kill_after is not None:
        _timer(args.kill_after)
    if args.kill_in_compaction is not None:
        real_compact = ShardStore.compact

        def compact(self, shard_id):
            if not getattr(compact, "armed", False):
                compact.armed = True
                _timer(args.kill_in_compaction)
            return real_compact(self, shard_id)
        ShardStore.compact = compact
    for sid in SHARDS:
        for part in range(PARTS_PER_SHARD):
            rows = [row(sid, part, i) for i in range(ROWS_PER_PART)]
            rows = [r for r in rows if not store.is_committed(r["sample_id"])]
            if rows:
                store.commit(sid, rows)
        store.compact(sid)
    store.close()
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
