"""A [slurm] group's job told to an operator who is not looking: a job that ends (TIMEOUT, CANCELLED by someone else,
NODE_FAIL, PREEMPTED) or is requeued, and one that stays pending past [slurm] pending_alert_s (then its start), are
notifications with Slurm's words, whatever notify.min_severity says.

The link's own logic against a scripted squeue (no cluster: the states a real Slurm gives are in
tests/test_slurm_run.py) and a real webhook receiver; the link's clock is the test's, so nothing waits."""
from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from engine.config.load import NotifyConfig
from engine.notify import Notifier
from engine.placement.slurm import link as link_mod
from engine.placement.slurm.jobs import JobState
from engine.placement.slurm.link import SlurmLink
from engine.placement.slurm.step import NODE_FILE, job_dir
from tests.test_notify import Sink, receiver  # noqa: F401  (fixture)
from tests.test_slurm_run import slurm_config

ROOT = Path(__file__).resolve().parent.parent
POLL_S = 300.0  # what one squeue poll advances the link's clock by


class FakeSqueue:
    """jobs.state and jobs.submit as a script: each poll answers the next state (the last one repeats) and moves the
    link's clock on by POLL_S."""

    def __init__(self, states: list[JobState]):
        self.states = list(states)
        self.now = 0.0
        self.polls = 0
        self.submitted: list[str] = []

    async def state(self, job_id: str) -> JobState:
        if self.states and job_id != self.states[0].job_id and job_id in self.submitted_ids:
            return JobState(job_id, "PENDING", "Resources", "", "10:00")  # a hand-over's next job, not scripted
        self.now += 0 if self.polls == 0 else POLL_S
        self.polls += 1
        st = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        assert st.job_id == job_id, f"polled {job_id}, scripted {st.job_id}"
        return st

    async def submit(self, argv: list[str], jobs_file: Path, group: int) -> str:
        self.submitted.append(" ".join(argv))
        return self.submitted_ids[0]

    submitted_ids = ("4128",)


@pytest.fixture
def slurm_link(tmp_path, tiny_model_dir, monkeypatch):
    """make(states, **slurm keys) -> (link, squeue, telemetry, notifier): a group's link on a fake squeue, its alerts
    going to a notifier with the default [notify] (min_severity critical) posting to `url`."""
    monkeypatch.setattr(link_mod, "POLL_S", 0.0)

    async def make(states: list[JobState], url: str, **slurm) -> tuple[SlurmLink, FakeSqueue, Sink, Notifier]:
        cfg = slurm_config(tmp_path, tiny_model_dir, prompts=4, nodes=1, **slurm)
        squeue = FakeSqueue(states)
        monkeypatch.setattr(link_mod.slurm_jobs, "state", squeue.state)
        monkeypatch.setattr(link_mod.slurm_jobs, "submit", squeue.submit)
        telemetry = Sink()  # what the link emits, kept and handed to the notifier
        notifier = Notifier(NotifyConfig(url=url, retry_backoff_s=0.01), cfg.run_dir, telemetry.emit, host="login")
        telemetry.listeners.append(notifier.on_event)
        notifier.start()
        link = SlurmLink(cfg, 0, engine_root=ROOT, session=aiohttp.ClientSession(), emit=telemetry.emit)
        link.clock = lambda: squeue.now
        return link, squeue, telemetry, notifier

    return make


def step_started(link: SlurmLink, job_id: str) -> None:
    """What the job's step writes once it runs on its node."""
    here = job_dir(link.slurm_dir, link.group, job_id)
    here.mkdir(parents=True, exist_ok=True)
    (here / NODE_FILE).write_text(json.dumps({"node": "n1", "address": "10.78.0.2", "gpus": "0,1"}))


async def close(link: SlurmLink, notifier: Notifier) -> None:
    await notifier.aclose(5)
    await link.session.close()


def pending(reason: str = "Resources") -> JobState:
    return JobState("4128", "PENDING", reason, "", "10:00")


RUNNING = JobState("4128", "RUNNING", "None", "n1", "9:58")


async def test_a_job_pending_past_the_threshold_is_one_notification_and_its_start_another(slurm_link, receiver):
    r = receiver()
    # polled at 0, 300, 600 and 900 s of the link's clock: pending_alert_s = 600 is crossed at the third poll
    link, squeue, telemetry, notifier = await slurm_link([pending(), pending(), pending(), pending(), RUNNING],
                                                         r.url(), pending_alert_s=600)
    step_started(link, "4128")
    said = await link.start_agent()
    assert said.startswith("slurm job 4128 running on n1 (10.78.0.2)")
    waited = [e for e in telemetry.events if e.key.startswith("slurm-pending-long:")]
    assert len(waited) == 1, "one alert for one wait, not one per poll"
    await close(link, notifier)
    bodies = [b for b in r.bodies() if b["kind"] == "alert"]
    # the submit (info) and `is pending: Resources` (warning) alerts stay under min_severity: not sent
    assert [(b["severity"], b["text"]) for b in bodies] == [
        ("warning", "slurm job 4128 (regen-0) has been PENDING for 10m00s: Resources"),
        ("info", "slurm job 4128 (regen-0) started on n1 after 20m00s waiting"),
    ]
    assert bodies[0]["key"] == "slurm-pending-long:regen-0:4128"
    assert "job 4128 PENDING (Resources)" in bodies[0]["evidence"]
    assert "squeue -j 4128 --start" in bodies[0]["evidence"] and "pending_alert_s = 600" in bodies[0]["evidence"]
    assert link.status().job.waiting_since is None  # running: no longer waiting


async def test_slurms_routine_pending_reasons_are_info_and_a_blocking_one_a_warning(slurm_link, receiver):
    """Waiting its turn (Priority) and the delay Slurm puts on a requeued job (BeginTime, right after the requeue
    alert) are routine; a reason that can keep the job from starting (Resources, a held job...) is a warning."""
    r = receiver()
    link, squeue, telemetry, notifier = await slurm_link(
        [pending("BeginTime"), pending("Priority"), pending("Resources"), RUNNING], r.url(), pending_alert_s=3600)
    step_started(link, "4128")
    await link.start_agent()
    await close(link, notifier)
    said = [(e.severity, e.text) for e in telemetry.events if e.key == "slurm-pending:regen-0"]
    assert said == [("info", "slurm job 4128 (regen-0) is pending: BeginTime"),
                    ("info", "slurm job 4128 (regen-0) is pending: Priority"),
                    ("warning", "slurm job 4128 (regen-0) is pending: Resources")]


async def test_the_pending_alert_waits_for_slurms_reason(slurm_link, receiver):
    """Right after a submit squeue says reason None (slurmctld has not evaluated the job): the alert waits for the
    reason, up to twice the threshold, and says it (seen at pending_alert_s = 1 on the real Slurm)."""
    r = receiver()
    # polled at 0, 300, 600, 900, 1200 s: no reason until 900 s
    link, squeue, telemetry, notifier = await slurm_link(
        [pending("None"), pending("None"), pending("None"), pending(), pending(), RUNNING], r.url(), pending_alert_s=600)
    step_started(link, "4128")
    await link.start_agent()
    await close(link, notifier)
    (waited,) = [e for e in telemetry.events if e.key.startswith("slurm-pending-long:")]
    assert waited.text == "slurm job 4128 (regen-0) has been PENDING for 15m00s: Resources"
    link2, squeue2, telemetry2, notifier2 = await slurm_link([pending("None")] * 6 + [RUNNING], r.url(),
                                                             pending_alert_s=600)
    step_started(link2, "4128")
    await link2.start_agent()
    await close(link2, notifier2)
    (waited,) = [e for e in telemetry2.events if e.key.startswith("slurm-pending-long:")]
    assert waited.text == "slurm job 4128 (regen-0) has been PENDING for 20m00s: no reason given"


async def test_a_job_that_starts_within_the_threshold_sends_nothing(slurm_link, receiver):
    r = receiver()
    link, squeue, telemetry, notifier = await slurm_link([pending("Priority"), RUNNING], r.url(), pending_alert_s=600)
    step_started(link, "4128")
    await link.start_agent()
    await close(link, notifier)
    assert r.bodies() == []


async def test_the_status_says_since_when_a_job_waits(slurm_link, receiver):
    r = receiver()
    link, squeue, telemetry, notifier = await slurm_link([pending()], r.url())
    link.job = await squeue.state("4128")  # what start_agent's poll does
    link._pending(link.job)
    job = link.status().job
    assert (job.job_id, job.state, job.reason) == ("4128", "PENDING", "Resources")
    assert job.waiting_since is not None
    await close(link, notifier)


@pytest.mark.parametrize("ended,text", [
    (JobState("4127", "TIMEOUT", "TimeLimit", "n1", "0:00"), "ended: TIMEOUT (TimeLimit)"),
    (JobState("4127", "CANCELLED", "None", "n1", "9:00"), "ended: CANCELLED"),
    (JobState("4127", "NODE_FAIL", "NodeDown", "n1", "9:00"), "ended: NODE_FAIL (NodeDown)"),
    (JobState("4127", "PREEMPTED", "None", "n1", "9:00"), "ended: PREEMPTED"),
    (JobState("4127", "PENDING", "BeginTime", "", "10:00", restarts=1),
     "was requeued (restart 1): PENDING (BeginTime); its servers are lost until Slurm runs it again"),
], ids=["timeout", "cancelled", "node-fail", "preempted", "requeued"])
async def test_a_job_that_ends_is_a_notification_in_slurms_words(slurm_link, receiver, ended, text):
    r = receiver()
    link, squeue, telemetry, notifier = await slurm_link(
        [JobState("4127", "RUNNING", "None", "n1", "9:30"), ended], r.url())
    link.job = JobState("4127", "RUNNING", "None", "n1", "9:58")
    link._attached.add("4127")
    reason = await link._watch_job()
    assert reason == f"slurm {ended.words()}"  # why the host is lost (its in-flight samples re-dispatched)
    await close(link, notifier)
    (body,) = [b for b in r.bodies() if b["kind"] == "alert"]
    assert body["severity"] == "error" and body["text"] == f"slurm job 4127 (regen-0) {text}"
    assert body["evidence"].startswith(ended.words()) and body["run_dir"] == str(link.cfg.run_dir)


@pytest.mark.parametrize("end, planned, idle", [
    (JobState("4127", "TIMEOUT", "TimeLimit", "n1", "0:00"), True, False),
    # drained and idle: regen cancels it rather than hold it to its limit
    (JobState("4127", "CANCELLED", "None", "n1", "0:00"), True, True),
    (JobState("4127", "CANCELLED", "None", "n1", "0:00"), False, False),  # someone else's scancel during the hand-over
], ids=["timeout", "cancelled-by-regen-once-drained", "cancelled-by-someone"])
async def test_a_planned_hand_over_is_info_never_a_lost_host_and_never_sent(slurm_link, receiver, monkeypatch, end,
                                                                           planned, idle):
    """The limit comes before the next job's servers are proven: the next job was submitted and the servers drained
    (said, not sent), and the old job ending TIMEOUT, or cancelled by regen once its servers answered their last
    requests, is what regen planned: info naming the job that takes over, no `host ... lost`, the group waiting for
    that job. Any other end during the hand-over stays an error, and a lost host, and the next join still takes the
    job already submitted."""
    from engine.servers.metrics_client import ServerMetrics

    r = receiver()
    running = [JobState("4127", "RUNNING", "None", "n1", f"0:0{k}") for k in (5, 4, 3)]
    link, squeue, telemetry, notifier = await slurm_link([*running, end], r.url())
    cancelled: list[list[str]] = []

    async def cancel(ids: list[str]) -> str:
        cancelled.append(ids)
        return ""

    monkeypatch.setattr(link_mod.slurm_jobs, "cancel", cancel)
    for m in link.members:  # what the servers' /metrics said: requests still open, or none
        m.metrics = ServerMetrics(running_reqs=0 if idle else 2, queued_reqs=0)
    link.job = JobState("4127", "RUNNING", "None", "n1", "0:10")
    link._attached.add("4127")
    reason = await link._watch_job()
    await link._lose(reason)
    await close(link, notifier)
    said = [(ev.severity, ev.text) for ev in telemetry.events if getattr(ev, "text", None)]
    assert ("info", "slurm job 4127 (regen-0) has 0:05 left: job 4128 submitted to take over") in said
    assert ("warning", "slurm job 4127 (regen-0) is drained 60 s before its limit, before the next job's servers are "
            "proven: the group serves nothing until they are") in said
    lost = [t for _, t in said if t.startswith("host regen-0 lost")]
    assert link.next_job == "4128"
    assert cancelled == ([["4127"]] if idle else [])
    if planned and idle:
        assert ("info", "slurm job 4127 (regen-0) ended as planned (CANCELLED, cancelled by regen once its servers had "
                "answered their last requests); job 4128 takes the group over") in said
    if planned and not idle:
        assert ("info", "slurm job 4127 (regen-0) reached its time limit as planned; job 4128 takes over") in said
    if planned:
        assert not lost and link.state == "connecting" and link.lost_count == 0
        assert link.error == "slurm job 4128 takes over: job 4128 PENDING (Resources)"
        assert r.bodies() == []
    else:
        assert ("error", "slurm job 4127 (regen-0) ended: CANCELLED") in said and lost and link.state == "lost"
        assert [b["key"] for b in r.bodies() if b["kind"] == "alert"] == ["slurm-end:regen-0:4127"]
