"""Work spread across servers whose reported batch exceeds their KV pool: regen vs a peer-like client.

    .venv/bin/python -m tests.bench.bench_spread [--requests 1500] [--gpus 2] [--repeats 2]
                                                 [--variants kv,late,small,restart] [--no-baseline]

Simulated SGLang 0.5.23 servers launched without --max-running-requests: each reports the batch its scheduler
derives from the pool (internal_states: 2,048) while its KV pool (--max-total-tokens 40000) runs ~100-200 of these
requests at once; admission reserves max_new_tokens x a decaying ratio and a full pool retracts (engine.simulator
.scheduler). Output lengths lognormal (mean 400 tokens, sigma 0.5, max_new_tokens 2048); every decode step is
logged with millisecond stamps (sim_ms.py), 4 tokens per step of 10 ms + 0.1 ms per running request.

Clients, alternated in each repeat on the same servers' arguments and the same rids (so the same answers):
  baseline N   a peer's regeneration client: a thread pool of N concurrent POST /v1/chat/completions, requests
               round-robin over the servers (N = 64, its default class, and N = the servers' reported batch summed)
  regen        the real supervisor (it launches its own servers with the same arguments)

Variants (regen): kv (as above), late (the second server is ready 5 s after the first: --sim-load-s), small (work
smaller than the servers' capacity: requests/8), restart (the first server crashes after 300 answers, on its
first launch only, and is relaunched by the supervisor).

Figures, from each server's step log: output tok/s over the wall (the client's first admission to the last decode
step, all servers; /health probes are no admission: bench_common.admitted_requests); per server, the full-batch
share: the time in steps where the server ran its own limit (its batch, or its KV pool: a non-empty waiting queue
says the server, not the client, was the limit) over the window while work remained (from the server's first
admission to when fewer requests remained unadmitted than the servers' peak running, as bench_occupancy); the tail
ratio: how long the servers ran after that point, the last one against their mean (1.0: they all ended together, an
even split); requests each server served (admissions).
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.config.load import Sampling
from tests.bench import bench_common as bc

POOL = 40_000
REPORTED_BATCH = 2048  # what a 0.5.23 server with this pool and the tiny model's context reports
MAX_NEW = 2048
TARGET_SPEEDUP = 1.2
TARGET_FULL_SHARE = 0.95
TARGET_TAIL = 1.2
VARIANTS = ("kv", "late", "small", "restart")
LATE_S = 5.0
CRASH_AFTER = 300
MAX_STEP_S = 1.0  # a longer gap between two decode lines is no step (a crashed server's relaunch)
_DECODE = re.compile(r"Decode batch, #running-req: (\d+),.*#queue-req: (\d+),")


def sim_args() -> list[str]:
    return ["--sim-sglang-version", "0.5.23", "--max-total-tokens", str(POOL), "--sim-output-mean", "400",
            "--sim-output-sigma", "0.5", "--sim-step-ms", "10", "--sim-step-ms-per-req", "0.1",
            "--sim-tokens-per-step", "4", "--sim-prefill-ms-per-1k", "2", "--decode-log-interval", "1",
            "--log-level-http", "warning", "--sim-seed", "11"]


# -- figures from the servers' step logs ---------------------------------------------------------------------
def server_steps(log: Path) -> tuple[list[tuple[float, float, int, int]], list[tuple[float, int]],
                                     list[tuple[float, float]]]:
    """((start, end, running, queued) of every decode step, (time, #new-seq) of every admission) after ready, and
    the (start, end) of each time it was down: from its last step before a relaunch to the relaunch's ready line."""
    steps, adm, down = [], [], []
    ready, prev_end, down_from = False, None, None
    for t, line in bc.sim_lines(log):
        if not ready:
            ready = "fired up and ready" in line
            continue
        if "server_args=" in line and down_from is None:  # relaunched: down until its ready line (its warmup too)
            down_from = prev_end if prev_end is not None else t
            continue
        if down_from is not None:
            if "fired up and ready" in line:
                down.append((down_from, t))
                down_from, prev_end = None, None
            continue
        if "Prefill batch" in line:
            n = bc.admitted_requests(line)
            if n:
                adm.append((t, n))
            continue
        m = _DECODE.search(line)
        if m:
            running, queued = int(m.group(1)), int(m.group(2))
            if prev_end is not None and running > 0 and t - prev_end < MAX_STEP_S:
                steps.append((prev_end, t, running, queued))
            prev_end = t
    return steps, adm, down


def figures(logs: list[Path], requests: int, output_tokens: int) -> dict:
    per = [server_steps(p) for p in logs]
    served = [sum(n for _, n in adm) for _, adm, _ in per]
    active = [(steps, adm) for steps, adm, _ in per if steps and adm]
    if not active:
        raise RuntimeError(f"no decode steps in {', '.join(map(str, logs))}")
    first = min(adm[0][0] for _, adm in active)
    ends = [steps[-1][1] for steps, _ in active]
    peak = sum(max(r for _, _, r, _ in steps) for steps, _ in active)
    merged = sorted(e for _, adm in active for e in adm)
    admitted, t_end = 0, merged[-1][0]
    for t, n in merged:
        admitted += n
        if admitted >= requests - peak:
            t_end = t
            break
    shares = []
    for steps, adm, down in per:
        if not steps or not adm:
            shares.append(0.0)  # a server that never served: none of the window was full
            continue
        t0 = adm[0][0]
        window = t_end - t0 - sum(max(0.0, min(b, t_end) - max(a, t0)) for a, b in down)  # a relaunch: not the client's
        full = sum(min(b, t_end) - max(a, t0) for a, b, running, queued in steps
                   if min(b, t_end) > max(a, t0) and (queued > 0 or running >= REPORTED_BATCH))
        shares.append(full / window if window > 0 else 1.0)
    tails = [max(0.0, e - t_end) for e in ends]
    mean_tail = sum(tails) / len(tails)
    wall = max(ends) - first
    return {"output_tokens": output_tokens, "wall_s": wall, "tokens_per_s": output_tokens / wall,
            "served": served, "full_share": shares, "full_share_min": min(shares),
            "tail_s": max(tails), "tail_ratio": max(tails) / mean_tail if mean_tail > 0 else 1.0,
            "peak_running": [max(r for _, _, r, _ in steps) if steps else 0 for steps, _, _ in per],
            "peak_queued": [max((q for _, _, _, q in steps), default=0) for steps, _, _ in per],
            "down_s": [sum(b - a for a, b in down) for _, _, down in per]}


# -- regen ------------------------------------------------------------------------------------------------------
def launch_for(variant: str, base_port: int, mark: Path) -> str:
    """The launch template of a variant: per-server arguments chosen by the port (the supervisor formats {port})."""
    if variant == "late":
        extra = f"--sim-load-s $(( ({{port}} - {base_port}) * {int(LATE_S)} ))"
    elif variant == "restart":
        extra = (f"$( if [ {{port}} -eq {base_port} ] && [ ! -e {mark} ] && mkdir {mark}; then "
                 f"echo --sim-crash-after {CRASH_AFTER}; fi )")
    else:
        return bc.SIM_LAUNCH
    return "sh -c '" + bc.SIM_LAUNCH + " \"$@\" " + extra + "' regen-sim"  # after the extra args: these win


def run_regen(model: Path, prompts: Path, work: Path, gpus: int, variant: str, requests: int) -> dict:
    run_dir = work / "run"
    cfg = bc.sim_config(model, [prompts], run_dir, gpus=gpus, sim_args=sim_args(),
                        sampling=Sampling(max_new_tokens=MAX_NEW))
    launch = launch_for(variant, cfg.workers.base_port, work / "crashed-once")
    cfg = cfg.model_copy(update=dict(workers=cfg.workers.model_copy(update=dict(launch=launch))))
    res = bc.run_supervisor(cfg, timeout=600)
    if res.exit_code != 0:
        tail = "\n".join(line for _, line in res.lines[-30:])
        raise RuntimeError(f"supervisor exited {res.exit_code}; {run_dir}/supervisor.log:\n{tail}")
    import sqlite3

    db = sqlite3.connect(run_dir / "state.sqlite")
    (tokens,) = db.execute("SELECT sum(output_len) FROM samples").fetchone()
    db.close()
    logs = []
    for wdir in sorted((run_dir / "workers").iterdir()):
        logs.extend(sorted(wdir.glob("server*.log")))
    return figures(logs, requests, int(tokens or 0))


# -- baseline (its own process, pinned like the engine) --------------------------------------------------------
def baseline_client(urls: list[str], prompts: Path, n: int, threads: int) -> dict:
    rows = bc.first_rows(prompts, n)

    def one(i: int, row: dict) -> int:
        return bc.chat_completion(urls[i % len(urls)], row, MAX_NEW, timeout=900)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        tokens = sum(pool.map(one, range(len(rows)), rows))
    return {"requests": len(rows), "output_tokens": tokens}


def run_baseline(model: Path, prompts: Path, work: Path, gpus: int, requests: int, threads: int) -> dict:
    sims = bc.start_sims(gpus, model, sim_args(), work / "sims")
    try:
        argv = [sys.executable, "-m", "tests.bench.bench_spread", "--baseline-client", "--urls", ",".join(sims.urls),
                "--prompts", str(prompts), "--requests", str(requests), "--threads", str(threads)]
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=str(bc.REPO), timeout=900,
                              preexec_fn=lambda: os.sched_setaffinity(0, bc.ENGINE_CPUS))
        if proc.returncode != 0:
            raise RuntimeError(f"baseline client failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        tokens = json.loads(proc.stdout.strip().splitlines()[-1])["output_tokens"]
    finally:
        sims.stop()
    return figures(sims.logs, requests, tokens)


# -- the runs ---------------------------------------------------------------------------------------------------
def run(requests: int, gpus: int, repeats: int, variants: list[str], baseline: bool = True,
        keep: Path | None = None) -> dict:
    model = bc.tiny_model()
    base = keep or Path(tempfile.mkdtemp(prefix="regen-bench-spread-"))
    sizes = {v: max(gpus, requests // 8) if v == "small" else requests for v in variants}
    prompts = {n: bc.write_prompts(base / f"prompts-{n}.jsonl", n) for n in set(sizes.values())}
    threads = {"baseline_64": 64, "baseline_batch": REPORTED_BATCH * gpus}
    runs: dict[str, list[dict]] = {}
    try:
        for r in range(repeats):
            order = [*variants]
            if baseline:
                order += list(threads)
            if r % 2:
                order.reverse()  # alternated: the machine's drift weighs on every client alike
            for name in order:
                work = base / f"r{r}-{name}"
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                if name in threads:
                    res = run_baseline(model, prompts[requests], work, gpus, requests, threads[name])
                else:
                    res = run_regen(model, prompts[sizes[name]], work, gpus, name, sizes[name])
                runs.setdefault(name, []).append(res)
                print(f"  spread {r + 1}/{repeats} {name}: {res['tokens_per_s']:,.0f} tok/s, served {res['served']},"
                      f" full-batch share min {res['full_share_min']:.1%}, tail ratio {res['tail_ratio']:.2f},"
                      f" peak running {res['peak_running']}, peak queued {res['peak_queued']}", flush=True)
                if not keep:
                    shutil.rmtree(work, ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)

    def med(name: str, key: str) -> float:
        return bc.median([x[key] for x in runs[name]])

    median = {name: {k: med(name, k) for k in ("tokens_per_s", "wall_s", "full_share_min", "tail_ratio", "tail_s")}
              for name in runs}
    out = {"benchmark": "spread", "repeats": repeats, "simulators": gpus, "requests": sizes,
           "sim_args": sim_args(), "max_new_tokens": MAX_NEW, "reported_batch": REPORTED_BATCH, "kv_pool": POOL,
           "median": median, "runs": runs, "machine": bc.machine(),
           "target": {"speedup_vs_best_baseline": TARGET_SPEEDUP, "full_share": TARGET_FULL_SHARE,
                      "tail_ratio": TARGET_TAIL}}
    if baseline and "kv" in runs:
        best = max(median[n]["tokens_per_s"] for n in threads)
        out["speedup_vs_best_baseline"] = median["kv"]["tokens_per_s"] / best
    out["met"] = {v: median[v]["full_share_min"] >= TARGET_FULL_SHARE and median[v]["tail_ratio"] <= TARGET_TAIL
                  for v in variants}
    if "speedup_vs_best_baseline" in out:
        out["met"]["speedup"] = out["speedup_vs_best_baseline"] >= TARGET_SPEEDUP
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--keep", type=Path, default=None, help="keep every run dir and server log under this folder")
    ap.add_argument("--baseline-client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--urls", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.baseline_client:
        print(json.dumps(baseline_client(args.urls.split(","), args.prompts, args.requests, args.threads)))
        return 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants {','.join(unknown)}: not a variant; known: {', '.join(VARIANTS)}")
    res = run(args.requests, args.gpus, args.repeats, variants, baseline=not args.no_baseline, keep=args.keep)
    out = bc.write_result("spread", res)
    for name, m in res["median"].items():
        print(f"{name}: {m['tokens_per_s']:,.0f} tok/s, full-batch share min {m['full_share_min']:.1%}, "
              f"tail ratio {m['tail_ratio']:.2f}")
    if "speedup_vs_best_baseline" in res:
        print(f"regen vs the best baseline: {res['speedup_vs_best_baseline']:.2f}x")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
