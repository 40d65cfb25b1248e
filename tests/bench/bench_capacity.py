"""GPU occupancy when the servers do not report their batch size: regen's discovery vs the old 64 default.

    .venv/bin/python -m tests.bench.bench_capacity [--requests 12000] [--gpus 2] [--batch 256] [--repeats 1]
                                                   [--cases log,internal_states,feedback]

Real SGLang says `max_running_requests: null` unless the flag is passed; its scheduler runs a batch derived
from the KV pool (shared/reference/sglang_contract.md 7.1). Simulated servers here run BATCH requests (their
request slots, --sim-max-num-reqs; no --max-running-requests; a KV pool big enough for the whole batch), with
output lengths lognormal (mean 512 tokens, sigma 1.2, cut at max_new_tokens 4096), 4 tokens per step, and log
every decode step (sim_ms.py). Cases:

  log              --sim-sglang-version 0.5.5: null in /get_server_info, said only in the start-up log line
  internal_states  --sim-sglang-version 0.5.23: said only as internal_states[0].effective_max_running_requests_per_dp
  feedback         0.5.5 with the start-up line filtered out of server.log: said nowhere, found from the queue

Each case runs regen as it is and, in the same run, the old behaviour as the baseline: the 64 default plus its
margin and no feedback, i.e. dispatch.max_in_flight_per_worker = 64 + 8 (kept for this comparison only).
Figures as tests/bench/bench_occupancy.py (full-batch share of the window per simulator, min and mean; mean
batch fill; wall time), with BATCH as the full batch. The target (>= 98% on the worst GPU) is for the cases
where the server says its batch somewhere (log, internal_states); the window starts when every server has
work, so it includes sending the first BATCH + margin requests per server (and, in the feedback case, the
ticks the size takes to double up from 64): the more requests, the less those fixed costs weigh.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from engine.config.load import Dispatch, Sampling
from tests.bench import bench_common as bc
from tests.bench.bench_occupancy import MAX_NEW, occupancy

TARGET_FULL_SHARE = 0.98
OLD_CAP = 64 + 8  # the old client on a server that does not say: DEFAULT_MAX_RUNNING plus its margin, no feedback
CASES = {
    "log": ("0.5.5", False),
    "internal_states": ("0.5.23", False),
    "feedback": ("0.5.5", True),
}
# the target holds where the server says its batch somewhere; from the queue alone the first ticks
# (2 s each, the size doubling from 64) are a fixed ramp that a bench window of a minute still shows
TARGET_CASES = ("log", "internal_states")
# the start-up line filtered out of server.log: a server whose size regen can learn only from its queue
HIDE_STARTUP_LINE = ("sh -c '" + bc.SIM_LAUNCH + " \"$@\" 2>&1 | grep --line-buffered -v max_total_num_tokens=' "
                     "regen-sim")


def sim_args(version: str, batch: int, step_ms: float) -> list[str]:
    # a KV pool that holds the whole batch at the longest answers: the batch, not the pool, is what limits
    # (the simulator reserves each request's whole answer; the long tail would fill a GPU-sized pool first)
    pool = batch * (MAX_NEW + 512) * 2
    return ["--sim-sglang-version", version, "--sim-max-num-reqs", str(batch), "--max-total-tokens", str(pool),
            "--sim-output-mean", "512",
            "--sim-output-sigma", "1.2", "--sim-step-ms", str(step_ms), "--sim-step-ms-per-req", "0",
            "--sim-tokens-per-step", "4", "--decode-log-interval", "1", "--log-level-http", "warning", "--sim-seed", "11"]


def run_one(model: Path, prompts: Path, work: Path, *, case: str, gpus: int, batch: int, step_ms: float,
            requests: int, old: bool) -> dict:
    version, hide = CASES[case]
    run_dir = work / ("old" if old else "regen")
    cfg = bc.sim_config(model, [prompts], run_dir, gpus=gpus, sim_args=sim_args(version, batch, step_ms),
                        sampling=Sampling(max_new_tokens=MAX_NEW),
                        dispatch=Dispatch(request_timeout_s=600.0, max_in_flight_per_worker=OLD_CAP if old else None))
    if hide:
        cfg = cfg.model_copy(update=dict(workers=cfg.workers.model_copy(update=dict(launch=HIDE_STARTUP_LINE))))
    res = bc.run_supervisor(cfg, timeout=1200)
    if res.exit_code != 0:
        tail = "\n".join(line for _, line in res.lines[-30:])
        raise RuntimeError(f"supervisor exited {res.exit_code}; {run_dir}/supervisor.log:\n{tail}")
    logs = sorted((run_dir / "workers").glob("*/server.log"))
    figures = occupancy(logs, requests, max_running=batch)
    figures["batch_found"] = batch_found(run_dir)
    return figures


def batch_found(run_dir: Path) -> dict:
    """Per worker, the last batch size and source its snapshots showed while it was ready (telemetry.jsonl)."""
    from tests.run_helpers import events

    last = {}
    for e in events(run_dir):
        if e["type"] == "worker" and e["state"] == "ready" and e.get("batch_size") is not None:
            last[e["name"]] = {"size": e["batch_size"], "source": e["batch_source"]}
    return last


def run(requests: int, gpus: int, batch: int, repeats: int, step_ms: float, cases: list[str],
        keep: Path | None = None) -> dict:
    model = bc.tiny_model()
    base = keep or Path(tempfile.mkdtemp(prefix="regen-bench-capacity-"))
    prompts = bc.write_prompts(base / "prompts.jsonl", requests)
    out: dict = {}
    try:
        for case in cases:
            regen_runs, old_runs = [], []
            for r in range(repeats):
                work = base / case / f"r{r}"
                shutil.rmtree(work, ignore_errors=True)
                work.mkdir(parents=True)
                kw = dict(case=case, gpus=gpus, batch=batch, step_ms=step_ms, requests=requests)
                regen_runs.append(run_one(model, prompts, work, old=False, **kw))
                old_runs.append(run_one(model, prompts, work, old=True, **kw))
                print(f"  {case} run {r + 1}/{repeats}: full-batch share (min over GPUs) regen "
                      f"{regen_runs[-1]['full_batch_share_min']:.1%}, old {old_runs[-1]['full_batch_share_min']:.1%};"
                      f" mean fill {regen_runs[-1]['mean_fill']:.1%} vs {old_runs[-1]['mean_fill']:.1%};"
                      f" wall {regen_runs[-1]['wall_s']:.1f} s vs {old_runs[-1]['wall_s']:.1f} s;"
                      f" found {regen_runs[-1]['batch_found']}", flush=True)
                if not keep:
                    shutil.rmtree(work, ignore_errors=True)

            def med(runs: list[dict], key: str) -> float:
                return bc.median([x[key] for x in runs])

            summary = {k: {"regen": med(regen_runs, k), "old": med(old_runs, k)}
                       for k in ("full_batch_share_min", "full_batch_share_mean", "mean_fill", "window_s", "wall_s")}
            out[case] = {"sglang_version": CASES[case][0], "startup_line_hidden": CASES[case][1], "median": summary,
                         "wall_ratio": summary["wall_s"]["old"] / summary["wall_s"]["regen"],
                         "met": (summary["full_batch_share_min"]["regen"] >= TARGET_FULL_SHARE
                                 if case in TARGET_CASES else None),
                         "regen_runs": regen_runs, "old_runs": old_runs}
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    return {"benchmark": "capacity", "repeats": repeats, "simulators": gpus, "requests": requests, "batch": batch,
            "old_cap": OLD_CAP, "step_ms": step_ms, "max_new_tokens": MAX_NEW, "cases": out,
            "target": {"full_batch_share": TARGET_FULL_SHARE},
            "met": all(c["met"] for c in out.values() if c["met"] is not None), "machine": bc.machine()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12000)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--keep", type=Path, default=None)
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    res = run(args.requests, args.gpus, args.batch, args.repeats, args.step_ms, cases, args.keep)
    out = bc.write_result("capacity", res)
    for case, c in res["cases"].items():
        m = c["median"]
        print(f"{case} ({c['sglang_version']}): full-batch share, worst GPU: regen "
              f"{m['full_batch_share_min']['regen']:.1%}, old {m['full_batch_share_min']['old']:.1%}; mean fill "
              f"{m['mean_fill']['regen']:.1%} vs {m['mean_fill']['old']:.1%}; wall {m['wall_s']['regen']:.1f} s vs "
              f"{m['wall_s']['old']:.1f} s")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
