"""Elastic [slurm] runs and the faults not tried elsewhere, on the real Slurm test cluster (tests/slurm_fixtures.py):
a group that starts when a node frees up serves at once and one taken away (scancel) leaves the run going on the
others; a job started by backfill in an idle window shorter than time_limit (time_min); a node failing under a
server that spans two nodes; `regen stop` after the supervisor was SIGKILLed while one job ran and one waited;
preemption in a partition with PreemptMode=CANCEL. Every run ends with every sample exactly once."""
from __future__ import annotations

import json
import os
import signal

import psutil
import pytest

from console.commands.status import render_status
from engine.api.status import RunStatus
from engine.config.load import dump_toml
from engine.config.schema import time_limit_seconds
from engine.placement.slurm.step import SUPERSEDED_FILE
from tests.slurm_fixtures import URGENT, own_cluster
from tests.test_engine_run import ctl, renderer_for, status, supervisors, wait_for  # noqa: F401  (fixtures)
from tests.test_slurm_run import (alert, cluster2, every_sample_once, host_of, job_of, require_netns,  # noqa: F401
                                  slurm_config)
from tests.waiting import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]
SIM = ("--sim-step-ms", "30", "--sim-output-mean", "100", "--max-running-requests", "4")


def groups(run_dir) -> dict:
    return (status(run_dir) or {}).get("slurm_groups") or {}


def done(run_dir) -> int:
    return ((status(run_dir) or {}).get("dispatch") or {}).get("done", 0)


def queue(cluster) -> dict[str, str]:
    """Job id -> state, of every job in the queue."""
    return dict(line.split() for line in cluster.run("squeue", "-h", "-o", "%i %T").stdout.splitlines())


def submitted(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "slurm" / "jobs.jsonl").read_text().splitlines()]


def status_text(run_dir) -> list[str]:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render_status(RunStatus.from_dict(status(run_dir)), console))
    return console.export_text().splitlines()


def test_an_elastic_group_serves_when_a_node_frees_up_and_one_taken_away_leaves_the_run_going(
        tmp_path, tiny_model_dir, cluster2, supervisors, renderer_for):
    """min_groups 1, max_groups 2, a job a node: n2 is held by someone else's job, so regen-1 waits while regen-0
    serves; the holder ends, regen-1 starts and its servers' answers are committed. Then someone else queues for n2
    and regen-1's job is cancelled: the run goes on on regen-0, regen-1's next job waits behind the other user's."""
    holder = cluster2.run("sbatch", "--parsable", "--nodelist=n2", "--exclusive", "--job-name=other-user",
                          "--wrap", "sleep 600").stdout.strip()
    wait_until(lambda: queue(cluster2).get(holder) == "RUNNING", 30, "the other user's job on n2")
    cfg = slurm_config(tmp_path, tiny_model_dir, prompts=300, nodes=1, min_groups=1, max_groups=2, sim=SIM,
                       pending_alert_s=3, extra_args=("--exclusive",))
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    wait_for(lambda: done(run_dir) >= 20, 120, "the first group's first samples", sup)
    jobs = {name: job_of(run_dir, name) for name in ("regen-0", "regen-1")}
    # whichever group Slurm placed on n1 serves; the other waits for n2
    [waiting] = [name for name, j in jobs.items() if j["state"] == "PENDING"]
    pending = jobs[waiting]
    assert pending["reason"] in ("Resources", "Priority"), pending
    assert groups(run_dir) == {"wanted": 2, "counted": 1, "granted": 1, "serving": 1, "pending": 1,
                               "below_since": None}
    assert "slurm groups: 1 granted (1 serving), 1 pending, 2 wanted; the plan counts on 1" in status_text(run_dir)
    # an elastic group waiting for nodes is the plan, not an alarm: no pending alert past pending_alert_s (3 s)
    assert groups(run_dir)["pending"] == 1 and not alert(run_dir, "has been PENDING")

    cluster2.run("scancel", holder)
    up = wait_for(lambda: (lambda h: h["job"] if h and h["state"] == "up" else None)(host_of(run_dir, waiting)),
                  60, f"{waiting} up on n2", sup)
    assert up["job_id"] == pending["job_id"] and up["nodes"] == "n2"
    # the rows say `router`, not which server answered: each of the new group's servers' own log says it answered
    # the router's requests (its own start-up warm-up comes from 127.0.0.1)
    group = int(waiting.rsplit("-", 1)[1])
    served = wait_for(lambda: (lambda n: n if len(n) == 2 and min(n.values()) >= 5 else None)(
        routed_answers(run_dir, group, up["job_id"])), 60, f"{waiting}'s servers answering the router", sup)
    assert groups(run_dir)["granted"] == 2 and groups(run_dir)["serving"] == 2, served

    # taken away: another user queues for n2 first, then the group's job is cancelled from outside
    other = cluster2.run("sbatch", "--parsable", "--nodelist=n2", "--exclusive", "--job-name=other-user",
                         "--wrap", "sleep 600").stdout.strip()
    wait_until(lambda: queue(cluster2).get(other) == "PENDING", 30, "the other user's job queued for n2")
    cluster2.run("scancel", up["job_id"])
    ended = wait_for(lambda: alert(run_dir, f"slurm job {up['job_id']} ({waiting}) ended: CANCELLED"), 30,
                     "the cancel's alert", sup)
    assert ended["severity"] == "error"
    at_cancel = done(run_dir)
    again = wait_for(lambda: (lambda j: j if j and j["job_id"] != up["job_id"] and j["state"] == "PENDING" else None)(
        job_of(run_dir, waiting)), 60, f"{waiting}'s next job waiting", sup)
    assert [j["group"] for j in submitted(run_dir)].count(group) == 2 and queue(cluster2)[other] == "RUNNING"
    wait_for(lambda: (lambda g: g.get("granted") == 1 and g.get("pending") == 1)(groups(run_dir)), 30,
             "one group granted and one pending again", sup)
    wait_for(lambda: done(run_dir) > at_cancel + 10, 60, "the run going on on the other group", sup)
    assert sup.wait(240) == 0, sup.log_text()[-4000:]
    every_sample_once(run_dir, cfg, renderer_for)
    # the run is over: regen's jobs left the queue, the other user's runs on
    wait_until(lambda: set(queue(cluster2)) == {other}, 30, "regen's jobs out of the queue")
    assert again["job_id"] not in queue(cluster2)


def routed_answers(run_dir, group: int, job_id: str) -> dict[str, int]:
    """Server -> the /generate requests it answered for the router, from its log in the job's dir."""
    out = {}
    for log in (run_dir / "slurm" / f"g{group}" / f"job-{job_id}" / "workers").glob("*/server.log"):
        out[log.parent.name] = sum('"POST /generate HTTP/1.1" 200' in line and "127.0.0.1" not in line
                                   for line in log.read_text(errors="replace").splitlines())
    return out


def test_time_min_lets_backfill_start_a_job_in_a_window_shorter_than_time_limit(tmp_path, tiny_model_dir, slurm,
                                                                               supervisors, renderer_for):
    """The node is reserved from 5 minutes on: a job asking for 10 minutes cannot start before the reservation, one
    with time_min 2 is started now with a shorter limit, and its servers serve the run."""
    slurm.run("scontrol", "create", "reservation", "reservationname=maintenance", "starttime=now+5minutes",
              "duration=30", "nodes=n1", "users=root", "flags=ignore_jobs")
    cfg = slurm_config(tmp_path, tiny_model_dir, prompts=60, nodes=1, time_limit="10", time_min="2", handover_s=30,
                       sim=SIM)
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    job = wait_for(lambda: (lambda j: j if j and j["state"] == "RUNNING" else None)(job_of(run_dir, "regen-0")), 60,
                   "the job started in the window", sup)
    shown = slurm.run("scontrol", "show", "job", "-o", job["job_id"]).stdout
    limit = time_limit_seconds(next(w.split("=", 1)[1] for w in shown.split() if w.startswith("TimeLimit=")))
    assert 120 <= limit <= 300, shown  # from time_min up to the reservation, not the 10 minutes asked
    assert "--time-min=2" in next(e for e in submitted_alerts(run_dir))["evidence"]
    assert sup.wait(120) == 0, sup.log_text()[-4000:]
    every_sample_once(run_dir, cfg, renderer_for)


def submitted_alerts(run_dir):
    from tests.test_slurm_run import events

    return (e for e in events(run_dir) if e["type"] == "alert" and " submitted for " in e["text"])


def test_regen_stop_after_a_sigkill_cancels_the_running_and_the_waiting_job_and_loses_nothing(
        tmp_path, tiny_model_dir, slurm, supervisors, renderer_for):
    """Two groups of 4 GPUs on a node of 4: one runs, the other waits. The supervisor is SIGKILLed; `regen stop`
    cancels both jobs by id (squeue empty), and the next start finishes the run with every sample exactly once."""
    from tests.test_multihost import regen_cli

    cfg = slurm_config(tmp_path, tiny_model_dir, prompts=100, nodes=1, max_groups=2, gpus_per_node=4, sim=SIM)
    run_dir = tmp_path / "run"
    run_toml = tmp_path / "slurm-run.toml"
    run_toml.write_text(dump_toml(cfg))
    started = regen_cli("start", "local", "--config", str(run_toml), timeout=240)
    assert started.returncode == 0, started.stderr
    wait_until(lambda: done(run_dir) >= 20, 120, "first samples")
    jobs = sorted((job_of(run_dir, name) for name in ("regen-0", "regen-1")), key=lambda j: j["state"] != "RUNNING")
    running, waiting = jobs  # whichever group Slurm placed first runs
    assert (running["state"], waiting["state"]) == ("RUNNING", "PENDING")
    pid = int((run_dir / "supervisor.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10,
               "the supervisor gone")
    assert queue(slurm) == {running["job_id"]: "RUNNING", waiting["job_id"]: "PENDING"}
    stopped = regen_cli("stop", "local", "--run-dir", str(run_dir))
    assert stopped.returncode == 0, stopped.stderr
    head, _, ids = stopped.stdout.strip().rpartition(": ")
    assert head == f"{run_dir}: no supervisor runs; cancelled the 2 slurm job(s) its supervisor left running", head
    assert sorted(ids.split(", ")) == sorted([running["job_id"], waiting["job_id"]])
    wait_until(lambda: not queue(slurm), 30, "squeue empty")
    sup = supervisors(run_dir).start()  # the frozen run.toml: the run resumes where the committed rows end
    assert sup.wait(240) == 0, sup.log_text()[-4000:]
    every_sample_once(run_dir, cfg, renderer_for)


@pytest.mark.slow
def test_preemption_with_preempt_mode_cancel_ends_the_job_and_the_next_one_takes_over(tmp_path, tiny_model_dir, slurm,
                                                                                      supervisors, renderer_for):
    """The partition's PreemptMode=CANCEL (the cluster's default is REQUEUE): an urgent job on the node ends regen's
    job PREEMPTED for good; one alert in Slurm's words, the group's next job is submitted and finishes the run."""
    slurm.run("scontrol", "update", "PartitionName=gpu", "PreemptMode=CANCEL")
    cfg = slurm_config(tmp_path, tiny_model_dir, prompts=120, nodes=1, sim=SIM)
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    wait_for(lambda: done(run_dir) >= 20, 120, "first samples", sup)
    first = job_of(run_dir, "regen-0")
    slurm.run("sbatch", "-p", URGENT, "--gres=gpu:4", "--job-name=urgent", "--wrap", "sleep 3")
    preempted = wait_for(lambda: alert(run_dir, f"slurm job {first['job_id']} (regen-0) ended: PREEMPTED"), 30,
                         "the PREEMPTED alert", sup)
    assert preempted["severity"] == "error" and not alert(run_dir, "was requeued")
    wait_for(lambda: (lambda h: h and h["state"] == "up" and h["job"]["job_id"] != first["job_id"])(
        host_of(run_dir, "regen-0")), 60, "regen-0 up on its next job", sup)
    assert sup.wait(240) == 0, sup.log_text()[-4000:]
    assert [j["job"] for j in submitted(run_dir)][0] == first["job_id"] and len(submitted(run_dir)) == 2
    every_sample_once(run_dir, cfg, renderer_for)


@pytest.fixture
def own_cluster3(tmp_path, monkeypatch):
    """Three nodes of the test's own: one of them loses its slurmd for good."""
    with own_cluster(tmp_path, monkeypatch, 3) as cluster:
        yield cluster


@pytest.mark.slow
def test_a_node_failing_under_a_two_node_server_requeues_its_job_onto_other_nodes(tmp_path, tiny_model_dir,
                                                                                 own_cluster3, supervisors,
                                                                                 renderer_for):
    """tp_size 4 on nodes of 2 GPUs: one server over two nodes. Rank 1's node stops answering (its slurmd killed):
    past SlurmdTimeout Slurm sets it down, kills the step on rank 0's node and requeues the job, which runs again on
    the two nodes left; the server is whole again there and the run ends with every sample exactly once."""
    require_netns(own_cluster3)
    cfg = slurm_config(tmp_path, tiny_model_dir, prompts=60, nodes=2, tp_size=4, sim=SIM)
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    wait_for(lambda: done(run_dir) >= 20, 120, "first samples", sup)
    # paused: a dead slurmd's job steps run on, and the server would finish the run before Slurm says the node failed
    assert ctl(run_dir, "pause", "--all").returncode == 0
    job = job_of(run_dir, "regen-0")
    rank1 = run_dir / "slurm" / "g0" / f"job-{job['job_id']}" / "rank1"
    rank1_node = json.loads((rank1 / "node.json").read_text())
    old_agent = int((rank1 / "agent.pid").read_text().split()[0])
    own_cluster3.kill_slurmd(rank1_node["node"])
    requeued = wait_for(lambda: alert(run_dir, f"slurm job {job['job_id']} (regen-0) was requeued (restart 1)"), 90,
                        "the requeue after the node failed", sup)
    assert requeued["severity"] == "error"
    assert alert(run_dir, "host regen-0 lost")
    again = wait_for(lambda: (lambda h: h["job"] if h and h["state"] == "up" and (run_dir / "slurm" / "g0" /
                                                                                 f"job-{job['job_id']}.r1").exists()
                              else None)(host_of(run_dir, "regen-0")), 90, "the server whole again", sup)
    assert rank1_node["node"] not in expand(again["nodes"]) and len(expand(again["nodes"])) == 2, again
    wait_for(lambda: ((status(run_dir) or {}).get("router") or {}).get("members"), 60, "the server in the router", sup)
    # the first life's rank 1 runs on where its slurmd died: it stopped itself once the job ran again, instead of
    # joining the new life's server (same head node, same dist-init port) in place of that life's own rank 1
    wait_until(lambda: not psutil.pid_exists(old_agent), 30, "the first life's rank-1 agent gone")
    assert "(Slurm requeued it): this life (restart 0) stops its servers" in (rank1 / SUPERSEDED_FILE).read_text()
    assert not alert(run_dir, "node rank 1 of the server of regen-0"), "the new life's rank 1 was refused"
    assert ctl(run_dir, "resume", "--all").returncode == 0
    assert sup.wait(240) == 0, sup.log_text()[-4000:]
    every_sample_once(run_dir, cfg, renderer_for)


def expand(nodes: str) -> list[str]:
    """`n[1,3]` / `n[1-2]` / `n1` as node names."""
    if "[" not in nodes:
        return [nodes]
    head, body = nodes.rstrip("]").split("[")
    out = []
    for part in body.split(","):
        low, _, high = part.partition("-")
        out += [f"{head}{i}" for i in range(int(low), int(high or low) + 1)]
    return out
