"""GPU occupancy: the share of time each simulated GPU runs a full batch, regen vs static round-robin.

    .venv/bin/python -m tests.bench.bench_occupancy [--requests 960] [--gpus 4] [--repeats 3]

Simulators (continuous batching, NOT instant): --max-running-requests 16, output lengths lognormal
(mean 512 tokens, sigma 1.2: a long tail, cut at max_new_tokens 4096 as a real 32k cap cuts a
4k-mean run), 4 tokens per 6 ms step. Each runs in its own process on the simulator core(s) and
logs every decode step (--decode-log-interval 1) with millisecond stamps (sim_ms.py).

regen: the real supervisor (dispatcher pull loops: a free slot pulls the next item; per-worker cap
max_running + margin, trimmed by the server's queue) pinned to the engine core.
baseline: how peer scripts do it: requests assigned round-robin to servers up front (static chunks),
each server's chunk sent by its own ThreadPoolExecutor with N = 16 requests in flight (= the
server's max running batch), /v1/chat/completions, on the engine core. Both send the same rids,
so the simulators draw the same output length for each prompt in both runs.

Figures, from each simulator's step log: batch size of every decode step (Prefill line:
#running-req + #new-seq; else the previous Decode line's #running-req) and its time span. The
window starts when every server has work and ends when fewer requests remain unadmitted than
there are slots in all (until then an ideal client refills every slot the moment it frees; after
it the tail is the same for any client that cannot know output lengths); full-batch share = time
in steps with batch == max / window, per simulator (min and mean over simulators); also mean batch
fill, and total wall time (first admission to last finish), which includes the tail.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.config.load import Sampling
from tests.bench import bench_common as bc

TARGET_FULL_SHARE = 0.98
MAX_RUNNING = 16
MAX_NEW = 4096
_DECODE = re.compile(r"Decode batch, #running-req: (\d+),")


def sim_args(step_ms: float) -> list[str]:
    return ["--max-running-requests", str(MAX_RUNNING), "--sim-output-mean", "512", "--sim-output-sigma", "1.2",
            "--sim-step-ms", str(step_ms), "--sim-step-ms-per-req", "0", "--sim-tokens-per-step", "4",
            "--decode-log-interval", "1", "--log-level-http", "warning", "--sim-seed", "11"]


def steps_of(log: Path) -> list[tuple[float, float, int]]:
    """(start, end, batch) of every decode step in one simulator's log.

    The simulator keeps its steps on a fixed grid (each ends step_ms after the one before, whatever its own
    bookkeeping cost), logs a Decode line at the end of each and, for a step that admits, a Prefill line once the
    admission is done. So a step after a busy one starts where that one ended, not at its Prefill line: read from
    the Prefill line, the time the simulator process spent (or waited for its core) between the two lines counted
    as time with no batch at all, ~10% of the window at batch 256 on a loaded core. After an idle server (running
    0) the step starts at the admission (the simulator waited for work, then started its grid again)."""
    steps = []
    prev_end: float | None = None
    prev_running = 0
    admitted_at: float | None = None
    batch_after_admit: int | None = None
    for t, line in bc.sim_lines(log):
        prefill = bc.prefill_of(line)
        if prefill is not None:  # every admission fills the batch, a /health probe's too
            admitted_at = t
            batch_after_admit = prefill.new_seq + prefill.running_before
            continue
        m = _DECODE.search(line)
        if not m:
            continue
        if batch_after_admit is not None:
            start = prev_end if prev_running and prev_end is not None else admitted_at
            batch = batch_after_admit
        else:
            start, batch = prev_end, prev_running
        if start is not None and batch > 0:
            steps.append((start, t, batch))
        prev_end, prev_running = t, int(m.group(1))
        admitted_at = batch_after_admit = None
    return steps


def admissions_of(log: Path) -> list[tuple[float, int]]:
    """(time, #new-seq) of every admission of the client's requests after the ready line (the server's own warmup
    and /health probes excluded)."""
    out, ready = [], False
    for t, line in bc.sim_lines(log):
        if not ready:
            ready = "fired up and ready" in line
            continue
        n = bc.admitted_requests(line)
        if n:
            out.append((t, n))
    return out


def occupancy(logs: list[Path], requests: int, max_running: int = MAX_RUNNING) -> dict:
    per = [steps_of(p) for p in logs]
    adm = [admissions_of(p) for p in logs]
    if not all(adm) or not all(per):
        raise RuntimeError(f"no admissions/decode steps in {', '.join(map(str, logs))}")
    t_start = max(a[0][0] for a in adm)  # every server has work
    # the window ends when fewer requests remain unadmitted than there are slots: until then an ideal
    # client could refill every slot the moment it frees; after it, the tail is the same for any client
    slots = max_running * len(logs)
    merged = sorted(e for a in adm for e in a)
    admitted, t_end = 0, merged[-1][0]
    for t, n in merged:
        admitted += n
        if admitted >= requests - slots:
            t_end = t
            break
    if admitted < requests - slots:
        raise RuntimeError(f"only {admitted} of {requests} requests were admitted")
    window = t_end - t_start
    end = max(s[-1][1] for s in per)
    first = min(a[0][0] for a in adm)
    sims = []
    for steps in per:
        full = fill = 0.0
        for start, stop, batch in steps:
            a, b = max(start, t_start), min(stop, t_end)
            if b > a:
                fill += (b - a) * batch / max_running
                if batch >= max_running:
                    full += b - a
        sims.append({"full_batch_share": full / window, "mean_fill": fill / window,
                     "last_finish_s": steps[-1][1] - first})
    return {"window_s": window, "wall_s": end - first, "tail_s": end - t_end,
            "full_batch_share_min": min(s["full_batch_share"] for s in sims),
            "full_batch_share_mean": sum(s["full_batch_share"] for s in sims) / len(sims),
            "mean_fill": sum(s["mean_fill"] for s in sims) / len(sims), "per_sim": sims}


def cfg_requests(prompts: Path) -> int:
    with open(prompts) as f:
        return sum(1 for _ in f)


def run_regen(model: Path, prompts: Path, work: Path, gpus: int, step_ms: float) -> dict:
    run_dir = work / "run"
    cfg = bc.sim_config(model, [prompts], run_dir, gpus=gpus, sim_args=sim_args(step_ms),
                        sampling=Sampling(max_new_tokens=MAX_NEW))
    res = bc.run_supervisor(cfg, timeout=600)
    if res.exit_code != 0:
        tail = "\n".join(line for _, line in res.lines[-30:])
        raise RuntimeError(f"supervisor exited {res.exit_code}; {run_dir}/supervisor.log:\n{tail}")
    logs = sorted((run_dir / "workers").glob("*/server.log"))
    return occupancy(logs, cfg_requests(prompts))


def baseline_client(urls: list[str], prompts: Path, n: int, per_server: int) -> dict:
    rows = bc.first_rows(prompts, n)
    chunks = [rows[i::len(urls)] for i in range(len(urls))]  # round-robin, assigned up front

    def one(url: str, row: dict) -> int:
        return bc.chat_completion(url, row, MAX_NEW, timeout=600)

    t0 = time.perf_counter()
    pools = [ThreadPoolExecutor(max_workers=per_server) for _ in urls]
    futures = [pool.submit(one, url, row) for pool, url, chunk in zip(pools, urls, chunks) for row in chunk]
    tokens = sum(f.result() for f in futures)
    for pool in pools:
        pool.shutdown()
    return {"requests": len(rows), "output_tokens": tokens, "seconds": time.perf_counter() - t0}


def run_baseline(model: Path, prompts: Path, work: Path, gpus: int, n: int, step_ms: float) -> dict:
    sims = bc.start_sims(gpus, model, sim_args(step_ms), work / "sims")
    try:
        argv = [sys.executable, "-m", "tests.bench.bench_occupancy", "--baseline-client", "--urls", ",".join(sims.urls),
                "--prompts", str(prompts), "--requests", str(n)]
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=str(bc.REPO), timeout=900,
                              preexec_fn=lambda: os.sched_setaffinity(0, bc.ENGINE_CPUS))
        if proc.returncode != 0:
            raise RuntimeError(f"baseline client failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    finally:
        sims.stop()
    return occupancy(sims.logs, n)


def run(requests: int, gpus: int, repeats: int, step_ms: float, keep: Path | None = None) -> dict:
    model = bc.tiny_model()
    base = keep or Path(tempfile.mkdtemp(prefix="regen-bench-occupancy-"))
    prompts = bc.write_prompts(base / "prompts.jsonl", requests)
    regen_runs, base_runs = [], []
    try:
        for r in range(repeats):
            work = base / f"r{r}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            regen_runs.append(run_regen(model, prompts, work, gpus, step_ms))
            base_runs.append(run_baseline(model, prompts, work, gpus, requests, step_ms))
            print(f"  occupancy run {r + 1}/{repeats}: full-batch share (min over GPUs) regen "
                  f"{regen_runs[-1]['full_batch_share_min']:.1%}, round-robin {base_runs[-1]['full_batch_share_min']:.1%};"
                  f" wall {regen_runs[-1]['wall_s']:.1f} s vs {base_runs[-1]['wall_s']:.1f} s", flush=True)
            if not keep:
                shutil.rmtree(work, ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)

    def med(runs: list[dict], key: str) -> float:
        return bc.median([x[key] for x in runs])

    summary = {k: {"regen": med(regen_runs, k), "baseline": med(base_runs, k)}
               for k in ("full_batch_share_min", "full_batch_share_mean", "mean_fill", "window_s", "wall_s", "tail_s")}
    return {
        "benchmark": "occupancy", "repeats": repeats, "simulators": gpus, "requests": requests,
        "max_running": MAX_RUNNING, "sim_args": sim_args(step_ms), "max_new_tokens": MAX_NEW,
        "median": summary,
        "wall_ratio": summary["wall_s"]["baseline"] / summary["wall_s"]["regen"],
        "target": {"full_batch_share": TARGET_FULL_SHARE},
        "met": summary["full_batch_share_min"]["regen"] >= TARGET_FULL_SHARE,
        "regen_runs": regen_runs, "baseline_runs": base_runs, "machine": bc.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=960)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=6.0)
    ap.add_argument("--keep", type=Path, default=None)
    ap.add_argument("--baseline-client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--urls", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.baseline_client:
        print(json.dumps(baseline_client(args.urls.split(","), args.prompts, args.requests, MAX_RUNNING)))
        return 0
    res = run(args.requests, args.gpus, args.repeats, args.step_ms, args.keep)
    out = bc.write_result("occupancy", res)
    m = res["median"]
    print(f"full-batch share (min over GPUs): regen {m['full_batch_share_min']['regen']:.1%}, round-robin "
          f"{m['full_batch_share_min']['baseline']:.1%}; wall {m['wall_s']['regen']:.1f} s vs "
          f"{m['wall_s']['baseline']:.1f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
