"""Slurm: output tokens/s over 1, 2 and 3 Slurm nodes, time from start to the first committed sample, and a run's
wall time across a forced time-limit hand-over against one uninterrupted allocation.

The real Slurm 22.05 of tests/slurm_fixtures.py (3 nodes as network namespaces, one simulated GPU each), the real
supervisor with [slurm] (one sbatch job per node, its srun step running regen's host agent), the router on the
login side. Scaling: the same prompts and the fixed-rate simulator of bench_multihost (max running 16, 40 ms decode
steps of 4 tokens, ~200-token answers); the rate is the output tokens committed after the last server joined the
router until 80% of all tokens are committed, over that time; ratio against the 1-node run of the same repeat.
Start to first sample: from spawning the supervisor to the first committed part (the committer's log line) (sbatch, the job starting, the
step's agent launching the server, its identity proof, the router, the first answers), on the 1-node runs.
Hand-over: one node, a workload of ~50 s; `--time=1` with handover_s = 30 against `--time=10` (no hand-over).

Groups (`--mode groups`): two groups (one simulated GPU each, on 2 nodes of 2 GPUs, so a next job fits beside the old
one) with `--time=2`, handover_s = 30, a workload long enough for >= 3 hand-overs per group, against the same workload
with `--time=10` (no hand-over) in the same process: committed samples per second in every 10 s window that overlaps a
hand-over (its next job submitted to its old job's end) against the steady rate of the run without hand-overs; each
hand-over's gap (the old servers' last answer to the new servers' first, from the servers' own access lines; negative:
they overlap) with its parts (queue wait, load, the switch, the old servers' drain, their job's cancel); Slurm's kill
lag (a 1-minute job's end past its limit, one job with no hand-over); and every sample exactly once.

    python -m tests.bench.bench_slurm [--repeats 1] [--conversations 360] [--mode all|scaling|groups]
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
                 handover_s: int, exclusive: bool = True, part_max_age_s: float = 5.0):
    from engine.config.load import (Alerts, Dispatch, Router, RunConfig, Sampling, SIMULATOR_LAUNCH, Slurm, Store,
                                    Workers, config_from_dict, dump_toml)
    from tests.sshd_fixtures import free_port

    cfg = RunConfig(
        run_dir=str(run_dir), model=str(model), prompts=(str(prompts),), host_python=sys.executable, turns="all",
        shard_size=100, context_length=4096, sampling=Sampling(max_new_tokens=1024),
        workers=Workers(launch=SIMULATOR_LAUNCH, extra_args=sim, ready_timeout_s=120.0, gpus=(0,)),
        dispatch=Dispatch(request_timeout_s=120.0), alerts=Alerts(disk_free_min_gb=0.5),
        slurm=Slurm(partition="gpu", nodes=nodes, gpus_per_node=1, time_limit=time_limit, handover_s=handover_s,
                    extra_args=("--exclusive",) if exclusive else ()),
        store=Store(part_max_age_s=part_max_age_s),
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


# ~4 answers/s per server (8 running, 40 ms steps of 4 tokens, ~200-token answers); the access lines kept: each
# answer's end, per server
GROUPS_SIM = ("--max-running-requests", "8", "--sim-step-ms", "40", "--sim-step-ms-per-req", "0",
              "--sim-tokens-per-step", "4", "--sim-output-mean", "200", "--sim-output-sigma", "0.3",
              "--sim-load-s", "0.2")
WINDOW_S = 10.0
PART_AGE_S = 0.5  # parts committed at least this often: a 10 s window's count is off by at most one part at each end
RAMP_S = 10.0  # after the last group's first server joins, the dispatcher fills it: not yet the steady state
ROWS = re.compile(r"committed \S+: (\d+) rows, \d+ output tokens, at ([\d.]+)")
ANSWER = re.compile(r'^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] INFO: +(\S+) - "POST /generate HTTP/1.1" 200')
SUBMITTED = re.compile(r"slurm job (\d+) \((regen-\d+)\) has \S+ left: job (\d+) submitted to take over")
SWITCHED = re.compile(r"slurm job (\d+) \((regen-\d+)\) serves the group: .*; job (\d+) drains")
ENDED = re.compile(r"slurm job (\d+) \((regen-\d+)\) (ended as planned|reached its time limit as planned)")


def rows_of(run_dir: Path) -> list[tuple[float, int]]:
    text = (run_dir / "supervisor.log").read_text(errors="replace")
    return sorted((float(m.group(2)), int(m.group(1))) for m in ROWS.finditer(text))


def answers_of(job_dir: Path) -> list[float]:
    """When each answer of a job's servers ended (their access lines, to the second); the simulator's own warm-up
    request (from 127.0.0.1:0) left out."""
    out = []
    for log in job_dir.glob("workers/*/server.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = ANSWER.match(line)
            if m and m.group(2) != "127.0.0.1:0":
                out.append(time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")))
    return sorted(out)


def handovers_of(run_dir: Path) -> list[dict]:
    """Each hand-over of the run with its times (epoch s) and its gap's parts, from the alerts, the supervisor's log
    and the servers' access lines."""
    import json

    alerts = [e for e in map(json.loads, (run_dir / "telemetry.jsonl").read_text().splitlines())
              if e["type"] == "alert"]
    log = (run_dir / "supervisor.log").read_text(errors="replace")
    out: dict[str, dict] = {}
    for e in alerts:
        if m := SUBMITTED.match(e["text"]):
            out[m.group(1)] = {"group": m.group(2), "old_job": m.group(1), "new_job": m.group(3), "submitted": e["ts"]}
        elif (m := SWITCHED.match(e["text"])) and m.group(3) in out:
            out[m.group(3)]["switched"] = e["ts"]
        elif (m := ENDED.match(e["text"])) and m.group(1) in out:
            out[m.group(1)]["old_job_ended"] = e["ts"]
    done = []
    for h in out.values():
        if "switched" not in h or "old_job_ended" not in h:
            continue  # the run ended first
        g = int(h["group"].split("-")[1])
        old, new = answers_of(run_dir / "slurm" / f"g{g}" / f"job-{h['old_job']}"), answers_of(
            run_dir / "slurm" / f"g{g}" / f"job-{h['new_job']}")
        queue = re.search(rf"next job {h['new_job']} running on \S+, ([\d.]+) s after its submission", log)
        load = re.search(rf"next job {h['new_job']}'s servers proven ([\d.]+) s after its start", log)
        h.update(last_old_answer=old[-1] if old else None, first_new_answer=new[0] if new else None,
                 queue_wait_s=float(queue.group(1)) if queue else None, load_s=float(load.group(1)) if load else None)
        if old and new:
            h["gap_s"] = new[0] - old[-1]  # negative: the new servers answered before the old ones' last answer
            h["parts"] = {"submit_to_switch_s": h["switched"] - h["submitted"],
                          "switch_to_first_new_answer_s": new[0] - h["switched"],
                          "switch_to_last_old_answer_s": old[-1] - h["switched"],
                          "last_old_answer_to_old_job_end_s": h["old_job_ended"] - old[-1]}
        done.append(h)
    return sorted(done, key=lambda h: h["submitted"])


def steady_span(run_dir: Path, groups: int) -> tuple[float, float, list[tuple[float, int]]]:
    """From RAMP_S after every group first had a server ready to STEADY_SHARE of the rows committed, and the
    commits."""
    ready: dict[str, float] = {}
    for t, line in bc.supervisor_lines(run_dir):
        m = re.search(r"worker (regen-\d+)\.\S+: \S+ -> ready", line)
        if m:
            ready.setdefault(m.group(1), t)
    rows = rows_of(run_dir)
    total, done, t_end = sum(n for _, n in rows), 0, rows[-1][0]
    for t, n in rows:
        done += n
        if done >= STEADY_SHARE * total:
            t_end = t
            break
    return (max(ready.values()) if len(ready) >= groups else rows[0][0]) + RAMP_S, t_end, rows


def exactly_once(run_dir: Path, prompts: Path) -> dict:
    """Every input row's sample committed once (single-turn rows: one sample each)."""
    import json

    from engine.text.render import sample_id
    from tests.test_engine_run import read_rows

    expected = {sample_id(json.loads(line)["id"], 0) for line in prompts.read_text().splitlines()}
    ids = [r["sample_id"] for r in read_rows(run_dir)]
    return {"rows": len(ids), "duplicates": len(ids) - len(set(ids)), "missing": len(expected - set(ids)),
            "unexpected": len(set(ids) - expected)}


def kill_lag(cluster) -> dict:
    """A 1-minute job that outlives its limit (`sleep`): when Slurm ends it, past its start + 60 s (squeue polled
    every 0.2 s; its start from scontrol, to the second)."""
    job = cluster.run("sbatch", "--parsable", "--time=1", "--wrap", "sleep 600").stdout.strip()
    start = None
    while True:
        out = cluster.run("scontrol", "show", "job", "-o", job).stdout
        state = out.split("JobState=")[1].split()[0]
        if start is None and state == "RUNNING":
            start = time.mktime(time.strptime(out.split("StartTime=")[1].split()[0], "%Y-%m-%dT%H:%M:%S"))
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return {"job": job, "state": state, "ended_after_s": time.time() - start,
                    "past_limit_s": time.time() - start - 60}
        time.sleep(0.2)


def groups_run(model: Path, prompts: Path, work: Path, time_limit: str) -> dict:
    run_dir = work / f"run-groups-{time_limit}-{time.monotonic_ns()}"
    cfg = slurm_config(run_dir, model, prompts, nodes=2, sim=GROUPS_SIM, time_limit=time_limit, handover_s=30,
                       exclusive=False, part_max_age_s=PART_AGE_S)
    run = bc.run_supervisor(cfg, timeout=900)
    if run.exit_code != 0:
        raise RuntimeError(f"the run exited {run.exit_code}: {(run_dir / 'supervisor.log').read_text()[-3000:]}")
    t0, t1, rows = steady_span(run_dir, 2)
    steady = sum(n for t, n in rows if t0 <= t < t1) / max(1e-6, t1 - t0)
    hand = handovers_of(run_dir)
    spans = [(h["submitted"], h["old_job_ended"]) for h in hand]
    windows = []
    t = t0
    while t + WINDOW_S <= t1:
        n = sum(k for tc, k in rows if t <= tc < t + WINDOW_S)
        windows.append([round(t - t0, 1), round(n / WINDOW_S, 2), any(a < t + WINDOW_S and b > t for a, b in spans)])
        t += 1.0
    jobs = (run_dir / "slurm" / "jobs.jsonl").read_text().splitlines()
    return {"time_limit": time_limit, "wall_s": run.wall_s, "steady_samples_per_s": steady, "steady_span_s": t1 - t0,
            "jobs_submitted": len(jobs), "handovers": hand, "steady_from": t0,
            "windows_fields": ["start_s_after_steady_from", "samples_per_s", "overlaps_a_hand_over"], "windows": windows,
            "handovers_per_group": {g: sum(h["group"] == g for h in hand) for g in ("regen-0", "regen-1")},
            "exactly_once": exactly_once(run_dir, prompts),
            "errors": [e for e in map(__import__("json").loads, (run_dir / "telemetry.jsonl").read_text().splitlines())
                       if e["type"] == "alert" and e["severity"] in ("error", "critical")]}


def groups_mode(work: Path, model: Path, conversations: int) -> dict:
    """Two groups through >= 3 hand-overs each against the same workload without one (the steady rate)."""
    from tests.slurm_fixtures import start_slurm

    prompts = bc.write_prompts(work / "groups.jsonl", conversations, words=30)
    cluster = start_slurm(work / "slurm-groups", 2, gpus_per_node=2)
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        lag = kill_lag(cluster)
        whole = groups_run(model, prompts, work, "10")
        handed = groups_run(model, prompts, work, "2")
    finally:
        cluster.close()
    during = [rate for _, rate, hand_over in handed["windows"] if hand_over]
    steady = whole["steady_samples_per_s"]
    gaps = [h["gap_s"] for h in handed["handovers"] if "gap_s" in h]
    return {"mode": cluster.mode, "conversations": conversations, "sim_args": list(GROUPS_SIM), "kill_lag": lag,
            "uninterrupted": whole, "handed_over": handed, "steady_samples_per_s": steady,
            "windows_during_handovers": len(during),
            "min_window_ratio": min(during) / steady if during else None,
            "median_window_ratio": statistics.median(during) / steady if during else None,
            "windows_at_least_90pct": sum(r >= 0.9 * steady for r in during),
            "gap_s_max": max(gaps) if gaps else None, "gap_s_median": statistics.median(gaps) if gaps else None}


def main(argv: list[str] | None = None) -> int:
    from tests.slurm_fixtures import slurm_missing, start_slurm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--conversations", type=int, default=360)
    ap.add_argument("--handover-conversations", type=int, default=80)
    ap.add_argument("--groups-conversations", type=int, default=1800)
    ap.add_argument("--mode", choices=("all", "scaling", "groups"), default="all")
    args = ap.parse_args(argv)
    if slurm_missing():
        print(f"bench_slurm: Slurm is not installed (missing: {slurm_missing()}); apt-get install slurm-wlm munge",
              file=sys.stderr)
        return 2
    if args.mode == "groups":
        with tempfile.TemporaryDirectory(prefix="regen-bench-slurm-") as tmp:
            os.chmod(tmp, 0o755)
            res = groups_mode(Path(tmp), bc.tiny_model(), args.groups_conversations)
        return report_groups(res)
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
        groups = groups_mode(work, model, args.groups_conversations) if args.mode == "all" else None
    med = {n: statistics.median(r[n - 1]["tokens_per_s"] for r in runs) for n in (1, 2, 3)}
    ratios = {n: statistics.median(r[n - 1]["tokens_per_s"] / r[0]["tokens_per_s"] for r in runs) for n in (2, 3)}
    first = statistics.median(r[0]["start_to_first_commit_s"] for r in runs)
    res = {"benchmark": "slurm", "mode": cluster.mode, "repeats": args.repeats, "conversations": args.conversations,
           "sim_args": list(SCALE_SIM), "tokens_per_s_median": med, "scaling_ratio_median": ratios,
           "start_to_first_commit_s_median": first, "runs": runs,
           "handover": {"conversations": args.handover_conversations, "sim_args": list(HANDOVER_SIM),
                        "uninterrupted": whole, "time_limit_handover": handed,
                        "extra_wall_s": handed["wall_s"] - whole["wall_s"]},
           "groups": groups, "machine": bc.machine()}
    out = bc.write_result("slurm", res)
    print(f"slurm ({cluster.mode}): {med[1]:,.0f} / {med[2]:,.0f} / {med[3]:,.0f} tok/s on 1/2/3 nodes "
          f"(x{ratios[2]:.2f}, x{ratios[3]:.2f}); start to first committed sample {first:.1f} s; wall "
          f"{whole['wall_s']:.0f} s in one allocation vs {handed['wall_s']:.0f} s across a time-limit hand-over "
          f"({handed['jobs_submitted']} jobs); wrote {out}")
    return report_groups(groups, write=False) if groups else 0


def report_groups(res: dict, write: bool = True) -> int:
    out = bc.write_result("slurm_groups", {"benchmark": "slurm_groups", **res, "machine": bc.machine()}) if write else None
    h = res["handed_over"]
    print(f"slurm groups ({res['mode']}): steady {res['steady_samples_per_s']:.1f} samples/s without hand-overs; "
          f"{res['windows_during_handovers']} 10 s windows during hand-overs, the lowest at "
          f"{res['min_window_ratio']:.0%} of it (median {res['median_window_ratio']:.0%}), "
          f"{res['windows_at_least_90pct']} at >= 90%; wall {h['wall_s']:.0f} s against "
          f"{res['uninterrupted']['wall_s']:.0f} s without hand-overs; hand-overs per group "
          f"{h['handovers_per_group']}; gap (old servers' last answer to the new ones' first) median "
          f"{res['gap_s_median']:+.0f} s, max {res['gap_s_max']:+.0f} s; kill lag "
          f"{res['kill_lag']['past_limit_s']:.0f} s past a 1-minute limit; exactly once: {h['exactly_once']}"
          + (f"; wrote {out}" if out else ""))
    for x in h["handovers"]:
        print(f"  {x['group']} job {x['old_job']} -> {x['new_job']}: gap {x.get('gap_s', float('nan')):+.0f} s; "
              f"queue wait {x['queue_wait_s']} s, load {x['load_s']} s, parts {x.get('parts')}")
    ok = (h["exactly_once"]["duplicates"] == 0 and h["exactly_once"]["missing"] == 0 and not h["errors"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
