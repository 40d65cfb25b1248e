"""A [slurm] run's edges as the operator reads them, without a cluster: squeue's INVALID (a job past its limit, not
killed yet) is never shown; a job that left the queue is read from scontrol, then sacct (its accounting record), and
one no command knows is GONE with what each said; a finished run's allocations show each job's last state and
`ended`; and a group whose job is lost (NODE_FAIL ...) keeps no live figure of its servers."""
from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from rich.console import Console

from console.commands.status import job_text, render_status
from console.view.host_table import host_rows, job_cells
from console.view.model import RunModel
from engine.config.load import config_from_dict
from engine.placement.slurm import jobs as slurm_jobs
from engine.placement.slurm.ended import allocations_after
from engine.placement.slurm.jobs import JobState, parse_sacct, time_left_text
from engine.placement.slurm.link import SlurmLink, job_status, time_left_s
from engine.api.status import HostStatus, RunStatus, SlurmJobStatus
from engine.servers.metrics_client import ServerMetrics
from engine.api.wire import HostState, JobSource, WorkerState, pid_text


def cfg(tmp_path: Path, nodes: int = 1):
    return config_from_dict({"run_dir": str(tmp_path / "run"), "model": "/m", "prompts": ["p.jsonl"],
                             "slurm": {"partition": "gpu", "nodes": nodes, "gpus_per_node": 1, "time_limit": "10"}})


# -- time left ----------------------------------------------------------------------------------------------------
def test_squeues_invalid_is_past_its_limit_and_hands_over_at_once():
    assert time_left_text("INVALID") == "past its limit"
    assert time_left_text("47:48") == "47:48" and time_left_text("UNLIMITED") == "no limit"
    assert time_left_s("INVALID") == 0  # past the limit: a hand-over not made yet is made now
    assert time_left_s("9:58") == 598 and time_left_s("UNLIMITED") is None
    past = job_status(JobState("41", "RUNNING", "None", "n1", "INVALID"))
    assert (past.time_left, past.left_text(), past.ended) == ("past its limit", "past its limit", False)
    h = HostStatus(name="regen-0", address="slurm partition gpu", state="up", job=past)
    assert job_text(h) == "job 41 RUNNING on n1, past its limit"
    assert job_cells(h, None)[4] == "past its limit"
    assert "INVALID" not in job_text(h) + str(job_cells(h, None))
    running = job_status(JobState("41", "RUNNING", "None", "n1", "47:48"))
    assert job_text(HostStatus(name="regen-0", address="", state="up", job=running)) == "job 41 RUNNING on n1, 47:48 left"
    # a job not started has no time left to show (squeue's %L of it is its whole limit)
    assert job_status(JobState("42", "PENDING", "Resources", "", "10:00")).time_left == ""


# -- squeue, then scontrol, then sacct ------------------------------------------------------------------------------
def test_sacct_lines_become_job_states():
    assert parse_sacct("41", "41|CANCELLED by 0|None|n1\n") == JobState("41", "CANCELLED", "by 0", "n1", "", 0,
                                                                        JobSource.SACCT)
    failed = parse_sacct("41", "41|NODE_FAIL|NodeDown|n2\n")
    assert failed.words() == "job 41 NODE_FAIL (NodeDown) on n2" and not failed.active
    assert parse_sacct("41", "40|COMPLETED|None|n1\n") is None
    assert parse_sacct("41", "") is None


class FakeSlurm:
    """slurm_jobs.run answering each command from a table: (exit, stdout, stderr) by the command's name."""

    def __init__(self, **answers: tuple[int, str, str]):
        self.answers = answers
        self.asked: list[str] = []

    async def __call__(self, argv: list[str], timeout: float = 30.0) -> tuple[int, str, str]:
        self.asked.append(argv[0])
        if argv[0] not in self.answers:
            raise slurm_jobs.SlurmError(f"cannot run {argv[0]}: [Errno 2] No such file or directory: '{argv[0]}' "
                                        "(is Slurm installed here, on PATH?)")
        return self.answers[argv[0]]


FORGOTTEN = dict(squeue=(0, "", ""), scontrol=(1, "", "slurm_load_jobs error: Invalid job id specified\n"))


async def test_a_job_slurmctld_forgot_is_read_from_sacct(monkeypatch):
    fake = FakeSlurm(**FORGOTTEN, sacct=(0, "41|TIMEOUT|TimeLimit|n1\n", ""))
    monkeypatch.setattr(slurm_jobs, "run", fake)
    job = await slurm_jobs.state("41")
    assert fake.asked == ["squeue", "scontrol", "sacct"]
    assert (job.state, job.reason, job.nodes, job.source, job.active) == ("TIMEOUT", "TimeLimit", "n1", "sacct", False)


@pytest.mark.parametrize("sacct, said", [
    ((1, "", "sacct: error: Slurm accounting storage is disabled\n"), "sacct (exit 1): sacct: error: Slurm accounting "
                                                                       "storage is disabled"),
    ((0, "", ""), "sacct has no record of it"),
    (None, "cannot run sacct"),
], ids=["no-accounting", "no-record", "no-sacct"])
async def test_a_job_no_command_knows_is_gone_with_what_each_said(monkeypatch, sacct, said):
    fake = FakeSlurm(**FORGOTTEN, **({"sacct": sacct} if sacct else {}))
    monkeypatch.setattr(slurm_jobs, "run", fake)
    job = await slurm_jobs.state("41")
    assert (job.state, job.source, job.active) == ("GONE", JobSource.NONE, False)
    assert job.reason.startswith("no longer known to slurmctld; ") and said in job.reason


async def test_a_job_still_in_the_queue_is_squeues_word(monkeypatch):
    fake = FakeSlurm(squeue=(0, "41|CANCELLED|None|n1|0:00|0|\n", ""))
    monkeypatch.setattr(slurm_jobs, "run", fake)
    job = await slurm_jobs.state("41")
    assert fake.asked == ["squeue"] and (job.state, job.source) == ("CANCELLED", JobSource.SQUEUE)


# -- a finished run's allocations -------------------------------------------------------------------------------------
def test_a_finished_runs_allocations_are_each_groups_last_job_ended(tmp_path, monkeypatch):
    c = cfg(tmp_path, nodes=3)
    jobs = Path(c.run_dir) / "slurm" / "jobs.jsonl"
    jobs.parent.mkdir(parents=True)
    jobs.write_text("".join(json.dumps({"job": j, "group": g, "ts": 0}) + "\n" for j, g in
                            (("40", 0), ("41", 0), ("42", 1), ("43", 2))) + '{"job": "4')  # a line cut by a crash
    said = {"41": JobState("41", "CANCELLED", "None", "n1", "", 0, JobSource.SQUEUE),
            "42": JobState("42", "GONE", "no longer known to slurmctld; sacct has no record of it",
                           source=JobSource.NONE),
            "43": JobState("43", "RUNNING", "None", "n3", "8:00")}

    async def state(job_id: str) -> JobState:
        return said[job_id]

    monkeypatch.setattr(slurm_jobs, "state", state)
    rows = {h.name: h for h in allocations_after(c)}
    assert list(rows) == ["regen-0", "regen-1", "regen-2"]
    assert (rows["regen-0"].state, rows["regen-0"].job.state, rows["regen-0"].job.ended) == ("ended", "CANCELLED", True)
    assert rows["regen-0"].job.job_id == "41"  # the group's last job, not its first
    assert (rows["regen-1"].state, rows["regen-1"].job.state, rows["regen-1"].job.source) == ("ended", "GONE", "none")
    # killed outright, its supervisor left this one running: said so, with what releases it
    assert rows["regen-2"].state == "stopped" and not rows["regen-2"].job.ended
    assert "still RUNNING with no supervisor: `regen stop` cancels it" in rows["regen-2"].error

    st = RunStatus(run_dir="/r", state="done", running=False, offline=True, hosts=list(rows.values()))
    again = RunStatus.from_dict(json.loads(json.dumps(st.to_dict())))
    assert again.hosts == st.hosts
    console = Console(width=200, record=True)
    console.print(render_status(again))
    text = console.export_text()
    assert "hosts (no supervisor: each job's last state, as Slurm says it now)" in text
    line = next(x for x in text.splitlines() if "regen-0" in x)
    assert "job 41 CANCELLED on n1" in line and "ended" in line and "RUNNING" not in line

    m = RunModel("login", "/r")
    m.apply_status(again)
    _, table = host_rows(m)
    cells = dict(table)["regen-0"]
    assert [str(c) for c in cells[2:4]] == ["CANCELLED", ""] and str(cells[7]) == "ended"


def test_a_group_without_a_job_says_so(tmp_path):
    rows = allocations_after(cfg(tmp_path))
    assert [(h.name, h.state, h.job) for h in rows] == [("regen-0", "stopped", None)]
    assert "no job was submitted for it" in rows[0].error


# -- a lost job: its servers' figures go -----------------------------------------------------------------------------
async def test_a_lost_job_drops_its_servers_live_figures(tmp_path):
    async with aiohttp.ClientSession() as session:
        link = SlurmLink(cfg(tmp_path), 0, engine_root=Path("."), session=session, emit=lambda _: None)
        [m] = link.members
        m.state, m.pid, m.node, m.job_id = WorkerState.READY, 4711, "n1", "41"
        m.metrics = ServerMetrics(running_reqs=15, queued_reqs=9, gen_throughput=879.0, token_usage=0.4)
        m.in_flight = 24
        assert pid_text(m.pid, m.node, m.job_id) == "4711 on n1, job 41"
        await link._lose("slurm job 41 NODE_FAIL (NodeDown) on n1")
        ev = m.snapshot()
    assert ev.state == WorkerState.LOST and ev.error == "slurm job 41 NODE_FAIL (NodeDown) on n1"
    assert (ev.running_reqs, ev.queued_reqs, ev.gen_throughput, ev.token_usage, ev.pid, ev.in_flight) == (None,) * 6
    assert (ev.node, ev.job_id) == ("n1", "41")  # where it was: the job it was lost with
    assert pid_text(ev.pid, ev.node, ev.job_id) == "N/A (on n1, job 41)"
    assert link.status().state == HostState.LOST

    m = RunModel("login", "/r")
    m.apply(ev)
    w = m.workers[ev.name]
    assert (w.state, w.running, w.tok_s, w.in_flight) == ("lost", None, None, None)


def test_status_json_of_an_ended_job_round_trips():
    j = SlurmJobStatus("41", "NODE_FAIL", "NodeDown", "n2", ended=True, source=JobSource.SACCT)
    assert RunStatus.from_dict({"run_dir": "/r", "state": "done", "hosts": [
        {"name": "regen-0", "address": "x", "state": "ended", "job": j.__dict__}]}).hosts[0].job == j


def test_a_slurm_that_does_not_answer_is_said_not_guessed(tmp_path, monkeypatch):
    c = cfg(tmp_path)
    jobs = Path(c.run_dir) / "slurm" / "jobs.jsonl"
    jobs.parent.mkdir(parents=True)
    jobs.write_text(json.dumps({"job": "41", "group": 0, "ts": 0}) + "\n")

    async def state(job_id: str) -> JobState:
        raise slurm_jobs.SlurmError("squeue did not answer within 30 s (is slurmctld reachable?)")

    monkeypatch.setattr(slurm_jobs, "state", state)
    [row] = allocations_after(c)
    assert (row.state, row.job.job_id, row.job.state, row.job.ended) == ("stopped", "41", "UNKNOWN", False)
    assert "the last state of slurm job 41 cannot be read: squeue did not answer" in row.error
