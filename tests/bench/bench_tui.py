"""Console cost while watching a big simulated run, per tab, at 1,000 and 10,000 shards (`make bench` runs it).

For each scale it starts an 8-worker simulated run (the `regen demo` start path, local transport), then
1. runs `regen tui local --run-dir D` in tmux (160x45, a real terminal) and samples the console process's CPU
   with psutil on every tab: CPU seconds (user + system) over the whole window divided by its wall time, i.e. the
   mean share of one core (the console works in bursts every 2 s: a median of 1 s samples hid a mean of 5.6% under
   3.5%); the 1 s samples are kept for the record, with the load average and the UI libraries' versions;
2. runs RegenApp in-process (headless) against the same run and measures, per telemetry batch, the time from
   the event's host timestamp (written to telemetry.jsonl) to the moment the batch was folded and the visible
   panel redrawn, on the Workers and the Shards tab (median, p95 and max of the same samples);
3. times one status reply (its size, the ctl round trip, and folding it into the console's model), the one
   full shard list the console still receives (every STATUS_EVERY_S).
With --baseline-from DIR (a checkout of the code before, e.g. `git archive main | tar -x -C DIR`), the console
of DIR is measured the same way on the 1,000-shard run, in the same run.

    .venv/bin/python -m tests.bench.bench_tui [--seconds 20] [--latency-seconds 30] [--scales 1000,10000]
        [--baseline-from DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from console.commands.demo import demo_config, write_prompts
from console.host.deploy import StartedRun, start_run
from console.host.transport_local import LocalTransport
from console.tui.app import RegenApp
from console.tui.app_base import STATUS_EVERY_S, TABS
from console.tui.app_follow import FULL_STATUS_EVERY_S
from console.view.model import RunModel
from console.host.source import HostSource
from engine.text.tiny_model import build_tiny_model
from tests.bench import bench_common as bc
from tests.tmux_screen import capture

WORKERS = 8
SIM_ARGS = ["--sim-step-ms", "40", "--sim-output-mean", "400"]
# (prompts, shard size) per scale: enough work that the run still runs after every measurement (~30 samples/s)
SCALES = {1000: (12000, 12), 10000: (20000, 2)}
BUDGET_CPU = {1000: 5.0, 10000: 10.0}  # % of one core, every tab (issue 18)
BUDGET_P95_MS = 500.0
TAB_ORDER = ["workers", "shards", "quality", "disk", "alerts", "preflight"]  # each tab's key works from the one before
SETTLE_S = 3.0  # after a tab switch: its first full draw is not the steady state


@dataclass
class Latency:
    median_ms: float
    p95_ms: float
    max_ms: float
    batches: int

    @staticmethod
    def of(lags_s: list[float]) -> "Latency | None":
        """Median, p95 (nearest rank) and max of the same samples: p95 never exceeds the max."""
        if not lags_s:
            return None
        ms = sorted(x * 1000 for x in lags_s)
        p95 = ms[max(0, -(-95 * len(ms) // 100) - 1)]
        return Latency(statistics.median(ms), p95, ms[-1], len(ms))


async def start(run_dir: Path, prompts: int, shard_size: int) -> StartedRun:
    model = build_tiny_model(Path.home() / ".cache" / "regen" / "tiny-model")
    files = write_prompts(run_dir / "prompts", prompts, 0)
    cfg = demo_config(run_dir, model, files, WORKERS, SIM_ARGS).model_copy(update=dict(shard_size=shard_size))
    t = LocalTransport()
    try:
        return await start_run(t, cfg, host_python=sys.executable)
    finally:
        await t.close()


def stop(started: StartedRun) -> None:
    try:
        pgid = int((Path(started.run_dir) / "supervisor.pid").read_text())
        os.killpg(pgid, signal.SIGTERM)
        psutil.wait_procs([psutil.Process(pgid)], timeout=30)
    except (FileNotFoundError, ProcessLookupError, ValueError, psutil.NoSuchProcess) as exc:
        print(f"stopping the run in {started.run_dir}: {exc}", file=sys.stderr)


def tui_cpu(run_dir: str, seconds: float, code: Path, session: str) -> dict[str, dict]:
    """Per tab: the console's CPU (% of one core) over `seconds` of 1 s samples, and the run's progress then."""
    cmd = (f"cd {shlex.quote(str(code))} && env -u COLUMNS -u LINES PYTHONPATH={shlex.quote(str(code))} "
           f"TERM=xterm-256color {shlex.quote(sys.executable)} -m console.cli tui local --run-dir {shlex.quote(run_dir)}")
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "45", cmd], check=True)
    try:
        deadline = time.monotonic() + 60
        while "connected" not in capture(session):  # attached, backfill read
            if time.monotonic() > deadline:
                raise RuntimeError(f"the console never said connected:\n{capture(session)}")
            time.sleep(0.5)
        pane_pid = int(subprocess.run(["tmux", "list-panes", "-t", session, "-F", "#{pane_pid}"],
                                      capture_output=True, text=True, check=True).stdout.split()[0])
        root = psutil.Process(pane_pid)
        app = next(p for p in [root, *root.children(recursive=True)] if "console.cli" in " ".join(p.cmdline()))
        out = {}
        for tab in TAB_ORDER:
            subprocess.run(["tmux", "send-keys", "-t", session, str(TABS.index(tab) + 1)], check=True)
            time.sleep(SETTLE_S)
            app.cpu_percent(None)
            before, t0 = app.cpu_times(), time.monotonic()
            samples = []
            for _ in range(int(seconds)):
                time.sleep(1.0)
                samples.append(app.cpu_percent(None))
            after, wall = app.cpu_times(), time.monotonic() - t0
            used = (after.user - before.user) + (after.system - before.system)
            out[tab] = {"cpu_pct": 100.0 * used / wall, "cpu_s": used, "window_s": wall,
                        "cpu_pct_median_1s": statistics.median(samples), "samples": samples,
                        "load_avg": os.getloadavg()}
            print(f"    {tab:9s} {out[tab]['cpu_pct']:5.1f}% of a core (mean over {wall:.0f} s; load "
                  f"{out[tab]['load_avg'][0]:.1f})", flush=True)
        return out
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)


async def latency(run_dir: str, seconds: float) -> dict:
    """Event -> screen per telemetry batch on the Workers and the Shards tab; a status reply's size and cost."""
    transport = LocalTransport()
    source = HostSource("local", run_dir, host_python=sys.executable, transport=transport)
    app = RegenApp(source, run_probes_on_start=False)
    out: dict = {}
    try:
        async with app.run_test(size=(160, 45)) as pilot:
            deadline = time.monotonic() + 60
            while app.model.connection.state != "connected" or app.last_event_on_screen is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("the in-process console never got telemetry")
                await pilot.pause(0.2)
            await pilot.pause(3)  # the backfill folded
            t0 = time.perf_counter()
            reply = await source.status()
            ctl_s = time.perf_counter() - t0
            model = RunModel()
            model.apply_status(reply)  # the first fold creates every shard; the steady state is a repeat
            t0 = time.perf_counter()
            model.apply_status(reply)
            fold_ms = (time.perf_counter() - t0) * 1000
            compact = await source.status(shards=False)  # what the console's periodic poll asks (a full one: 5 min)
            out["status_reply"] = {"bytes": len(json.dumps(reply.to_dict())), "shards": len(reply.shards),
                                   "ctl_round_trip_s": ctl_s, "fold_ms": fold_ms,
                                   "periodic_bytes": len(json.dumps(compact.to_dict()))}
            for tab, key in (("workers", "2"), ("shards", "3")):
                await pilot.press(key)
                await pilot.pause(1)
                lags: list[float] = []
                seen = app.last_event_on_screen
                events_before = app.events_applied
                t0 = time.monotonic()
                while time.monotonic() - t0 < seconds:
                    await pilot.pause(0.05)
                    mark = app.last_event_on_screen
                    if mark is not None and mark != seen:
                        seen = mark
                        lags.append(mark[1] - mark[0])
                lat = Latency.of(lags)
                out[tab] = {**(dataclasses.asdict(lat) if lat else {}),
                            "events_per_s": (app.events_applied - events_before) / (time.monotonic() - t0)}
    finally:
        await transport.close()
    return out


def measure_scale(shards: int, seconds: float, latency_s: float, baseline_from: Path | None, tmp: Path) -> dict:
    prompts, shard_size = SCALES[shards]
    print(f"== {shards:,} shards ({prompts:,} prompts, {shard_size} a shard, {WORKERS} workers)", flush=True)
    started = asyncio.run(start(tmp / f"run-{shards}", prompts, shard_size))
    session = f"regen-bench-tui-{os.getpid()}-{shards}"
    result: dict = {"shards": shards, "prompts": prompts, "shard_size": shard_size, "workers": WORKERS}
    try:
        time.sleep(10)  # workers loading
        print("  console (this code):", flush=True)
        result["tabs"] = tui_cpu(started.run_dir, seconds, bc.REPO, session)
        if baseline_from is not None:
            print(f"  console ({baseline_from}):", flush=True)
            result["baseline_tabs"] = tui_cpu(started.run_dir, seconds, baseline_from, session + "-base")
        result["latency"] = asyncio.run(latency(started.run_dir, latency_s))
        proc = subprocess.run([sys.executable, "-m", "engine.ctl", "--run-dir", started.run_dir, "status"],
                              capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(bc.REPO)))
        if proc.returncode != 0:
            result["run_state_at_end"] = f"gone (engine.ctl status exited {proc.returncode}: {proc.stderr.strip()})"
        else:  # the figures mean something only while the run still runs
            status = json.loads(proc.stdout)["result"]
            result["run_state_at_end"] = status["state"]
            result["done_at_end"] = status["dispatch"]["done"] if status.get("dispatch") else None
        print(f"  run at the end: {result['run_state_at_end']}", flush=True)
    finally:
        stop(started)
    for tab, lat in result["latency"].items():
        if tab in ("workers", "shards") and lat.get("batches"):
            print(f"  event -> screen, {tab} tab: median {lat['median_ms']:.0f} ms, p95 {lat['p95_ms']:.0f} ms, "
                  f"max {lat['max_ms']:.0f} ms over {lat['batches']} batches ({lat['events_per_s']:.0f} events/s)")
    sr = result["latency"]["status_reply"]
    print(f"  status reply: {sr['bytes'] / 1e6:.2f} MB for {sr['shards']:,} shards, ctl {sr['ctl_round_trip_s']:.2f} s, "
          f"folded in {sr['fold_ms']:.0f} ms (at each (re)connect and every {FULL_STATUS_EVERY_S:.0f} s); without the "
          f"shard list (every {STATUS_EVERY_S:.0f} s): {sr['periodic_bytes'] / 1e3:.1f} kB")
    return result


def ui_versions() -> dict[str, str]:
    """What the figure was measured with: a fresh install's versions decide what an operator gets."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ("textual", "textual-plot", "rich"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def met(scales: dict) -> bool:
    ok = True
    for n, r in scales.items():
        ok &= r["run_state_at_end"] == "running"
        ok &= all(t["cpu_pct"] <= BUDGET_CPU[int(n)] for t in r["tabs"].values())
        ok &= all(r["latency"][t].get("p95_ms", float("inf")) <= BUDGET_P95_MS for t in ("workers", "shards"))
    return bool(ok)


def run(seconds: float = 20.0, scales: tuple[int, ...] = (1000, 10000), baseline_from: Path | None = None,
        latency_s: float = 30.0) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="regen-bench-tui-"))
    started = time.monotonic()
    results = {str(n): measure_scale(n, seconds, latency_s, baseline_from if n == 1000 else None, tmp) for n in scales}
    return {"bench": "tui", "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": bc.machine(), "libraries": ui_versions(), "seconds_per_tab": seconds,
            "latency_seconds_per_tab": latency_s,
            "terminal": "tmux 160x45",
            "budget": {"cpu_pct_1000_shards": BUDGET_CPU[1000], "cpu_pct_10000_shards": BUDGET_CPU[10000],
                       "p95_ms": BUDGET_P95_MS},
            "baseline_from": str(baseline_from) if baseline_from else None, "scales": results,
            "met": met(results), "total_s": time.monotonic() - started, "run_dirs": str(tmp)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="1 s CPU samples per tab")
    ap.add_argument("--latency-seconds", type=float, default=30.0,
                    help="per tab (Workers, Shards): telemetry batches come every supervisor tick (2 s)")
    ap.add_argument("--scales", default="1000,10000", help=f"shard counts, of {','.join(map(str, SCALES))}")
    ap.add_argument("--baseline-from", type=Path, default=None,
                    help="a checkout of the code before: its console measured too, on the 1,000-shard run")
    args = ap.parse_args()
    scales = tuple(int(s) for s in args.scales.split(","))
    unknown = [s for s in scales if s not in SCALES]
    if unknown:
        ap.error(f"unknown scale(s) {unknown}; known: {list(SCALES)}")
    res = run(args.seconds, scales, args.baseline_from, args.latency_seconds)
    out = bc.write_result("tui", res)
    print(f"budget met: {res['met']}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
