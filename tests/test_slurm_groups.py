"""A [slurm] run's groups at a glance, without a cluster: granted / serving / pending of the groups wanted against the
min_groups the plan counts on (engine.placement.slurm.groups), the below-min alert of an elastic run and whether
[notify] sends it, and the line `regen status` prints (also in 80 columns) and the status JSON carries."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import pytest
from rich.console import Console

from console.commands.status import render_status, status_console
from engine.api.events import AlertEvent
from engine.api.status import HostStatus, RunStatus, SlurmGroups, SlurmJobStatus
from engine.api.wire import WorkerState
from engine.config.load import NotifyConfig, config_from_dict
from engine.notify.message import notification_for
from engine.placement.slurm.groups import GroupWatch, count_groups, job_pending_alert_s
from engine.placement.slurm.jobs import JobState

BASE = {"run_dir": "/scratch/run", "model": "/m", "prompts": ["p.jsonl"]}


def cfg_with(**slurm):
    return config_from_dict({**BASE, "slurm": {"partition": "gpu", "gpus_per_node": 2, "pending_alert_s": 60,
                                               **slurm}})


@dataclass
class Member:
    state: str


@dataclass
class Host:
    name: str


@dataclass
class Alerts:
    pending_alert_s: float = 60.0


@dataclass
class FakeLink:
    """What GroupWatch reads of a SlurmLink: its job, its servers, its status row, its job alerts' threshold."""
    name: str
    job: JobState | None
    members: list = field(default_factory=lambda: [Member(WorkerState.STARTING)])
    alerts: Alerts = field(default_factory=Alerts)

    @property
    def host(self) -> Host:
        return Host(self.name)

    def status(self) -> HostStatus:
        j = self.job
        return HostStatus(name=self.name, address="slurm partition gpu", state="up", job=None if j is None else
                          SlurmJobStatus(j.job_id, j.state, j.reason, j.nodes, ended=not j.active))


def links(*states: str) -> list[FakeLink]:
    out = []
    for i, state in enumerate(states):
        job = JobState(str(100 + i), state, "Resources" if state == "PENDING" else "None", f"n{i}")
        out.append(FakeLink(f"regen-{i}", job, [Member(WorkerState.READY if state == "RUNNING" else
                                                        WorkerState.STARTING)]))
    return out


def test_an_elastic_run_below_min_groups_is_one_alert_sent_and_cleared():
    said: list[AlertEvent] = []
    now = [0.0]
    group = links("RUNNING", "PENDING", "PENDING")
    watch = GroupWatch(cfg_with(min_groups=2, max_groups=3), group, said.append, clock=lambda: now[0])
    assert {link.alerts.pending_alert_s for link in group} == {math.inf}  # no job's own pending alert
    figures = watch.judge()
    assert (figures.granted, figures.serving, figures.pending, figures.wanted, figures.counted) == (1, 1, 2, 3, 2)
    assert figures.below_since is not None and not said
    now[0] = 59.0
    watch.judge()
    assert not said  # pending_alert_s = 60
    now[0] = 61.0
    watch.judge()
    watch.judge()
    [raised] = said
    assert raised.severity == "warning" and raised.kind == "raised" and raised.key == "slurm-below-min"
    assert raised.text == ("slurm: 1 of the 2 server group(s) the plan counts on (min_groups) granted for 1m01s: "
                           "the run goes on slower than planned")
    assert raised.evidence == ("regen-1: job 101 PENDING (Resources) on n1; regen-2: job 102 PENDING (Resources) on "
                               "n2; the alert's threshold: [slurm] pending_alert_s = 60")
    # sent whatever [notify] min_severity says, like a job pending too long
    assert notification_for(raised, NotifyConfig(url="https://hook.example/x", min_severity="critical"),
                            run_dir="/r", host="login") is not None
    group[1].job = JobState("101", "RUNNING", "None", "n1")
    cleared = watch.judge()
    assert (cleared.granted, cleared.below_since) == (2, None)
    assert said[-1].kind == "cleared" and said[-1].key == "slurm-below-min" and said[-1].severity == "info"
    assert said[-1].text == "slurm: 2 server group(s) granted, the 2 the plan counts on (min_groups)"


def test_a_run_that_is_not_elastic_leaves_a_waiting_group_to_its_jobs_own_alerts():
    said: list[AlertEvent] = []
    now = [0.0]
    cfg = cfg_with(nodes=2)
    group = links("RUNNING", "PENDING")
    watch = GroupWatch(cfg, group, said.append, clock=lambda: now[0])
    assert {link.alerts.pending_alert_s for link in group} == {60.0}
    watch.judge()
    now[0] = 3600.0
    assert watch.judge().granted == 1 and not said
    assert job_pending_alert_s(cfg) == 60.0  # each job's own pending alert, as before
    assert job_pending_alert_s(cfg_with(max_groups=2)) == math.inf  # an elastic group waiting is the plan


def test_offline_groups_count_each_groups_last_job():
    hosts = [HostStatus("regen-0", "a", "stopped", job=SlurmJobStatus("7", "RUNNING")),
             HostStatus("regen-1", "a", "stopped", job=SlurmJobStatus("8", "PENDING")),
             HostStatus("regen-2", "a", "ended", job=SlurmJobStatus("6", "CANCELLED", ended=True)),
             HostStatus("regen-3", "a", "stopped")]
    assert count_groups(hosts, 2, 4) == SlurmGroups(wanted=4, counted=2, granted=1, serving=0, pending=1)


def status_with(groups: SlurmGroups | None, running: bool = True) -> RunStatus:
    return RunStatus.from_dict(RunStatus(run_dir="/scratch/regen/run", state="running", running=running, pid=4242,
                                         started_at=1.0, slurm_groups=groups).to_dict())


@pytest.mark.parametrize("columns", [80, 200])
def test_status_prints_the_groups_in_one_line(monkeypatch, capsys, columns):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("COLUMNS", str(columns))
    console = status_console(wide=False)
    below = SlurmGroups(wanted=4, counted=2, granted=1, serving=1, pending=3, below_since=1.0)
    console.print(render_status(status_with(below), console))
    lines = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out).splitlines()
    assert "slurm groups: 1 granted (1 serving), 3 pending, 4 wanted; the plan counts on 2" in lines
    assert all(len(line) <= columns for line in lines)


def test_the_groups_without_a_supervisor_say_no_serving_and_no_alarm():
    offline = SlurmGroups(wanted=2, counted=2, granted=0, pending=0)
    console = Console(width=200, record=True)
    console.print(render_status(status_with(offline, running=False), console))
    assert "slurm groups: 0 granted, 0 pending, 2 wanted; the plan counts on 2" in console.export_text().splitlines()
    assert "slurm_groups" not in status_with(None).to_dict()  # a run without [slurm]
