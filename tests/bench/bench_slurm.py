"""Slurm: output tokens/s over 1, 2 and 3 Slurm nodes, time from start to the first committed sample, and a run's
wall time across a forced time-limit hand-over against one uninterrupted allocation.

The real Slurm 22.05 of tests/slurm_fixtures.py (3 nodes as network namespaces, one simulated GPU each), the real
supervisor with [slurm] (one sbatch job per node, its srun step running regen's host agent), the router on the
login side. Scaling: the same prompts and the fixed-rate simulator of bench_multihost (max running 16, 40 ms decode
steps of 4 tokens, ~200-token answers); the rate is the output tokens committed after the last server joined the
router until 80% of all tokens are committed, over that time; ratio against the 1-node run of the same repeat.
Start to first sample: from spawning the supervisor to the first committed part (the committer's log line) (sbatch, the job starting, the
step's agent launching the server, its identity proof, the router, the first answers), on the 1-node runs.
Hand-over: one node, a workload of ~50 s; `--time=1` with handover_s = 30 (the servers drained half-way, the next
job queued behind the first, which Slurm ends at its limit) against `--time=10` (no hand-over).

    python -m tests.bench.bench_slurm [--repeats 1] [--conversations 360]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from tests.bench import bench_common as bc
from tests.bench.bench_multihost import SCALE_SIM, STEADY_SHARE

HANDOVER_SIM = ("--max-running-requests", "4", "--sim-step-ms", "50", "--sim-step-ms-per-req", "0",
                "--sim-tokens-per-step", "4", "--sim-output-mean", "200", "--sim-output-sigma", "0.3",
                "--sim-load-s", "0.2", "--log-level-http", "warning")


def slurm_config(run_dir: Path, model: Path, prompts: Path, *, nodes: int, sim: tuple, time_limit: str,
                 handover_s: int):
    from engine.config.load import (Alerts, Dispatch, Router, RunConfig, Sampling, SIMULATOR_LAUNCH, Slurm, Workers,
                               config_from_dict, dump_toml)
    from tests.sshd_fixtures import free_port

    cfg = RunConfig(
        run_dir=str(run_dir), model=str(model), prompts=(str(prompts),), host_python=sys.executable, turns="all",
        shard_size=100, context_length=4096, sampling=Sampling(max_new_tokens=1024),
        workers=Workers(launch=SIMULATOR_LAUNCH, extra_args=sim, ready_timeout_s=120.0, gpus=(0,)),
        dispatch=Dispatch(request_timeout_s=120.0), alerts=Alerts(disk_free_min_gb=0.5),
        slurm=Slurm(partition="gpu", nodes=nodes, gpus_per_node=1, time_limit=time_limit, handover_s=handover_s,
                    extra_args=("--exclusive",)),
        router=Router(policy="round_robin", port=free_port(), prometheus_port=free_port(), python=sys.executable))
    doc = tomllib.loads(dump_toml(cfg))
    doc["workers"]["base_port"] = 30000  # every node is its own network namespace
    return config_from_dict(doc)


COMMITTED = re.compile(r"committed \S+: \d+ rows, (\d+) output tokens, at ([\d.]+)")


def parts_of(run_dir: Path) -> list[tuple[float, int]]:
    """(commit time, output tokens) of every part, from the committer's line for each (state.sqlite keeps only the
    compacted shard once a shard is done)."""
    text = (run_dir / "supervisor.log").read_text(errors="replace")
    return sorted((float(m.group(2)), int(m.group(1))) for m in COMMITTED.finditer(text))


def one_run(cluster, n: int, model: Path, prompts: Path, work: Path, *, sim: tuple = SCALE_SIM,
            time_limit: str = "10", handover_s: int = 60) -> dict:
    run_dir = work / f"run-{n}n-{time_limit}-{time.monotonic_ns()}"
    cfg = slurm_config(run_dir, model, prompts, nodes=n, sim=sim, time_limit=time_limit, handover_s=handover_s)
    run = bc.run_supervisor(cfg, timeout=600)
    if run.exit_code != 0:
        raise RuntimeError(f"{n}-node run exited {run.exit_code}: {(run_dir / 'supervisor.log').read_text()[-3000:]}")
    ready = [t for t, line in bc.supervisor_lines(run_dir) if "-> ready" in line and "regen.hosts" in line]
    if len(ready) < n:
        raise RuntimeError(f"only {len(ready)} of {n} servers became ready")
    t_all = sorted(ready)[n - 1]
    parts = parts_of(run_dir)
    total = sum(tok for _, tok in parts)
    done, t_end, tokens = 0, None, 0
    for t, tok in parts:  # steady state, as bench_multihost: from the last join to STEADY_SHARE of the tokens
        done += tok
        if t >= t_all:
            tokens += tok
        if done >= STEADY_SHARE * total:
            t_end = t
            break
    jobs = (run_dir / "slurm" / "jobs.jsonl").read_text().splitlines()
    return {"nodes": n, "tokens_per_s": tokens / max(1e-6, t_end - t_all), "output_tokens": total,
            "window_s": t_end - t_all, "start_to_first_commit_s": parts[0][0] - run.started_at,
            "start_to_last_ready_s": t_all - run.started_at, "wall_s": run.wall_s, "jobs_submitted": len(jobs),
            "time_limit": time_limit, "handover_s": handover_s}


def main(argv: list[str] | None = None) -> int:
    from tests.slurm_fixtures import slurm_missing, start_slurm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--conversations", type=int, default=360)
    ap.add_argument("--handover-conversations", type=int, default=80)
    args = ap.parse_args(argv)
    if slurm_missing():
        print(f"bench_slurm: Slurm is not installed (missing: {slurm_missing()}); apt-get install slurm-wlm munge",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="regen-bench-slurm-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        model = bc.tiny_model()
        prompts = bc.write_prompts(work / "prompts.jsonl", args.conversations, words=30)
        short = bc.write_prompts(work / "handover.jsonl", args.handover_conversations, words=30)
        cluster = start_slurm(work / "slurm", 3, gpus_per_node=1)
        os.environ["SLURM_CONF"] = str(cluster.conf)
        try:
            runs = [[one_run(cluster, n, model, prompts, work) for n in (1, 2, 3)] for _ in range(args.repeats)]
            whole = one_run(cluster, 1, model, short, work, sim=HANDOVER_SIM, time_limit="10", handover_s=60)
            handed = one_run(cluster, 1, model, short, work, sim=HANDOVER_SIM, time_limit="1", handover_s=30)
        finally:
            cluster.close()
    med = {n: statistics.median(r[n - 1]["tokens_per_s"] for r in runs) for n in (1, 2, 3)}
    ratios = {n: statistics.median(r[n - 1]["tokens_per_s"] / r[0]["tokens_per_s"] for r in runs) for n in (2, 3)}
    first = statistics.median(r[0]["start_to_first_commit_s"] for r in runs)
    res = {"benchmark": "slurm", "mode": cluster.mode, "repeats": args.repeats, "conversations": args.conversations,
           "sim_args": list(SCALE_SIM), "tokens_per_s_median": med, "scaling_ratio_median": ratios,
           "start_to_first_commit_s_median": first, "runs": runs,
           "handover": {"conversations": args.handover_conversations, "sim_args": list(HANDOVER_SIM),
                        "uninterrupted": whole, "time_limit_handover": handed,
                        "extra_wall_s": handed["wall_s"] - whole["wall_s"]},
           "machine": bc.machine()}
    out = bc.write_result("slurm", res)
    print(f"slurm ({cluster.mode}): {med[1]:,.0f} / {med[2]:,.0f} / {med[3]:,.0f} tok/s on 1/2/3 nodes "
          f"(x{ratios[2]:.2f}, x{ratios[3]:.2f}); start to first committed sample {first:.1f} s; wall "
          f"{whole['wall_s']:.0f} s in one allocation vs {handed['wall_s']:.0f} s across a time-limit hand-over "
          f"({handed['jobs_submitted']} jobs); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
