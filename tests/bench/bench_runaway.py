"""Runaway guard: simulated GPU-seconds per kept sample with the guard vs without it, in the same run.

    .venv/bin/python -m tests.bench.bench_runaway [--samples 1200] [--gpus 4] [--cpu-repeats 3] [--incremental]

4 simulated GPUs (128 running requests each, continuous batching; 8 tokens a step of 1 ms + 0.05 ms per running
request, so a request gains ~1,000 tokens/s: fast enough to run in a minute, slow enough that the client's
reaction time, in tokens, stays small as on a real GPU), max_new_tokens 32,768, lognormal answers (mean
2,000 tokens, sigma 0.8), 2% of answers looping (a token cycle of period 1..400 from half-way through a normal
answer to max_new_tokens: --sim-loop-share) and 1% legitimately repetitive long answers (numbered lists, tables,
code, multiplication tables, ~8,000 tokens: --sim-repetitive-share). The same prompts and seed run twice, the
guard on ([runaway] defaults: every answer streamed) and off (plain requests): each rid gets the same answer in
both. Figures:

  gpu_s            simulated GPU time, the simulators' own accounting (the sum of their steps' times by the cost
                   model, the "Simulator: simulated GPU time" line of each server.log), not wall time
  kept             samples a trainer keeps (finish_reason stop; loops end as length without the guard, repetition
                   with it: both dropped by exports)
  loops stopped early   loops (known from the simulator's plan of each rid) stopped before 25% of max_new_tokens
  legit stopped    answers that are no loop (repetitive ones included) stopped by the guard: must be 0
  client cost      supervisor CPU-seconds per million output tokens received, streamed vs not, over the dispatch
                   (from the supervisor's "plan:" line, once the servers are up, to its exit): the start-up (imports,
                   tokenizer, server launches) costs the same in both runs and is no cost per token (the whole-process
                   figure is also reported, as cpu_s_per_m_tokens_whole). Measured on the same answers: --cpu-repeats
                   pairs of runs without loops (--sim-loop-share 0, the same prompts and seed: every rid gets the same
                   answer, so both runs receive the same tokens in about the same time), streamed with the guard and
                   plain, alternated; medians. The guard and no-guard runs above do not compare per token: the guard
                   cuts the loops, so its run receives ~30% fewer tokens for the same requests and the same per-second
                   costs (metrics scrapes) in a shorter run, and the dispatch's cost is mostly per request and per
                   second, not per token (their ratio is reported too, as client_cpu_ratio_guard_vs_no_guard). And
                   the detector's own cost per token (in process, chunks of 64 tokens, median of 3)

Targets (issue 17): >= 20% less GPU time per kept sample, 0 legitimate answers stopped, >= 95% of loops stopped
before 25% of max_new_tokens; (issue 27) the streamed run's client CPU per token <= 1.2x the plain run's. regen
launches each server with its version's delta-streaming flag (engine.servers.stream_flag: --incremental-streaming-output
on the simulator's default 0.5.23), so the guarded run streams only the new ids. --incremental adds a guarded run
whose launch line names the flag itself (the same streams, the operator's spelling).
"""
from __future__ import annotations

import argparse
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path

from engine.config.load import Dispatch, Runaway, Sampling
from tests.bench import bench_common as bc

MAX_NEW = 32768
EARLY = MAX_NEW // 4
SEED = 17
TARGET_SAVING = 0.20
TARGET_EARLY = 0.95
TARGET_CPU_RATIO = 1.2  # client CPU per token, streamed over plain (issue 27)
LOOP_SHARE = 0.02
GPU_LINE = re.compile(r"Simulator: simulated GPU time ([0-9.]+) s busy, (\d+) steps, (\d+) tokens")


def sim_args(incremental: bool, loop_share: float = LOOP_SHARE) -> list[str]:
    args = ["--sim-output-mean", "2000", "--sim-output-sigma", "0.8", "--sim-loop-share", str(loop_share),
            "--sim-repetitive-share", "0.01", "--sim-tokens-per-step", "8", "--sim-step-ms", "1.0",
            "--sim-step-ms-per-req", "0.05", "--sim-prefill-ms-per-1k", "0", "--max-running-requests", "128",
            "--sim-seed", str(SEED), "--log-level-http", "warning", "--decode-log-interval", "400"]
    return args + (["--incremental-streaming-output"] if incremental else [])


def gpu_accounting(run_dir: Path) -> dict:
    """Each simulator's last accounting line (cumulative): GPU seconds, steps, tokens generated."""
    per = {}
    for log in sorted((run_dir / "workers").glob("*/server.log")):
        found = GPU_LINE.findall(log.read_text(errors="replace"))
        if not found:
            raise RuntimeError(f"{log}: no 'Simulator: simulated GPU time' line")
        busy, steps, tokens = found[-1]
        per[log.parent.name] = {"gpu_s": float(busy), "steps": int(steps), "tokens": int(tokens)}
    return {"gpu_s": sum(p["gpu_s"] for p in per.values()), "tokens": sum(p["tokens"] for p in per.values()),
            "per_worker": per}


def classify(run_dir: Path, model: Path, args: list[str]) -> dict:
    """Rows against the simulator's plan of their rid: what each answer was going to be."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from engine.store.shard_store import ShardStore
    from engine.simulator.generator import OutputGenerator, request_key

    val = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    gen = OutputGenerator(AutoTokenizer.from_pretrained(str(model)), seed=SEED, mean=float(val["--sim-output-mean"]),
                          sigma=float(val["--sim-output-sigma"]), empty_share=0.0, abort_rate=0.0,
                          loop_share=float(val["--sim-loop-share"]),
                          repetitive_share=float(val["--sim-repetitive-share"]))
    store = ShardStore(run_dir)
    try:
        parts = store.parts()
    finally:
        store.close()
    out = {"samples": 0, "kept": 0, "finish": {}, "loops": 0, "loops_stopped": 0, "loops_stopped_early": 0,
           "loop_stop_at": [], "loop_stop_late_by": [], "repetitive": 0, "legit_stopped": 0, "inexact": 0, "retried": 0,
           "tokens_received": 0}
    for part in parts:
        cols = pq.read_table(run_dir / part.path, columns=["sample_id", "input_ids", "prompt_len",
                                                            "finish_reason"]).to_pydict()
        for sid, ids, plen, fr in zip(cols["sample_id"], cols["input_ids"], cols["prompt_len"], cols["finish_reason"]):
            prompt, answer = ids[:plen], ids[plen:]
            # the rid of the attempt that answered (a retry sends sid@k): the one whose plan the answer follows
            for attempt in range(Dispatch().max_retries + 1):
                plan = gen.plan(request_key(SEED, sid if attempt == 0 else f"{sid}@{attempt}", prompt), prompt,
                                MAX_NEW)
                if answer == plan.output_ids[: len(answer)]:
                    break
            out["retried"] += attempt > 0
            out["samples"] += 1
            out["tokens_received"] += len(answer)
            out["finish"][fr] = out["finish"].get(fr, 0) + 1
            out["kept"] += fr == "stop"
            out["inexact"] += answer != plan.output_ids[: len(answer)]
            if plan.kind == "loop":
                out["loops"] += 1
                if fr == "repetition":
                    out["loops_stopped"] += 1
                    out["loops_stopped_early"] += len(answer) < EARLY
                    out["loop_stop_at"].append(len(answer))
                    need = plan.loop_onset + max(Runaway().min_span, Runaway().min_repeats * plan.loop_period)
                    out["loop_stop_late_by"].append(len(answer) - need)
            else:
                out["repetitive"] += plan.kind == "repetitive"
                out["legit_stopped"] += fr == "repetition"
    late = out.pop("loop_stop_late_by")
    out["loop_stop_late_by_median"] = statistics.median(late) if late else None
    out["loop_stop_late_by_max"] = max(late) if late else None
    at = out.pop("loop_stop_at")
    out["loop_stop_at_median"] = statistics.median(at) if at else None
    out["loop_stop_at_max"] = max(at) if at else None
    return out


def run_case(model: Path, prompts: Path, work: Path, *, name: str, gpus: int, guard: bool, incremental: bool,
             loop_share: float = LOOP_SHARE) -> dict:
    run_dir = work / name
    args = sim_args(incremental, loop_share)
    cfg = bc.sim_config(model, [prompts], run_dir, gpus=gpus, sim_args=args,
                        sampling=Sampling(max_new_tokens=MAX_NEW), dispatch=Dispatch(request_timeout_s=900.0),
                        runaway=Runaway(enabled=guard))
    res = bc.run_supervisor(cfg, timeout=1500)
    if res.exit_code != 0:
        tail = "\n".join(line for _, line in res.lines[-30:])
        raise RuntimeError(f"{name}: supervisor exited {res.exit_code}; {run_dir}/supervisor.log:\n{tail}")
    acc = gpu_accounting(run_dir)
    rows = classify(run_dir, model, args)
    began = bc.first_line_time(res.lines, "regen.supervisor: plan:")
    if began is None:
        raise RuntimeError(f"{name}: no 'plan:' line in {run_dir}/supervisor.log: cannot tell where dispatch began")
    dispatch_cpu = res.cpu_s - res.cpu_at(began)
    return {"guard": guard, "incremental_streaming": incremental, "wall_s": res.wall_s,
            "supervisor_cpu_s": res.cpu_s, "gpu_s": acc["gpu_s"], "tokens_generated": acc["tokens"],
            "per_worker": acc["per_worker"], **rows,
            "gpu_s_per_kept": acc["gpu_s"] / rows["kept"] if rows["kept"] else None,
            "dispatch_cpu_s": dispatch_cpu,
            "cpu_s_per_m_tokens": dispatch_cpu / rows["tokens_received"] * 1e6 if rows["tokens_received"] else None,
            "cpu_s_per_m_tokens_whole": res.cpu_s / rows["tokens_received"] * 1e6 if rows["tokens_received"] else None}


def detector_cost(repeats: int = 3, tokens: int = 32768, chunk: int = 64) -> dict:
    """The detector alone, per token, on a random answer fed as the dispatcher feeds it."""
    from engine.run.runaway import RunawayDetector

    rng = random.Random(1)
    src = [rng.randrange(50_000) for _ in range(tokens)]
    runs = []
    for _ in range(repeats):
        ids, det = array("i"), RunawayDetector(Runaway())
        t = time.process_time()
        for start in range(0, tokens, chunk):
            ids.extend(src[start:start + chunk])
            det.feed(ids, start)
        runs.append((time.process_time() - t) / tokens * 1e6)
    return {"us_per_token_median": statistics.median(runs), "runs_us_per_token": runs, "chunk_tokens": chunk,
            "answer_tokens": tokens}


def cpu_pairs(model: Path, prompts: Path, work: Path, gpus: int, repeats: int) -> dict:
    """Client CPU per token, streamed (guard on) vs plain, on the same answers: runs without loops, alternated."""
    runs: dict[str, list[dict]] = {"streamed": [], "plain": []}
    for r in range(repeats):
        for kind, guard in (("streamed", True), ("plain", False)):
            case = run_case(model, prompts, work, name=f"cpu_{kind}_{r}", gpus=gpus, guard=guard, incremental=False,
                            loop_share=0.0)
            runs[kind].append({k: case[k] for k in ("wall_s", "supervisor_cpu_s", "dispatch_cpu_s", "tokens_received",
                                                    "cpu_s_per_m_tokens", "cpu_s_per_m_tokens_whole", "inexact")})
            print(f"  runaway cpu pair {r + 1}/{repeats}: {kind} {case['cpu_s_per_m_tokens']:.3f} CPU s per 1M tokens "
                  f"({case['dispatch_cpu_s']:.2f} s, {case['tokens_received']:,} tokens)", flush=True)
            shutil.rmtree(work / f"cpu_{kind}_{r}", ignore_errors=True)
    med = {kind: statistics.median(x["cpu_s_per_m_tokens"] for x in v) for kind, v in runs.items()}
    same = len({x["tokens_received"] for v in runs.values() for x in v}) == 1
    # each pair ran back to back, under about the same load: its own ratio is the steadier figure on a shared box
    pair_ratios = [s["cpu_s_per_m_tokens"] / p["cpu_s_per_m_tokens"] for s, p in zip(runs["streamed"], runs["plain"])]
    return {"repeats": repeats, "loop_share": 0.0, "streamed_cpu_s_per_m_tokens_median": med["streamed"],
            "plain_cpu_s_per_m_tokens_median": med["plain"], "ratio": med["streamed"] / med["plain"],
            "pair_ratios": pair_ratios, "pair_ratio_median": statistics.median(pair_ratios),
            "same_tokens_received": same, "runs": runs}


def run(samples: int = 1200, gpus: int = 4, incremental: bool = False, keep: Path | None = None,
        cpu_repeats: int = 3) -> dict:
    model = bc.tiny_model()
    work = Path(tempfile.mkdtemp(prefix="regen-bench-runaway-"))
    try:
        prompts = bc.write_prompts(work / "prompts.jsonl", samples, seed=SEED)
        cases = {"guard": run_case(model, prompts, work, name="guard", gpus=gpus, guard=True, incremental=False),
                 "no_guard": run_case(model, prompts, work, name="no_guard", gpus=gpus, guard=False,
                                      incremental=False)}
        if incremental:
            cases["guard_incremental"] = run_case(model, prompts, work, name="guard_incremental", gpus=gpus,
                                                  guard=True, incremental=True)
        cpu = cpu_pairs(model, prompts, work, gpus, cpu_repeats)
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            keep.mkdir(parents=True, exist_ok=True)
            shutil.move(str(work), str(keep / work.name))
    g, n = cases["guard"], cases["no_guard"]
    saving = 1.0 - g["gpu_s_per_kept"] / n["gpu_s_per_kept"]
    early = g["loops_stopped_early"] / g["loops"] if g["loops"] else None
    legit = g["legit_stopped"] + cases.get("guard_incremental", {}).get("legit_stopped", 0)
    result = {
        "samples": samples, "gpus": gpus, "max_new_tokens": MAX_NEW, "seed": SEED, "sim_args": sim_args(False),
        "runaway": Runaway().model_dump(), "cases": cases, "detector": detector_cost(),
        "gpu_time_saving_per_kept": saving, "loops_stopped_early_share": early, "legit_stopped": legit,
        "client_cpu": cpu, "client_cpu_ratio_streamed_vs_plain": cpu["ratio"],
        "client_cpu_ratio_guard_vs_no_guard": (g["cpu_s_per_m_tokens"] / n["cpu_s_per_m_tokens"]
                                               if g["cpu_s_per_m_tokens"] and n["cpu_s_per_m_tokens"] else None),
        "inexact_rows": sum(c["inexact"] for c in cases.values())
        + sum(x["inexact"] for v in cpu["runs"].values() for x in v),
        "targets": {"gpu_time_saving": TARGET_SAVING, "loops_stopped_early_share": TARGET_EARLY, "legit_stopped": 0,
                    "client_cpu_ratio_streamed_vs_plain": TARGET_CPU_RATIO},
        "met": saving >= TARGET_SAVING and early is not None and early >= TARGET_EARLY and legit == 0
        and cpu["same_tokens_received"] and cpu["ratio"] <= TARGET_CPU_RATIO,
        "machine": bc.machine(),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1200)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--incremental", action="store_true", help="also a guarded run on delta-streaming servers")
    ap.add_argument("--cpu-repeats", type=int, default=3, help="pairs of loop-free runs for the client CPU figure")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run dirs under this directory")
    args = ap.parse_args(argv)
    res = run(args.samples, args.gpus, args.incremental, args.keep, args.cpu_repeats)
    path = bc.write_result("runaway", res)
    g, n = res["cases"]["guard"], res["cases"]["no_guard"]
    print(f"GPU-s per kept sample: guard {g['gpu_s_per_kept']:.4f} ({g['kept']} kept), no guard "
          f"{n['gpu_s_per_kept']:.4f} ({n['kept']} kept): {res['gpu_time_saving_per_kept']:.1%} less")
    print(f"loops: {g['loops']}, stopped {g['loops_stopped']}, before {EARLY} tokens {g['loops_stopped_early']} "
          f"(median stop at {g['loop_stop_at_median']}); legit stopped {res['legit_stopped']} "
          f"(of {g['samples'] - g['loops']}, {g['repetitive']} repetitive); inexact rows {res['inexact_rows']}")
    c = res["client_cpu"]
    print(f"client CPU s per 1M tokens, same answers (medians of {c['repeats']} loop-free pairs): streamed "
          f"{c['streamed_cpu_s_per_m_tokens_median']:.3f}, plain {c['plain_cpu_s_per_m_tokens_median']:.3f} "
          f"({c['ratio']:.2f}x, target <= {TARGET_CPU_RATIO}x; pair by pair {', '.join(f'{r:.2f}' for r in c['pair_ratios'])}"
          f"; same tokens: {c['same_tokens_received']}); guard vs no "
          f"guard (different answers) {g['cpu_s_per_m_tokens']:.2f} vs {n['cpu_s_per_m_tokens']:.2f} "
          f"({res['client_cpu_ratio_guard_vs_no_guard']:.2f}x); detector {res['detector']['us_per_token_median']:.2f} "
          f"us/token; met: {res['met']}; wrote {path}")
    return 0 if res["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
