"""Run a module under cProfile with a CPU-time clock (this thread's CPU seconds, not wall time), so
the profile of a process on a shared, loaded box shows where its CPU goes rather than where it
was descheduled. Writes a pstats file and, next to it, a text summary (top entries by cumulative
and by own time).

    python tests/bench/cpu_profile.py OUT.prof -m engine.supervisor --run-dir D
"""
from __future__ import annotations

import cProfile
import io
import pstats
import runpy
import sys
import time
from pathlib import Path


def summary(prof_path: Path, top: int = 40) -> str:
    out = io.StringIO()
    stats = pstats.Stats(str(prof_path), stream=out)
    stats.strip_dirs().sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> int:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    module = sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    prof = cProfile.Profile(time.thread_time)
    code = 0
    prof.enable()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        prof.disable()
        prof.dump_stats(str(out))
        out.with_suffix(".txt").write_text(summary(out))
    return code


if __name__ == "__main__":
    sys.exit(main())
