"""Run a module under cProfile with a CPU-time clock (each thread's CPU seconds, not wall time), so
the profile of a process on a shared, loaded box shows where its CPU goes rather than where it
was descheduled. Every thread is profiled (the event loop, the committer's commit thread, the
work plan's render thread): one profiler per thread, merged. Writes a pstats file (all threads)
and, next to it, a text summary: CPU seconds per thread, then the top entries by cumulative and
by own time.

    python tests/bench/cpu_profile.py OUT.prof -m engine.supervisor --run-dir D
"""
from __future__ import annotations

import cProfile
import io
import pstats
import runpy
import sys
import threading
import time
from pathlib import Path

_THREAD_PROFILES: list[tuple[str, cProfile.Profile]] = []


def _profile_threads() -> None:
    """Each thread started from now on runs under its own CPU-clock profiler."""
    original = threading.Thread.run

    def run(self):
        prof = cProfile.Profile(time.thread_time)
        _THREAD_PROFILES.append((self.name, prof))
        prof.enable()
        try:
            original(self)
        finally:
            prof.disable()

    threading.Thread.run = run


def summary(prof_path: Path, top: int = 40, threads: list[tuple[str, float]] | None = None) -> str:
    out = io.StringIO()
    if threads:
        out.write("CPU seconds per thread (profiled):\n")
        for name, cpu in threads:
            out.write(f"  {cpu:8.3f}  {name}\n")
        out.write("\n")
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
    _profile_threads()
    prof.enable()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        prof.disable()
        stats = pstats.Stats(prof)
        per_thread = [("MainThread (event loop)", _total(stats))]
        for name, tprof in list(_THREAD_PROFILES):  # idle pool threads still wait: their counts so far
            try:
                tstats = pstats.Stats(tprof)
            except (TypeError, ValueError):  # a thread that recorded nothing
                continue
            per_thread.append((name, _total(tstats)))
            stats.add(tstats)
        stats.dump_stats(str(out))
        out.with_suffix(".txt").write_text(summary(out, threads=per_thread))
    return code


def _total(stats: pstats.Stats) -> float:
    return getattr(stats, "total_tt", 0.0)


if __name__ == "__main__":
    sys.exit(main())
