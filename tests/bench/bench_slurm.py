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

Elastic (`--mode elastic`, elastic_main): two nodes of one GPU, min_groups 1 / max_groups 2, n2 held by another
user's job until 25 s into the run: from its release to the new group's first request (queue wait, server load and
regen's part), and committed samples/s with one group and with two; every sample exactly once.

    python -m tests.bench.bench_slurm [--repeats 1] [--conversations 360] [--mode all|scaling|groups|elastic]
    python -m tests.bench.bench_slurm --mode elastic [--repeats 3] [--elastic-conversations 800]

`--mode all` (the default) runs scaling, groups and elastic in turn.
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


# -- elastic: a second node frees up mid-run ------------------------------------------------------------------------
ELASTIC_HOLD_S = 25.0  # the other user's job holds n2 this long after regen's first committed sample
ELASTIC_SIM = tuple(a for a in SCALE_SIM if a not in ("--log-level-http", "warning"))  # the servers log each request
COMMITTED_ROWS = re.compile(r"committed \S+: (\d+) rows, \d+ output tokens, at ([\d.]+)")
SERVER_TS = re.compile(r"^\[(?:regen )?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\]")


def server_log_times(log: Path, needle: str) -> list[float]:
    """Epoch seconds (SGLang's log has whole seconds) of a server log's lines containing `needle`."""
    from datetime import datetime

    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = SERVER_TS.match(line)
        if m and needle in line:
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp())
    return out


def rate_between(rows: list[tuple[float, int]], t0: float, t1: float) -> float:
    """Committed samples per second between two epochs (parts committed in the window)."""
    return sum(n for t, n in rows if t0 < t <= t1) / max(1e-6, t1 - t0)


def elastic_run(cluster, model: Path, prompts: Path, work: Path, conversations: int) -> dict:
    """min_groups 1, max_groups 2 on two nodes of one GPU, n2 held by another user's job until ELASTIC_HOLD_S after
    the first committed sample: when the waiting group's job ran (queue wait), when its server launched, loaded and joined the
    router, when the router first sent it a request; committed samples/s with one group and with two; every sample
    exactly once."""
    import json
    import subprocess

    from engine.config.load import config_from_dict, dump_toml
    from engine.text.render import sample_id
    from tests.test_engine_run import read_rows

    holder = cluster.run("sbatch", "--parsable", "--nodelist=n2", "--exclusive", "--job-name=other-user",
                         "--wrap", "sleep 3600").stdout.strip()
    run_dir = work / f"run-elastic-{time.monotonic_ns()}"
    cfg = slurm_config(run_dir, model, prompts, nodes=1, sim=ELASTIC_SIM, time_limit="10", handover_s=60)
    doc = tomllib.loads(dump_toml(cfg))
    doc["slurm"].update(min_groups=1, max_groups=2)
    cfg = config_from_dict(doc)
    seen: dict[str, float] = {}

    waiting: dict[str, str] = {}  # the group that waits for n2 (whichever Slurm did not place on n1): group, job

    def state_of(job: str) -> str:
        return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
                              env=cluster.env).stdout.strip()

    def watch(rd: Path) -> bool:  # polled by run_supervisor every 50 ms: frees n2, then notes when its job runs
        now = time.time()
        if "first_commit" not in seen and "committed shards/" in (rd / "supervisor.log").read_text(errors="replace"):
            seen["first_commit"] = now
        if "first_commit" in seen and "freed" not in seen and now - seen["first_commit"] >= ELASTIC_HOLD_S:
            jobs = [json.loads(line) for line in (rd / "slurm" / "jobs.jsonl").read_text().splitlines()]
            [(group, job)] = [(str(j["group"]), str(j["job"])) for j in jobs if state_of(str(j["job"])) == "PENDING"]
            waiting.update(group=group, job=job)
            cluster.run("scancel", holder)
            seen["freed"] = time.time()
        if "freed" in seen and "running" not in seen and now - seen.get("polled", 0.0) >= 0.25:
            seen["polled"] = now
            if state_of(waiting["job"]) == "RUNNING":
                seen["running"] = time.time()
        return False

    run = bc.run_supervisor(cfg, timeout=900, stop_when=watch)
    if run.exit_code != 0:
        raise RuntimeError(f"elastic run exited {run.exit_code}: {(run_dir / 'supervisor.log').read_text()[-3000:]}")
    here = run_dir / "slurm" / f"g{waiting['group']}" / f"job-{waiting['job']}"
    [server_log] = list((here / "workers").glob("*/server.log"))
    name = f"regen-{waiting['group']}."
    ready = [t for t, line in run.lines if name in line and "-> ready" in line and "regen.hosts" in line][0]
    launched = server_log_times(server_log, "launching:")[0]
    loaded = server_log_times(server_log, "Uvicorn running on")[0]
    first_routed = next(t for t in server_log_times(server_log, '"POST /generate HTTP/1.1" 200')
                        if t >= int(ready))  # its own warm-up comes before it is ready
    node_written = (here / "node.json").stat().st_mtime
    committed = committed_rows(run_dir)
    one = rate_between(committed, seen["first_commit"] + 3, seen["freed"])
    two = rate_between(committed, ready + 3, share_reached(committed, 0.85))
    rows = read_rows(run_dir)
    ids = [r["sample_id"] for r in rows]
    expected = {sample_id(f"c{i:07d}", 0) for i in range(conversations)}
    wait, load = seen["running"] - seen["freed"], loaded - launched
    return {"conversations": conversations, "sim_args": list(ELASTIC_SIM), "hold_s": ELASTIC_HOLD_S,
            "queue_wait_s": wait, "job_running_to_step_s": node_written - seen["running"],
            "step_to_launch_s": launched - node_written, "server_load_s": load,
            "loaded_to_router_s": ready - loaded, "router_to_first_request_s": first_routed - ready,
            "freed_to_serving_s": first_routed - seen["freed"],
            "regen_part_s": (first_routed - seen["freed"]) - wait - load,
            "within_wait_load_10s": first_routed - seen["freed"] <= wait + load + 10,
            "samples_per_s_one_group": one, "samples_per_s_two_groups": two, "rate_ratio": two / max(1e-6, one),
            "samples": len(ids), "duplicates": len(ids) - len(set(ids)), "missing": len(expected - set(ids)),
            "wall_s": run.wall_s}


def both_free_run(model: Path, prompts: Path, work: Path) -> dict:
    """The baseline of elastic_run, in the same process: the same config with both nodes free from the start;
    committed samples/s from the second server's join to 85% of the samples."""
    from engine.config.load import config_from_dict, dump_toml

    run_dir = work / f"run-both-{time.monotonic_ns()}"
    doc = tomllib.loads(dump_toml(slurm_config(run_dir, model, prompts, nodes=1, sim=ELASTIC_SIM, time_limit="10",
                                               handover_s=60)))
    doc["slurm"].update(min_groups=1, max_groups=2)
    run = bc.run_supervisor(config_from_dict(doc), timeout=900)
    if run.exit_code != 0:
        raise RuntimeError(f"baseline run exited {run.exit_code}: {(run_dir / 'supervisor.log').read_text()[-3000:]}")
    ready = sorted(t for t, line in run.lines if "-> ready" in line and "regen.hosts" in line)
    committed = committed_rows(run_dir)
    return {"samples_per_s_two_groups": rate_between(committed, ready[1] + 3, share_reached(committed, 0.85)),
            "wall_s": run.wall_s}


def committed_rows(run_dir: Path) -> list[tuple[float, int]]:
    """(commit time, rows) of every part, from the committer's line for each."""
    return sorted((float(m.group(2)), int(m.group(1)))
                  for m in COMMITTED_ROWS.finditer((run_dir / "supervisor.log").read_text(errors="replace")))


def share_reached(committed: list[tuple[float, int]], share: float) -> float:
    """When the committed rows reached `share` of all (the tail after it fills fewer slots)."""
    total, done = sum(n for _, n in committed), 0
    for t, n in committed:
        done += n
        if done >= share * total:
            return t
    return committed[-1][0]


def elastic_main(args) -> int:
    """`--mode elastic`: elastic_run on a two-node cluster, `--repeats` times; medians and each run."""
    from tests.slurm_fixtures import start_slurm

    with tempfile.TemporaryDirectory(prefix="regen-bench-slurm-elastic-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        model = bc.tiny_model()
        prompts = bc.write_prompts(work / "prompts.jsonl", args.elastic_conversations, words=30)
        cluster = start_slurm(work / "slurm", 2, gpus_per_node=1)
        os.environ["SLURM_CONF"] = str(cluster.conf)
        try:
            runs, baselines = [], []
            for _ in range(args.repeats):  # each elastic run beside its baseline: both nodes free from the start
                for out, run in ((runs, lambda: elastic_run(cluster, model, prompts, work, args.elastic_conversations)),
                                 (baselines, lambda: both_free_run(model, prompts, work))):
                    out.append(run())
                    if why := cluster.reset():
                        raise RuntimeError(f"the cluster could not be reset between runs: {why}")
        finally:
            cluster.close()
    for r, b in zip(runs, baselines):
        r["baseline_samples_per_s_two_groups"] = b["samples_per_s_two_groups"]
        r["two_groups_vs_baseline"] = r["samples_per_s_two_groups"] / max(1e-6, b["samples_per_s_two_groups"])
    med = {k: statistics.median(r[k] for r in runs) for k in (
        "queue_wait_s", "server_load_s", "freed_to_serving_s", "regen_part_s", "samples_per_s_one_group",
        "samples_per_s_two_groups", "rate_ratio", "baseline_samples_per_s_two_groups", "two_groups_vs_baseline")}
    res = {"benchmark": "slurm-elastic", "mode": cluster.mode, "repeats": args.repeats, "medians": med, "runs": runs,
           "baselines": baselines, "machine": bc.machine()}
    out = bc.write_result("slurm_elastic", res)
    ok = all(r["within_wait_load_10s"] and not r["duplicates"] and not r["missing"] for r in runs)
    print(f"slurm elastic ({cluster.mode}): n2 freed -> its GPU serving in {med['freed_to_serving_s']:.1f} s "
          f"(queue wait {med['queue_wait_s']:.1f} s + server load {med['server_load_s']:.1f} s + regen "
          f"{med['regen_part_s']:.1f} s); {med['samples_per_s_one_group']:.1f} -> "
          f"{med['samples_per_s_two_groups']:.1f} samples/s with 1 -> 2 GPUs (x{med['rate_ratio']:.2f}; both nodes "
          f"free from the start: {med['baseline_samples_per_s_two_groups']:.1f}, x"
          f"{med['two_groups_vs_baseline']:.2f} of it); "
          f"{'every run within wait + load + 10 s, each sample once' if ok else 'NOT MET'}; wrote {out}")
    return 0 if ok else 1


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
    ap.add_argument("--elastic-conversations", type=int, default=800)
    ap.add_argument("--mode", choices=("all", "scaling", "groups", "elastic"), default="all",
                    help="groups: two groups' overlapping hand-overs; elastic: a second node frees up mid-run")
    args = ap.parse_args(argv)
    if slurm_missing():
        print(f"bench_slurm: Slurm is not installed (missing: {slurm_missing()}); apt-get install slurm-wlm munge",
              file=sys.stderr)
        return 2
    if args.mode == "elastic":
        return elastic_main(args)
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
    rc = report_groups(groups, write=False) if groups else 0
    return max(rc, elastic_main(args)) if args.mode == "all" else rc


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
