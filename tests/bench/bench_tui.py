"""Console cost while watching a big simulated run (not run by pytest).

Starts an 8-worker, 1,000-shard simulated run (the `regen demo` start path, local transport), then
1. runs `regen tui local --run-dir D` in tmux (160x45, a real terminal) and samples the console
   process's CPU with psutil (percent of one core, median over 1 s samples), on the Workers tab and
   on the Shards tab;
2. runs RegenApp in-process (headless) against the same run and measures, per telemetry batch, the
   time from the event's host timestamp (written to telemetry.jsonl) to the moment the batch was
   folded and the visible panel redrawn.

    .venv/bin/python tests/bench/bench_tui.py [--seconds 60]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from console.commands.demo import demo_config, write_prompts  # noqa: E402
from console.deploy import start_run  # noqa: E402
from console.transport_local import LocalTransport  # noqa: E402
from console.tui.app import RegenApp  # noqa: E402
from console.tui.source import HostSource  # noqa: E402
from engine.tiny_model import build_tiny_model  # noqa: E402

SESSION = f"regen-bench-tui-{os.getpid()}"


async def start(run_dir: Path):
    model = build_tiny_model(Path.home() / ".cache" / "regen" / "tiny-model")
    prompts = write_prompts(run_dir / "prompts", 5000, 0)
    cfg = demo_config(run_dir, model, prompts, 8, ["--sim-step-ms", "40", "--sim-output-mean", "400"])
    cfg = dataclasses.replace(cfg, shard_size=5)  # 5,000 prompts / 5 = 1,000 shards
    t = LocalTransport()
    try:
        return await start_run(t, cfg)
    finally:
        await t.close()


def tui_cpu(run_dir: str, seconds: float) -> dict[str, float]:
    cmd = (f"cd {shlex.quote(str(REPO))} && env -u COLUMNS -u LINES PYTHONPATH={shlex.quote(str(REPO))} "
           f"{shlex.quote(sys.executable)} -m console.cli tui local --run-dir {shlex.quote(run_dir)}")
    subprocess.run(["tmux", "new-session", "-d", "-s", SESSION, "-x", "160", "-y", "45", cmd], check=True)
    try:
        time.sleep(8)  # attach, backfill
        pane_pid = int(subprocess.run(["tmux", "list-panes", "-t", SESSION, "-F", "#{pane_pid}"],
                                      capture_output=True, text=True, check=True).stdout.split()[0])
        root = psutil.Process(pane_pid)
        procs = [root, *root.children(recursive=True)]
        app = next(p for p in procs if "console.cli" in " ".join(p.cmdline()))
        out = {}
        for tab, key in (("workers", "2"), ("shards", "3")):
            subprocess.run(["tmux", "send-keys", "-t", SESSION, key], check=True)
            time.sleep(2)
            app.cpu_percent(None)
            samples = []
            for _ in range(int(seconds / 2)):
                time.sleep(1.0)
                samples.append(app.cpu_percent(None))
            out[tab] = statistics.median(samples)
        return out
    finally:
        subprocess.run(["tmux", "kill-session", "-t", SESSION], check=False)


async def latency(run_dir: str, seconds: float) -> list[float]:
    transport = LocalTransport()
    app = RegenApp(HostSource("local", run_dir, transport=transport), run_probes_on_start=False)
    lags: list[float] = []
    async with app.run_test(size=(160, 45)) as pilot:
        await pilot.pause(5)  # backfill done
        seen = None
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await pilot.pause(0.05)
            mark = app.last_event_on_screen
            if mark is not None and mark != seen:
                seen = mark
                lags.append(mark[1] - mark[0])
    await transport.close()
    return lags


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="regen-bench-tui-")
    started = asyncio.run(start(Path(tmp) / "run"))
    try:
        time.sleep(10)  # workers loading
        cpu = tui_cpu(started.run_dir, args.seconds)
        lags = asyncio.run(latency(started.run_dir, args.seconds / 2))
    finally:
        try:
            pgid = int((Path(started.run_dir) / "supervisor.pid").read_text())
            os.killpg(pgid, signal.SIGTERM)
            psutil.wait_procs([psutil.Process(pgid)], timeout=30)
        except (FileNotFoundError, ProcessLookupError, ValueError, psutil.NoSuchProcess) as exc:
            print(f"stopping the run: {exc}", file=sys.stderr)
        print(f"run dir left for inspection: {tmp}", file=sys.stderr)
    print(f"console CPU, % of one core (median of 1 s samples): workers tab {cpu['workers']:.1f}, "
          f"shards tab (1,000 rows) {cpu['shards']:.1f}")
    if lags:
        q = statistics.quantiles(lags, n=20) if len(lags) > 1 else lags
        print(f"event written -> on screen: median {statistics.median(lags) * 1000:.0f} ms, "
              f"p95 {q[-1] * 1000:.0f} ms, max {max(lags) * 1000:.0f} ms over {len(lags)} batches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
