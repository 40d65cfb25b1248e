"""A [slurm] run against the real Slurm test cluster (tests/slurm_fixtures.py): the supervisor and the router stay
here (the login node); each server group is a Slurm job whose step runs regen's host agent on its node (a network
namespace). Every sample exactly once (sample ids against the input), the jobs visible in `status`, and stopping
cancels what regen submitted and nothing else."""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import tomllib

import psutil
import pytest

from engine.config.load import Router, Slurm, config_from_dict, dump_toml
from tests.slurm_fixtures import URGENT, lent_cluster, own_cluster
from console.commands.demo import free_port_block
from tests.sshd_fixtures import free_port
from tests.waiting import wait_until
from tests.test_notify import notify_table, receiver  # noqa: F401  (fixture)
from tests.test_tuning_config import pilot_record
from tests.test_engine_run import (ctl, expected_samples, make_config, read_rows, renderer_for, status,  # noqa: F401
                                   supervisors, wait_for)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]


@pytest.fixture
def cluster2(request, shared_slurm, monkeypatch):
    """Two nodes (or `request.param` nodes, through indirect parametrization), each a network namespace: the
    session's cluster of that many nodes, reset after the test."""
    with lent_cluster(shared_slurm, getattr(request, "param", 2), monkeypatch) as cluster:
        yield cluster


@pytest.fixture
def own_cluster2(tmp_path, monkeypatch):
    """Two nodes of the test's own, for a test that breaks one for good (a killed slurmd)."""
    with own_cluster(tmp_path, monkeypatch, 2) as cluster:
        yield cluster


def slurm_config(tmp_path, tiny_model_dir, *, prompts: int, sim: tuple = (), tp_size: int = 1, **slurm):
    cfg = make_config(tmp_path / "run", tiny_model_dir, prompts=prompts, sim=sim)
    cfg = cfg.model_copy(update=dict(
        slurm=Slurm(**{"partition": "gpu", "nodes": 2, "gpus_per_node": 2, "time_limit": "10", "handover_s": 60,
                       **slurm}),
        router=Router(policy="round_robin", port=free_port(), prometheus_port=free_port(), python=sys.executable,
                      host_lost_after_s=4.0)))
    doc = tomllib.loads(dump_toml(cfg))
    doc["workers"].pop("gpus")  # derived from [slurm] gpus_per_node
    # free here too: a one-node cluster's servers are on this machine's loopback, beside other tests' simulators
    doc["workers"]["base_port"] = free_port_block(8)
    doc["workers"]["tp_size"] = tp_size
    return config_from_dict(doc)


@pytest.mark.parametrize("cluster2", [2, 3], indirect=True, ids=["2-nodes", "3-nodes"])
def test_a_run_across_slurm_nodes_every_sample_once(tmp_path, tiny_model_dir, cluster2, supervisors, renderer_for):
    n = len(cluster2.nodes)
    cfg = slurm_config(tmp_path, tiny_model_dir, prompts=120, nodes=n, extra_args=("--exclusive",))  # a job a node
    run_dir = tmp_path / "run"
    pilot_record(cfg, 0.3)  # `regen plan --pilot` chose 0.3: every group's job launches its servers with it
    sup = supervisors(run_dir).start(cfg)
    st = wait_for(lambda: (lambda s: s if s and len((s.get("router") or {}).get("members", [])) == 2 * n else None)(
        status(run_dir)), 120, "two servers per node in the router", sup)
    jobs = {h["name"]: h["job"] for h in st["hosts"]}
    assert set(jobs) == {f"regen-{g}" for g in range(n)} and {j["state"] for j in jobs.values()} == {"RUNNING"}
    assert sorted(j["nodes"] for j in jobs.values()) == [f"n{i}" for i in range(1, n + 1)]
    # the servers are in the router: admitted on their agents' records, which carry the value each launch runs with
    assert {(w["conservativeness"], w["conservativeness_source"]) for w in st["workers"]} == {(0.3, "pilot")}
    for name, job in jobs.items():
        here = run_dir / "slurm" / f"g{name.rpartition('-')[2]}" / f"job-{job['job_id']}"
        launches = [line for log in here.glob("workers/*/server.log") for line in log.read_text().splitlines()
                    if "launching:" in line]
        assert len(launches) == 2 and all("--schedule-conservativeness 0.3" in line for line in launches), launches
    assert sup.wait(180) == 0, sup.log_text()[-4000:]
    rows = read_rows(run_dir)
    expected, _ = expected_samples(cfg, renderer_for(cfg))
    ids = [r["sample_id"] for r in rows]
    rejects = [json.loads(line) for line in (run_dir / "rejects.jsonl").read_text().splitlines()]
    rejected = {r["excerpt"] for r in rejects if r["reason"].startswith("turn ")}  # a turn refused: its sample id
    assert len(ids) == len(set(ids)), "a sample was written twice"
    assert set(ids) | rejected == expected and not set(ids) & rejected, "a sample was lost"
    # the run is over: the jobs regen submitted are cancelled, nothing else of the cluster's is touched
    submitted = [json.loads(line)["job"] for line in (run_dir / "slurm" / "jobs.jsonl").read_text().splitlines()]
    assert sorted(submitted) == sorted(j["job_id"] for j in jobs.values())
    wait_for(lambda: not cluster2.run("squeue", "-h", "-o", "%i").stdout.strip(), 30, "the jobs to leave the queue")


def events(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]


def alert(run_dir, words: str) -> dict | None:
    return next((e for e in events(run_dir) if e["type"] == "alert" and words in e["text"]), None)


def every_sample_once(run_dir, cfg, renderer_for) -> None:
    rows = read_rows(run_dir)
    expected, _ = expected_samples(cfg, renderer_for(cfg))
    ids = [r["sample_id"] for r in rows]
    rejects = [json.loads(line) for line in (run_dir / "rejects.jsonl").read_text().splitlines()]
    rejected = {r["excerpt"] for r in rejects if r["reason"].startswith("turn ")}
    assert len(ids) == len(set(ids)), "a sample was written twice"
    assert set(ids) | rejected == expected and not set(ids) & rejected, "a sample was lost"


def host_of(run_dir, name: str) -> dict | None:
    st = status(run_dir) or {}
    return next((h for h in st.get("hosts") or [] if h["name"] == name), None)


def job_of(run_dir, name: str) -> dict | None:
    st = status(run_dir) or {}
    return next((h.get("job") for h in st.get("hosts") or [] if h["name"] == name), None)


def test_a_pending_job_says_why_and_stop_cancels_only_what_regen_submitted(tmp_path, tiny_model_dir, slurm,
                                                                            supervisors, receiver):
    # every GPU of the node held by a job regen did not submit, until the test cancels it
    holder = slurm.run("sbatch", "--parsable", "--gres=gpu:4", "--wrap", "sleep 600").stdout.strip()
    hook = receiver()
    cfg = slurm_config(tmp_path, tiny_model_dir, prompts=200, nodes=1, sim=("--sim-step-ms", "40"), pending_alert_s=4)
    cfg = cfg.model_copy(update={"notify": notify_table(hook.url())})  # min_severity: critical, the default
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    pending = wait_for(lambda: (lambda j: j if j and j["state"] == "PENDING" and j["reason"] == "Resources" else None)(
        job_of(run_dir, "regen-0")), 60, "regen's job pending for Resources", sup)
    job_id = pending["job_id"]
    host = next(h for h in status(run_dir)["hosts"] if h["name"] == "regen-0")
    assert host["error"] == f"slurm job {job_id} PENDING (Resources)"
    assert alert(run_dir, f"slurm job {job_id} (regen-0) is pending: Resources")["severity"] == "warning"
    # past [slurm] pending_alert_s: one notification naming the job and Slurm's reason, then one when it starts
    waited = hook.wait(lambda bs: next((b for b in bs if b["key"] == f"slurm-pending-long:regen-0:{job_id}"), None),
                       30, "the pending job's notification")
    assert waited["text"].startswith(f"slurm job {job_id} (regen-0) has been PENDING for ")
    assert waited["text"].endswith(": Resources") and "pending_alert_s = 4" in waited["evidence"]
    assert (job_of(run_dir, "regen-0") or {}).get("waiting_since")
    slurm.run("scancel", holder)
    started = hook.wait(lambda bs: next((b for b in bs if b["key"] == f"slurm-started:regen-0:{job_id}"), None),
                        60, "the started job's notification")
    assert started["text"].startswith(f"slurm job {job_id} (regen-0) started on n1 after ")

    wait_for(lambda: (job_of(run_dir, "regen-0") or {}).get("state") == "RUNNING", 60, "regen's job running", sup)
    bystander = slurm.run("sbatch", "--parsable", "--gres=gpu:2", "--wrap", "sleep 600").stdout.strip()
    wait_for(lambda: ((status(run_dir) or {}).get("dispatch") or {}).get("done", 0) >= 20, 90, "samples from the job", sup)
    assert ctl(run_dir, "stop").returncode == 0
    assert sup.wait(60) == 0, sup.log_text()[-3000:]
    queue = wait_for(lambda: (lambda q: q if pending["job_id"] not in q else None)(
        slurm.run("squeue", "-h", "-o", "%i %T").stdout), 30, "regen's job to leave the queue")
    assert queue.split() == [bystander, "RUNNING"]  # the job regen did not submit runs on
    rows = read_rows(run_dir)
    assert len({r["sample_id"] for r in rows}) == len(rows) >= 20
    sent = [b["key"].split(":")[0] for b in hook.bodies() if b["kind"] == "alert"]
    assert sent == ["slurm-pending-long", "slurm-started"], sent  # a stop cancels quietly: no `ended` for it


@pytest.mark.slow
def test_a_job_cancelled_from_outside_and_a_node_set_down_are_survived(tmp_path, tiny_model_dir, cluster2,
                                                                        supervisors, renderer_for):
    cfg = slurm_config(tmp_path, tiny_model_dir, prompts=300, extra_args=("--exclusive",),
                       sim=("--sim-step-ms", "50", "--sim-output-mean", "200", "--max-running-requests", "4"))
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    wait_for(lambda: ((status(run_dir) or {}).get("dispatch") or {}).get("done", 0) >= 30, 120, "first samples", sup)
    first = job_of(run_dir, "regen-1")
    cluster2.run("scancel", first["job_id"])
    ended = wait_for(lambda: alert(run_dir, f"slurm job {first['job_id']} (regen-1) ended: CANCELLED"), 30,
                     "the cancel alert", sup)
    assert ended["severity"] == "error" and f"job {first['job_id']} CANCELLED" in ended["evidence"]
    assert wait_for(lambda: alert(run_dir, "host regen-1 lost"), 30, "the host-lost alert", sup)
    second = wait_for(lambda: (lambda h: h["job"] if h and h["state"] == "up" and h["job"]["job_id"] != first["job_id"]
                               else None)(host_of(run_dir, "regen-1")), 60, "regen-1 up again on its next job", sup)

    node = second["nodes"]
    cluster2.run("scontrol", "update", f"nodename={node}", "state=down", "reason=regen-test")
    gone = wait_for(lambda: alert(run_dir, f"slurm job {second['job_id']} (regen-1) was requeued"), 60,
                    "the alert for the job on the downed node", sup)
    assert f"job {second['job_id']} PENDING" in gone["evidence"]
    cluster2.run("scontrol", "update", f"nodename={node}", "state=resume")
    assert sup.wait(240) == 0, sup.log_text()[-4000:]
    every_sample_once(run_dir, cfg, renderer_for)
    final = [e for e in events(run_dir) if e["type"] == "dispatch"][-1]
    assert final["failed"] == 0


COMMITTED = re.compile(r"committed \S+: (\d+) rows, \d+ output tokens, at ([\d.]+)")


def commit_times(run_dir) -> list[float]:
    """When each part was committed (the committer's line for it), in order."""
    text = (run_dir / "supervisor.log").read_text(errors="replace")
    return sorted(float(m.group(2)) for m in COMMITTED.finditer(text))


def handover_spans(run_dir) -> dict[str, list[tuple[float, float]]]:
    """Each group's hand-overs as (its old job drained from, that job ended), from the alerts: the switch onto the next
    job's servers (or the forced drain), then the old job's planned end."""
    spans: dict[str, list[tuple[float, float]]] = {}
    began: dict[str, float] = {}
    for e in events(run_dir):
        if e["type"] != "alert":
            continue
        m = re.match(r"slurm job (\d+) \((regen-\d+)\) (serves the group|is drained|ended as planned|reached its time "
                     r"limit as planned)", e["text"])
        if m is None:
            continue
        group, what = m.group(2), m.group(3)
        if what in ("serves the group", "is drained"):
            began.setdefault(group, e["ts"])
        elif group in began:
            spans.setdefault(group, []).append((began.pop(group), e["ts"]))
    return spans


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_two_groups_hand_over_in_turn_with_no_gap_in_commits(tmp_path, tiny_model_dir, cluster2, supervisors,
                                                              renderer_for):
    """time_limit 3 minutes, handover_s 30, two groups of 2 GPUs on nodes of 4 (a next job fits beside the old one):
    the groups' first limits are staggered (3 and 2 minutes); before each limit the next job is submitted, its
    servers are proven while the old ones serve, the group moves onto them, and the old job, drained, is cancelled.
    The committed count keeps rising through every hand-over, at most one group drains at a time, every hand-over
    alert is info (none says a host was lost), and every sample is written once."""
    cfg = slurm_config(tmp_path, tiny_model_dir, prompts=600, nodes=2, time_limit="3", handover_s=30,
                       sim=("--sim-step-ms", "100", "--sim-output-mean", "200", "--max-running-requests", "4"))
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    first = wait_for(lambda: (lambda hs: {h["name"]: h["job"]["job_id"] for h in hs} if len(hs) == 2 and all(
        h["state"] == "up" for h in hs) else None)((status(run_dir) or {}).get("hosts") or []), 90,
        "both groups serving", sup)
    limits = {name: cluster2.run("scontrol", "show", "job", "-o", job).stdout.split("TimeLimit=")[1].split()[0]
              for name, job in first.items()}
    assert limits == {"regen-0": "00:03:00", "regen-1": "00:02:00"}, limits
    done = lambda: ((status(run_dir) or {}).get("dispatch") or {}).get("done", 0)  # noqa: E731
    # regen-1's first hand-over: the count rises while its old job drains, before that job has ended
    switched = wait_for(lambda: alert(run_dir, f"; job {first['regen-1']} drains"), 150,
                        "regen-1 moved onto its next job", sup)
    at_switch = done()
    wait_for(lambda: done() >= at_switch + 10, 30, "commits during regen-1's hand-over", sup)
    assert switched["severity"] == "info"
    wait_for(lambda: alert(run_dir, f"; job {first['regen-0']} drains"), 150, "regen-0 moved onto its next job",
             sup)
    assert sup.wait(240) == 0, sup.log_text()[-4000:]
    every_sample_once(run_dir, cfg, renderer_for)

    said = [e for e in events(run_dir) if e["type"] == "alert"]
    assert not [e["text"] for e in said if " lost" in e["text"] or e["severity"] in ("error", "critical")], said
    planned = [e for e in said if e["key"].startswith(("slurm-handover:", "slurm-handed-over:"))]
    assert planned and {e["severity"] for e in planned} == {"info"}, planned
    spans = handover_spans(run_dir)
    assert set(spans) == {"regen-0", "regen-1"}, spans
    ordered = sorted(span for group in spans.values() for span in group)
    assert all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:])), f"two groups drained at once: {spans}"
    commits = commit_times(run_dir)
    gaps = [b - a for a, b in zip(commits, commits[1:])]
    assert max(gaps) < 15, f"the commits stalled for {max(gaps):.0f} s; hand-overs {spans}"


@pytest.mark.slow
def test_a_preempted_job_and_a_requeued_one_run_again_under_the_same_id(tmp_path, tiny_model_dir, slurm, supervisors,
                                                                         renderer_for):
    """A job in the `urgent` partition (higher tier, same node) preempts regen's: Slurm requeues it (PreemptMode
    REQUEUE: same id, PENDING BeginTime, restart count 1) and runs it again once the urgent job ends; then someone
    requeues it by hand (restart 2). Each is one alert in Slurm's words, each life runs in its own dir, and the run
    ends with every sample exactly once."""
    cfg = slurm_config(tmp_path, tiny_model_dir, prompts=120, nodes=1,  # ~40 samples left at the second requeue
                       sim=("--sim-step-ms", "30", "--sim-output-mean", "100", "--max-running-requests", "4"))
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    done = lambda: ((status(run_dir) or {}).get("dispatch") or {}).get("done", 0)  # noqa: E731
    wait_for(lambda: done() >= 20, 90, "first samples", sup)
    job = job_of(run_dir, "regen-0")["job_id"]
    urgent = slurm.run("sbatch", "--parsable", "-p", URGENT, "--gres=gpu:4", "--job-name=urgent", "--wrap",
                       "sleep 3").stdout.strip()
    preempted = wait_for(lambda: alert(run_dir, f"slurm job {job} (regen-0) was requeued (restart 1)"), 30,
                         "the preemption's alert", sup)
    assert f"job {job} PENDING (BeginTime)" in preempted["evidence"], preempted
    assert alert(run_dir, "host regen-0 lost")
    wait_for(lambda: (lambda h: h and h["state"] == "up" and h["job"]["job_id"] == job)(host_of(run_dir, "regen-0")),
             60, "regen-0 up again in its job's second life", sup)
    assert (run_dir / "slurm" / "g0" / f"job-{job}.r1" / "node.json").exists()
    assert slurm.run("scontrol", "show", "job", "-o", urgent).stdout.count("JobState=COMPLETED")
    before = done()
    wait_for(lambda: done() >= before + 5, 60, "samples from the second life", sup)
    slurm.run("scontrol", "requeue", job)
    requeued = wait_for(lambda: alert(run_dir, f"slurm job {job} (regen-0) was requeued (restart 2)"), 30,
                        "the requeue's alert", sup)
    assert requeued["severity"] == "error"
    assert sup.wait(240) == 0, sup.log_text()[-4000:]
    assert (run_dir / "slurm" / "g0" / f"job-{job}.r2" / "node.json").exists()
    assert [json.loads(line)["job"] for line in (run_dir / "slurm" / "jobs.jsonl").read_text().splitlines()] == [job]
    every_sample_once(run_dir, cfg, renderer_for)


@pytest.mark.slow
def test_jobs_that_may_not_be_requeued_end_preempted_and_node_fail_and_the_run_goes_on(tmp_path, tiny_model_dir,
                                                                                       own_cluster2, supervisors,
                                                                                       renderer_for):
    """Jobs submitted --no-requeue: an urgent job on the same node preempts the first (it ends PREEMPTED); the
    second one's node stops answering (its slurmd killed) and past SlurmdTimeout it ends NODE_FAIL. Each is one
    alert in Slurm's words, regen submits the next job each time, and the run ends on the third, every sample once."""
    require_netns(own_cluster2)  # on loopback every node is one address: the old node's servers would answer the new URLs
    # paused through both ends: the samples left after the resume only need to outlast nothing
    cfg = slurm_config(tmp_path, tiny_model_dir, prompts=100, nodes=1, extra_args=("--no-requeue",),
                       sim=("--sim-step-ms", "30", "--sim-output-mean", "100", "--max-running-requests", "4"))
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    wait_for(lambda: ((status(run_dir) or {}).get("dispatch") or {}).get("done", 0) >= 20, 120, "first samples", sup)
    # paused: a dead slurmd's job steps run on (its servers would finish the run before Slurm says NODE_FAIL)
    assert ctl(run_dir, "pause", "--all").returncode == 0
    first = job_of(run_dir, "regen-0")
    own_cluster2.run("sbatch", "-p", URGENT, f"--nodelist={first['nodes']}", "--gres=gpu:4", "--wrap", "sleep 3")
    preempted = wait_for(lambda: alert(run_dir, f"slurm job {first['job_id']} (regen-0) ended: PREEMPTED"), 30,
                         "the PREEMPTED alert", sup)
    assert preempted["severity"] == "error" and f"job {first['job_id']} PREEMPTED" in preempted["evidence"]

    up_on_a_new_job = lambda old: (lambda h: h["job"] if h and h["state"] == "up" and h["job"]["job_id"] != old  # noqa: E731
                                   else None)(host_of(run_dir, "regen-0"))
    second = wait_for(lambda: up_on_a_new_job(first["job_id"]), 60, "regen-0 up on its second job", sup)
    own_cluster2.kill_slurmd(second["nodes"])
    ended = wait_for(lambda: alert(run_dir, f"slurm job {second['job_id']} (regen-0) ended: NODE_FAIL"), 90,
                     "the NODE_FAIL alert", sup)
    assert ended["severity"] == "error" and f"job {second['job_id']} NODE_FAIL" in ended["evidence"], ended
    third = wait_for(lambda: up_on_a_new_job(second["job_id"]), 60, "regen-0 up on its third job", sup)
    assert third["nodes"] != second["nodes"]
    assert ctl(run_dir, "resume", "--all").returncode == 0
    assert sup.wait(240) == 0, sup.log_text()[-4000:]
    every_sample_once(run_dir, cfg, renderer_for)


def test_status_says_each_groups_job_as_squeue_does():
    from console.commands.status import job_text
    from engine.api.status import RunStatus

    doc = {"name": "regen-1", "address": "slurm partition gpu", "state": "connecting", "workers": [],
           "job": {"job_id": "4128", "state": "PENDING", "reason": "Resources", "nodes": "", "time_left": "12:00:00"}}
    running = {**doc, "name": "regen-0", "state": "up",
               "job": {"job_id": "4127", "state": "RUNNING", "reason": "None", "nodes": "gpu-a17",
                       "time_left": "11:41:07", "next_job": "4131"}}
    hosts = RunStatus.from_dict({"run_dir": "/r", "state": "running", "hosts": [running, doc]}).hosts
    assert [job_text(h) for h in hosts] == ["job 4127 RUNNING on gpu-a17, 11:41:07 left, next job 4131 queued",
                                            "job 4128 PENDING (Resources)"]
    hosts[1].job.waiting_since = 1000.0  # since when regen saw it wait: how long, as of the status's time
    assert job_text(hosts[1], 1754.0) == "job 4128 PENDING 12m34s (Resources)"


def test_regen_start_status_and_stop_from_the_command_line(tmp_path, tiny_model_dir, slurm):
    """The operator's commands on the login node: start (preflight with the slurm probes, then the supervisor),
    status --json with the group's job, status's text row, stop cancelling regen's job."""
    from tests.test_multihost import regen_cli

    cfg = slurm_config(tmp_path, tiny_model_dir, prompts=600, nodes=1,  # never done before the second kill
                       sim=("--sim-step-ms", "50", "--sim-output-mean", "200", "--max-running-requests", "4"))
    run_toml = tmp_path / "slurm-run.toml"
    run_toml.write_text(dump_toml(cfg))
    run_dir = str(tmp_path / "run")
    started = regen_cli("start", "local", "--config", str(run_toml), timeout=240)
    try:
        assert started.returncode == 0, started.stderr
        assert "preflight passed on local" in started.stderr
        shown = wait_until(lambda: (lambda r: json.loads(r.stdout) if r.returncode == 0 and '"RUNNING"' in r.stdout
                                    else None)(regen_cli("status", "local", "--run-dir", run_dir, "--json")),
                           90, "status --json with the job running")
        job = next(h for h in shown["hosts"] if h["name"] == "regen-0")["job"]
        assert job["state"] == "RUNNING" and job["nodes"] == "n1" and job["job_id"].isdigit()
        text = regen_cli("status", "local", "--run-dir", run_dir)
        assert f"job {job['job_id']} RUNNING on n1" in text.stdout, text.stdout
        # a supervisor killed outright leaves its job; the next start takes the run over and cancels it
        pid = int((tmp_path / "run" / "supervisor.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not psutil.pid_exists(pid), 10, "it to be gone")
        assert job["job_id"] in slurm.run("squeue", "-h", "-o", "%i").stdout.split()
        again = regen_cli("start", "local", "--config", str(run_toml), timeout=240)
        assert again.returncode == 0, again.stderr
        wait_until(lambda: job["job_id"] not in slurm.run("squeue", "-h", "-o", "%i").stdout.split(), 30,
                   "the left job cancelled")
        said = wait_until(lambda: next((json.loads(line) for line in (tmp_path / "run" / "telemetry.jsonl").read_text()
                                        .splitlines() if "an earlier supervisor" in line), None), 30, "the alert")
        assert said["text"] == f"cancelled 1 slurm job(s) an earlier supervisor of this run left running: {job['job_id']}"

        # killed again: `regen stop` itself cancels the job the supervisor left (its id from the run dir's
        # jobs.jsonl), and no other job on the cluster
        jobs_file = tmp_path / "run" / "slurm" / "jobs.jsonl"
        second = wait_until(lambda: (lambda ids: ids[-1] if len(ids) == 2 else None)(
            [json.loads(line)["job"] for line in jobs_file.read_text().splitlines()]), 60, "the second start's job")
        bystander = slurm.run("sbatch", "--parsable", "--job-name", "not-regen", "--gres=gpu:1", "--wrap",
                              "sleep 600").stdout.strip()
        wait_until(lambda: second in slurm.run("squeue", "-h", "-o", "%i").stdout.split(), 30, "it queued")
        pid = int((tmp_path / "run" / "supervisor.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not psutil.pid_exists(pid), 10, "it to be gone")
        stopped = regen_cli("stop", "local", "--run-dir", run_dir)
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.strip() == (f"{run_dir}: no supervisor runs; cancelled the 1 slurm job(s) its "
                                          f"supervisor left running: {second}")
        wait_until(lambda: second not in slurm.run("squeue", "-h", "-o", "%i").stdout.split(), 30,
                   "the left job cancelled")
        assert slurm.run("squeue", "-h", "-o", "%i %j").stdout.split() == [bystander, "not-regen"]
        told = [json.loads(line) for line in (tmp_path / "run" / "telemetry.jsonl").read_text().splitlines()
                if "regen stop: cancelled" in line]
        assert [t["severity"] for t in told] == ["warning"]
        again = regen_cli("stop", "local", "--run-dir", run_dir)  # nothing left: the plain no-supervisor answer
        assert again.returncode == 2 and "no supervisor runs in local:" in again.stderr, again.stderr
    finally:
        regen_cli("stop", "local", "--run-dir", run_dir)  # a failure above may have left a supervisor
    wait_until(lambda: "regen-0" not in slurm.run("squeue", "-h", "-o", "%j").stdout.split(), 30,
               "regen's jobs cancelled")


def require_netns(cluster) -> None:
    """A server's ranks each listen on the same --port on their own node: nodes that are one loopback cannot."""
    if cluster.mode != "netns":
        pytest.skip("a server across nodes needs nodes with addresses of their own (network namespaces)")


def spanning_server_dirs(run_dir, job_id: str):
    """Rank 0's and rank 1's agent dirs of group 0's job, and the server's name."""
    here = run_dir / "slurm" / "g0" / f"job-{job_id}"
    return here, here / "rank1", "regen-0.gpu0-1-2-3"


def test_one_server_across_two_slurm_nodes_every_sample_once(tmp_path, tiny_model_dir, cluster2, supervisors,
                                                             renderer_for):
    """tp_size 4 on nodes of 2 GPUs: one job of both nodes, each node's agent launching its rank; rank 0 is the one
    router member, rank 1 only joins it."""
    require_netns(cluster2)
    cfg = slurm_config(tmp_path, tiny_model_dir, prompts=60, nodes=2, tp_size=4)
    run_dir = tmp_path / "run"
    pilot_record(cfg, 0.3)  # both ranks start at the pilot's value: one scheduler's rules on every node
    sup = supervisors(run_dir).start(cfg)
    st = wait_for(lambda: (lambda s: s if s and (s.get("router") or {}).get("members") else None)(status(run_dir)),
                  120, "the server in the router", sup)
    [host] = st["hosts"]
    assert host["name"] == "regen-0" and host["job"]["nodes"] == "n[1-2]"
    assert len(st["router"]["members"]) == 1
    head, rank1, name = spanning_server_dirs(run_dir, host["job"]["job_id"])
    assert json.loads((rank1 / "node.json").read_text())["node_rank"] == 1
    line = next(x for x in (rank1 / "workers" / f"{name}.rank1" / "server.log").read_text().splitlines()
                if "launching:" in x)
    head_address = json.loads((head / "node.json").read_text())["address"]
    assert f"--tp-size 4 " in line and f"--nnodes 2 --node-rank 1 --dist-init-addr {head_address}:{cfg.workers.base_port + 1000}" in line
    head_line = next(x for x in (head / "workers" / name / "server.log").read_text().splitlines() if "launching:" in x)
    assert "--schedule-conservativeness 0.3" in line and "--schedule-conservativeness 0.3" in head_line
    assert sup.wait(180) == 0, sup.log_text()[-4000:]
    every_sample_once(run_dir, cfg, renderer_for)


@pytest.mark.slow
def test_a_two_node_server_losing_rank1_is_told_and_every_sample_once(tmp_path, tiny_model_dir, cluster2,
                                                                      supervisors, renderer_for):
    require_netns(cluster2)
    cfg = slurm_config(tmp_path, tiny_model_dir, prompts=200, nodes=2, tp_size=4,
                       sim=("--sim-step-ms", "30", "--sim-output-mean", "100", "--max-running-requests", "8"))
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    wait_for(lambda: ((status(run_dir) or {}).get("dispatch") or {}).get("done", 0) >= 20, 120, "first samples", sup)
    head, rank1, name = spanning_server_dirs(run_dir, job_of(run_dir, "regen-0")["job_id"])
    os.killpg(int((rank1 / "workers" / f"{name}.rank1" / "server.pid").read_text()), signal.SIGKILL)
    rank_told = wait_for(lambda: alert(run_dir, "node rank 1 of the server of regen-0 (job "), 30, "the rank's alert",
                         sup)
    assert f"node n2): worker {name}.rank1 crashed (signal 9)" in rank_told["text"], rank_told
    assert sup.wait(240) == 0, sup.log_text()[-4000:]
    every_sample_once(run_dir, cfg, renderer_for)
    # rank 0 ended with it, in NCCL's words naming the rank, and was launched again by its agent; the login node
    # tells that crash too, once, however fast the relaunch (the agent's crash count, not the record's state)
    head_log = (head / "workers" / name / "server.log").read_text()
    assert "(node rank 1, TP ranks 2-3)" in head_log and head_log.count("launching:") >= 2
    told = [e for e in events(run_dir) if e["type"] == "alert" and e["text"].startswith(f"worker {name} crashed on "
                                                                                         "host regen-0: ")]
    launches = head_log.count("launching:")
    assert len(told) in (launches - 1, launches), told  # a crash per relaunch (and one more at the run's end, if so)
