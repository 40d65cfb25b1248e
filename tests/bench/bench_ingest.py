"""Ingest ceiling: output tokens/s the engine commits to shards on ONE core, against instant simulators.

    .venv/bin/python -m tests.bench.bench_ingest [--samples 8000] [--baseline-samples 1500] [--repeats 5]

regen: the real supervisor (`python -m engine.supervisor`: work plan -> dispatcher -> committer ->
ShardStore, native /generate with input_ids, exact output_ids into zstd Parquet parts committed in
sqlite), pinned with sched_setaffinity to one core; it launches its simulators itself (one per
simulated GPU, `--sim-instant`: prebuilt outputs, answered at once) and they pin themselves to the
other core(s). Output lengths: lognormal, mean --output-mean (4000) tokens, sigma 0.5, like long
thinking answers, so the per-request overhead is amortized as in a real run.

Figure: tokens/s between the first and the last part commit (tokens of every part after the
first), from the parts' committed_at in state.sqlite and the samples' output_len; and the same
tokens per CPU second of the supervisor process (psutil user+system, sampled every 50 ms), which is
what one core would give it alone: this box is shared, so wall rates are a lower bound.
Also end to end: all output tokens / (last commit - first worker ready).

baseline (same simulators, same core layout, same output lengths: the same rid per prompt): the way
peer scripts do it: a ThreadPoolExecutor of --threads threads, each with a keep-alive HTTP
connection (as a requests.Session), POST /v1/chat/completions with the chat messages, json.loads
the reply, append {"id", "messages", "response"} to a JSONL file, then count the output tokens
afterwards by re-tokenizing the responses (transformers, batches of 256). Figure: tokens / (time to
the last reply written + re-tokenizing time); and tokens per CPU-second of its process (every thread,
requests + re-tokenizing, imports excluded), against regen's per CPU-second (ratio_cpu, met_cpu): on a
loaded box each side's wall rate is its CPU rate times the share of the core it got, which differs
between the two sides of a run.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

from engine.config.load import Store
from tests.bench import bench_common as bc

TARGET_TOKENS_PER_S = 1_000_000
TARGET_RATIO = 10.0
FULL_PART_ROWS = 256
_COMMITTED = re.compile(r"committed \S+: (\d+) rows, (\d+) output tokens, at ([\d.]+)")


def sim_args(output_mean: int) -> list[str]:
    return ["--sim-instant", "--sim-output-mean", str(output_mean), "--sim-output-sigma", "0.5",
            "--max-running-requests", "64", "--log-level-http", "warning"]


# -- regen ------------------------------------------------------------------------------------------
def run_regen(model: Path, prompts: Path, work: Path, gpus: int, output_mean: int,
              profile: Path | None = None) -> dict:
    run_dir = work / "run"
    # parts of FULL_PART_ROWS rows: the figure is the rate between the first and the last commit, so it needs
    # several parts; the run's default (1,024 rows or 5 s) made one part of a quick run ([store], engine.config.load)
    cfg = bc.sim_config(model, [prompts], run_dir, gpus=gpus, sim_args=sim_args(output_mean),
                        store=Store(part_max_rows=FULL_PART_ROWS, part_max_age_s=2.0))
    res = bc.run_supervisor(cfg, timeout=600, profile=profile)
    if res.exit_code != 0:
        tail = "\n".join(line for _, line in res.lines[-30:])
        raise RuntimeError(f"supervisor exited {res.exit_code}; {run_dir}/supervisor.log:\n{tail}")
    db = sqlite3.connect(run_dir / "state.sqlite")
    samples, tokens = db.execute("SELECT count(*), sum(output_len) FROM samples").fetchone()
    db.close()
    # each part's commit as the committer logged it: a finished shard is compacted into one file at the run's end,
    # so state.sqlite no longer lists the parts
    parts = sorted((float(m.group(3)), int(m.group(1)), int(m.group(2))) for _, line in res.lines
                   if (m := _COMMITTED.search(line)))
    if len(parts) < 3:
        raise RuntimeError(f"only {len(parts)} parts committed: use more --samples")
    # steady state: the parts after the first, over the time between the first and the last commit
    steady_tokens = sum(p[2] for p in parts[1:])
    steady_s = parts[-1][0] - parts[0][0]
    steady_cpu = res.cpu_at(parts[-1][0]) - res.cpu_at(parts[0][0])
    ready = [t for t, line in res.lines if "-> ready" in line]
    e2e_s = parts[-1][0] - max(ready) if ready else float("nan")
    return {"samples": samples, "output_tokens": tokens, "parts": len(parts),
            "full_parts": sum(1 for p in parts if p[1] == FULL_PART_ROWS),
            "tokens_per_s": steady_tokens / steady_s, "steady_window_s": steady_s,
            "tokens_per_cpu_s": steady_tokens / steady_cpu if steady_cpu > 0 else float("nan"),
            "engine_cpu_share": steady_cpu / steady_s,
            "end_to_end_tokens_per_s": tokens / e2e_s, "end_to_end_s": e2e_s,
            "supervisor_wall_s": res.wall_s, "supervisor_peak_rss_mb": res.peak_rss_bytes / 2**20,
            "parquet_bytes": sum(f.stat().st_size for f in (run_dir / "shards").rglob("*.parquet"))}


# -- baseline (runs in its own process, pinned like the engine) ---------------------------------------
def baseline_client(urls: list[str], prompts: Path, n: int, threads: int, out: Path, model: str,
                    max_tokens: int) -> dict:
    rows = bc.first_rows(prompts, n)
    local = threading.local()
    lock = threading.Lock()
    sink = open(out, "w")

    def conn_for(url: str) -> http.client.HTTPConnection:
        conns = getattr(local, "conns", None)
        if conns is None:
            conns = local.conns = {}
        if url not in conns:
            u = urlparse(url)
            conns[url] = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
        return conns[url]

    def one(i: int, row: dict) -> None:
        url = urls[i % len(urls)]
        body = json.dumps({"model": "default", "messages": row["messages"], "max_tokens": max_tokens,
                           "temperature": 0.6, "top_p": 0.95, "rid": f"{row['id']}#turn0",
                           "skip_special_tokens": False})
        conn = conn_for(url)
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {data}")
        msg = data["choices"][0]["message"]
        text = (msg.get("reasoning_content") or "") + (msg.get("content") or "")
        line = json.dumps({"id": row["id"], "messages": row["messages"], "response": text}) + "\n"
        with lock:
            sink.write(line)

    t0, c0 = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(max_workers=threads) as ex:
        futures = [ex.submit(one, i, row) for i, row in enumerate(rows)]
        for fut in futures:
            fut.result()
    sink.close()
    t1, c1 = time.perf_counter(), time.process_time()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    t_tok, c_tok = time.perf_counter(), time.process_time()
    tokens = 0
    batch: list[str] = []
    with open(out) as f:
        for line in f:
            batch.append(json.loads(line)["response"])
            if len(batch) == 256:
                tokens += sum(len(ids) for ids in tok(batch, add_special_tokens=False).input_ids)
                batch = []
    if batch:
        tokens += sum(len(ids) for ids in tok(batch, add_special_tokens=False).input_ids)
    t2, c2 = time.perf_counter(), time.process_time()
    counting_s = t2 - t_tok
    total_s = (t1 - t0) + counting_s
    cpu_s = (c1 - c0) + (c2 - c_tok)  # every thread of the process (the pool's, the tokenizer's), imports excluded
    return {"samples": len(rows), "output_tokens": tokens, "requests_s": t1 - t0, "retokenize_s": counting_s,
            "tokens_per_s": tokens / total_s, "requests_only_tokens_per_s": tokens / (t1 - t0), "threads": threads,
            "requests_cpu_s": c1 - c0, "retokenize_cpu_s": c2 - c_tok, "tokens_per_cpu_s": tokens / cpu_s}


def run_baseline(model: Path, prompts: Path, work: Path, gpus: int, n: int, threads: int, output_mean: int) -> dict:
    sims = bc.start_sims(gpus, model, sim_args(output_mean), work / "sims")
    try:
        out = work / "baseline.jsonl"
        argv = [sys.executable, "-m", "tests.bench.bench_ingest", "--baseline-client", "--urls", ",".join(sims.urls),
                "--prompts", str(prompts), "--baseline-samples", str(n), "--threads", str(threads),
                "--out", str(out), "--model", str(model)]
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=str(bc.REPO), timeout=900,
                              preexec_fn=lambda: os.sched_setaffinity(0, bc.ENGINE_CPUS))
        if proc.returncode != 0:
            raise RuntimeError(f"baseline client failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        sims.stop()


def run(samples: int, baseline_samples: int, repeats: int, gpus: int, threads: int, output_mean: int,
        keep: Path | None = None) -> dict:
    model = bc.tiny_model()
    base = keep or Path(tempfile.mkdtemp(prefix="regen-bench-ingest-"))
    prompts = bc.write_prompts(base / "prompts.jsonl", max(samples, baseline_samples))
    regen_runs, base_runs = [], []
    try:
        for r in range(repeats):
            work = base / f"r{r}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            regen_runs.append(run_regen(model, prompts, work, gpus, output_mean))
            print(f"  ingest run {r + 1}/{repeats}: regen {regen_runs[-1]['tokens_per_s']:,.0f} tok/s "
                  f"({regen_runs[-1]['samples']} samples, {regen_runs[-1]['output_tokens']:,} tokens)", flush=True)
            base_runs.append(run_baseline(model, prompts, work, gpus, baseline_samples, threads, output_mean))
            print(f"  ingest run {r + 1}/{repeats}: baseline {base_runs[-1]['tokens_per_s']:,.0f} tok/s "
                  f"({base_runs[-1]['samples']} samples)", flush=True)
            if not keep:
                shutil.rmtree(work, ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    regen_rate = bc.median([r["tokens_per_s"] for r in regen_runs])
    base_rate = bc.median([r["tokens_per_s"] for r in base_runs])
    regen_cpu = bc.median([r["tokens_per_cpu_s"] for r in regen_runs])
    base_cpu = bc.median([r["tokens_per_cpu_s"] for r in base_runs])
    return {
        "benchmark": "ingest", "repeats": repeats, "simulators": gpus, "output_mean": output_mean,
        "regen": {"tokens_per_s_median": regen_rate, "tokens_per_cpu_s_median": regen_cpu, "runs": regen_runs},
        "baseline": {"tokens_per_s_median": base_rate, "tokens_per_cpu_s_median": base_cpu, "runs": base_runs,
                     "how": f"ThreadPoolExecutor({threads}) + keep-alive http.client, /v1/chat/completions, "
                            "JSONL, re-tokenized afterwards"},
        "ratio": regen_rate / base_rate,
        # the same per CPU-second of each process (regen: its steady window; baseline: requests + re-tokenizing): on
        # a shared box each side's wall rate is its CPU rate times the share of the core it got
        "ratio_cpu": regen_cpu / base_cpu,
        "targets": {"tokens_per_s": TARGET_TOKENS_PER_S, "ratio": TARGET_RATIO},
        "met": regen_rate >= TARGET_TOKENS_PER_S and regen_rate / base_rate >= TARGET_RATIO,
        "met_cpu": regen_cpu >= TARGET_TOKENS_PER_S and regen_cpu / base_cpu >= TARGET_RATIO,
        "machine": bc.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=8000)
    ap.add_argument("--baseline-samples", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gpus", type=int, default=2, help="simulators (simulated GPUs)")
    ap.add_argument("--threads", type=int, default=64, help="baseline client threads")
    ap.add_argument("--output-mean", type=int, default=4000)
    ap.add_argument("--keep", type=Path, default=None)
    ap.add_argument("--profile", type=Path, default=None,
                    help="one regen run under cpu_profile.py (cProfile, CPU clock): pstats here, summary in .txt")
    ap.add_argument("--regen-only", action="store_true", help="one regen run, no baseline, results printed only")
    # internal: the baseline client process
    ap.add_argument("--baseline-client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--urls", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.profile or args.regen_only:
        base = Path(tempfile.mkdtemp(prefix="regen-bench-ingest-prof-"))
        prompts = bc.write_prompts(base / "prompts.jsonl", args.samples)
        res = run_regen(bc.tiny_model(), prompts, base, args.gpus, args.output_mean, profile=args.profile)
        print(json.dumps(res, indent=2))
        shutil.rmtree(base, ignore_errors=True)
        return 0
    if args.baseline_client:
        res = baseline_client(args.urls.split(","), args.prompts, args.baseline_samples, args.threads, args.out,
                              args.model, 32768)
        print(json.dumps(res))
        return 0
    res = run(args.samples, args.baseline_samples, args.repeats, args.gpus, args.threads, args.output_mean, args.keep)
    out = bc.write_result("ingest", res)
    print(f"regen {res['regen']['tokens_per_s_median']:,.0f} tok/s, baseline "
          f"{res['baseline']['tokens_per_s_median']:,.0f} tok/s, ratio {res['ratio']:.1f}x; per CPU-second regen "
          f"{res['regen']['tokens_per_cpu_s_median']:,.0f}, baseline {res['baseline']['tokens_per_cpu_s_median']:,.0f}, "
          f"ratio {res['ratio_cpu']:.1f}x; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
