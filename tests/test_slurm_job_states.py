"""How a [slurm] run reads what Slurm says of its jobs, without a cluster: squeue's and scontrol's lines (as the real
Slurm 22.05 of tests/slurm_fixtures.py printed them) to a job state, and what the login node's link does with each
end a job can come to (requeued under the same id, PREEMPTED, NODE_FAIL): one alert in Slurm's words, and the life
of a requeued job told apart from the last one."""
from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from engine.config.load import config_from_dict
from engine.placement.slurm import jobs as slurm_jobs
from engine.placement.slurm.jobs import JobState, parse_scontrol, parse_squeue
from engine.placement.slurm.link import SlurmLink
from engine.placement.slurm.step import job_dir
from engine.api.events import AlertEvent

# scontrol show job -o of a --no-requeue job a higher-priority partition preempted (cut to the fields read)
PREEMPTED = ("JobId=1 JobName=regen-0 JobState=PREEMPTED Reason=None Dependency=(null) Requeue=0 Restarts=0 "
             "BatchFlag=1 ExitCode=0:15 TimeLimit=10:00 PreemptTime=2026-12-05T22:29:22 NodeList=n1 BatchHost=n1")
NODE_FAIL = ("JobId=7 JobName=regen-0 JobState=NODE_FAIL Reason=NodeDown Dependency=(null) Requeue=0 Restarts=0 "
             "TimeLimit=10:00 NodeList=n2 BatchHost=n2")


def test_squeue_and_scontrol_lines_become_job_states():
    # squeue -O JobID:|,State:|,... before and after a preemption requeued the job (same id, restart count 1)
    assert parse_squeue("1", "1|RUNNING|None|n1|9:58|0|\n") == JobState("1", "RUNNING", "None", "n1", "9:58", 0)
    pending = parse_squeue("1", "1|PENDING|BeginTime||UNLIMITED|1|\n")
    assert pending == JobState("1", "PENDING", "BeginTime", "", "UNLIMITED", 1) and pending.active
    assert parse_squeue("2", "1|RUNNING|None|n1|9:58|0|\n") is None
    preempted = parse_scontrol("1", PREEMPTED)
    assert (preempted.state, preempted.nodes, preempted.restarts, preempted.active) == ("PREEMPTED", "n1", 0, False)
    assert preempted.words() == "job 1 PREEMPTED on n1"
    failed = parse_scontrol("7", NODE_FAIL)
    assert failed.words() == "job 7 NODE_FAIL (NodeDown) on n2" and not failed.active
    assert parse_scontrol("9", "slurm_load_jobs error: Invalid job id specified") is None


def test_each_life_of_a_requeued_job_has_a_dir_of_its_own(tmp_path):
    assert job_dir(tmp_path, 0, "41") == tmp_path / "g0" / "job-41"
    assert job_dir(tmp_path, 0, "41", 2) == tmp_path / "g0" / "job-41.r2"


def cfg(tmp_path: Path):
    return config_from_dict({"run_dir": str(tmp_path / "run"), "model": "/m", "prompts": ["p.jsonl"],
                             "slurm": {"partition": "gpu", "nodes": 1, "gpus_per_node": 1, "time_limit": "10"}})


class Scripted:
    """slurm_jobs.state answering from a script, one state per call (the last one repeated)."""

    def __init__(self, *states: JobState):
        self.states = list(states)

    async def __call__(self, job_id: str) -> JobState:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]


async def watched(tmp_path, monkeypatch, attached: JobState, *then: JobState) -> tuple[str, list[AlertEvent]]:
    """A link attached to `attached` whose job then goes through `then`: what _watch_job returns, and the alerts."""
    monkeypatch.setattr("engine.placement.slurm.link.POLL_S", 0.01)
    monkeypatch.setattr(slurm_jobs, "state", Scripted(*then))
    emitted: list = []
    async with aiohttp.ClientSession() as session:
        link = SlurmLink(cfg(tmp_path), 0, engine_root=Path("."), session=session, emit=emitted.append)
        link.job, link._life = attached, attached.restarts
        link._attached.add(attached.job_id)
        link.schedule.queue_waits, link.schedule.loads = [1.0], [1.0]  # measured: no hand-over due 9 min before the limit
        why = await asyncio.wait_for(link._watch_job(), 10)
    return why, [e for e in emitted if isinstance(e, AlertEvent)]


RUNNING = JobState("41", "RUNNING", "None", "n1", "9:00", 0)


@pytest.mark.parametrize("then, said, key", [
    # preempted in a REQUEUE partition, or `scontrol requeue`: the same id pending again, its restart count up
    ((JobState("41", "PENDING", "BeginTime", "", "10:00", 1),),
     "slurm job 41 (regen-0) was requeued (restart 1): PENDING (BeginTime); its servers are lost until Slurm runs "
     "it again", "slurm-requeue:regen-0:41:1"),
    # requeued and running again between two polls: the restart count says it is not the life the link attached to
    ((JobState("41", "RUNNING", "None", "n1", "10:00", 1),),
     "slurm job 41 (regen-0) was requeued (restart 1): RUNNING; its servers are lost until Slurm runs it again",
     "slurm-requeue:regen-0:41:1"),
    # preempted for good (a --no-requeue job, or PreemptMode=CANCEL)
    ((JobState("41", "COMPLETING", "None", "n1", "9:00", 0), parse_scontrol("41", PREEMPTED.replace("JobId=1", "JobId=41"))),
     "slurm job 41 (regen-0) ended: PREEMPTED", "slurm-end:regen-0:41"),
    # its node stopped answering (slurmd dead past SlurmdTimeout) and the job may not be requeued
    ((parse_scontrol("41", NODE_FAIL.replace("JobId=7", "JobId=41")),),
     "slurm job 41 (regen-0) ended: NODE_FAIL (NodeDown)", "slurm-end:regen-0:41"),
], ids=["requeued", "requeued-and-running-again", "preempted", "node-fail"])
async def test_a_job_that_ends_or_is_requeued_is_one_alert_in_slurms_words(tmp_path, monkeypatch, then, said, key):
    why, alerts = await watched(tmp_path, monkeypatch, RUNNING, RUNNING, *then)
    [alert] = alerts
    assert (alert.text, alert.key, alert.severity) == (said, key, "error")
    assert why == f"slurm {then[-1].words()}"
    assert then[-1].words() in alert.evidence


async def test_a_requeued_job_is_attached_to_in_its_new_life_not_at_the_last_ones_node(tmp_path):
    """The last life's node.json (its node, its servers' address) stays in job-<id>; the new life's step writes
    job-<id>.r1: until it does, the link waits rather than pointing the router at the old node."""
    async with aiohttp.ClientSession() as session:
        link = SlurmLink(cfg(tmp_path), 0, engine_root=Path("."), session=session, emit=lambda _: None)
        first = job_dir(link.slurm_dir, 0, "41")
        first.mkdir(parents=True)
        (first / "node.json").write_text('{"job": "41", "node": "n1", "address": "10.0.0.1", "gpus": "0"}')
        again = JobState("41", "RUNNING", "None", "n2", "10:00", 1)
        assert link._attach(again, 1.0) is None
        second = job_dir(link.slurm_dir, 0, "41", 1)
        second.mkdir(parents=True)
        (second / "node.json").write_text('{"job": "41", "restarts": 1, "node": "n2", "address": "10.0.0.2", "gpus": "0"}')
        assert link._attach(again, 1.0) == "slurm job 41 running on n2 (10.0.0.2), GPUs 0"
        assert link.host.work_dir == str(second) and link.members[0].url.startswith("http://10.0.0.2:")
        assert link._life == 1


def test_regen_stop_without_a_supervisor_says_when_slurm_cannot_be_asked(tmp_path):
    """The run's supervisor is gone and Slurm does not answer (here: an empty file at SLURM_CONF): `engine.ctl stop`
    exits 1 naming the jobs it could not cancel and Slurm's words, instead of a quiet 'no supervisor'."""
    import json
    import os
    import subprocess
    import sys

    from engine.config.load import dump_toml

    run_dir = tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    (run_dir / "run.toml").write_text(dump_toml(cfg(tmp_path)))
    (run_dir / "slurm" / "jobs.jsonl").write_text(json.dumps({"job": "12", "group": 0, "ts": 0}) + "\n")
    (tmp_path / "slurm.conf").write_text("")
    r = subprocess.run([sys.executable, "-m", "engine.ctl", "--run-dir", str(run_dir), "stop"], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, SLURM_CONF=str(tmp_path / "slurm.conf")))
    assert r.returncode == 1, r.stderr
    assert (f"no supervisor runs on {run_dir}; cancelling the slurm job(s) 12 its supervisor left failed: scontrol "
            "show job 12 (exit 1): scontrol: ") in r.stderr, r.stderr
    assert "Unable to process configuration file (is SLURM_CONF right, slurmctld reachable?)" in r.stderr
    said = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    assert [(e["severity"], e["key"]) for e in said] == [("error", "slurm-leftovers")]
