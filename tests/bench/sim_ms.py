"""The SGLang simulator with millisecond log timestamps, pinned to the CPUs in $REGEN_BENCH_CPUS.

Benchmarks launch it in place of `python -m engine.simulator` (same flags): the simulator's own
lines carry `[%Y-%m-%d %H:%M:%S]`, too coarse to time batch occupancy from decode lines, so this
wrapper replaces SimLog.stamp with `[%Y-%m-%d %H:%M:%S.mmm]` (the ready/error substrings the
supervisor looks for are unchanged). Run by file path: workers start with cwd = run dir.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.simulator import main  # noqa: E402
from engine.simulator.simlog import SimLog  # noqa: E402


def _stamp_ms() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"


def pin_from_env() -> None:
    cpus = os.environ.get("REGEN_BENCH_CPUS")
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


if __name__ == "__main__":
    pin_from_env()
    SimLog.stamp = staticmethod(_stamp_ms)
    sys.exit(main(sys.argv[1:]))
