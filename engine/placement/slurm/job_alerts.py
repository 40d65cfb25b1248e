"""The alerts of a [slurm] group's job life, each said once: pending (Slurm's reason; once more past pending_alert_s),
started after such a wait, ended or requeued in Slurm's words (the keys: engine/placement/slurm/alerts.py)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from engine.api.events import AlertEvent, Event
from engine.api.wire import Severity, duration_text
from engine.placement.slurm import alerts as job_alerts
from engine.placement.slurm.jobs import JobState

# pending reasons that are Slurm's routine, told as info: waiting its turn, and the delay Slurm puts on a requeued
# job before it may start again (right after the requeue alert)
ROUTINE_PENDING = ("Priority", "BeginTime")


@dataclass
class Waiting:
    """A job seen queued and not yet running (PENDING, CONFIGURING, requeued ...)."""
    job_id: str
    since: float  # the link's clock (monotonic)
    wall_since: float  # time.time(), for the status
    alerted: bool = False


class JobAlerts:
    """What one group's link says of its jobs (`group`: the group's name); `clock` says how long a job waits."""

    def __init__(self, group: str, emit: Callable[[Event], None], clock: Callable[[], float], pending_alert_s: float):
        self.group = group
        self.emit = emit
        self.clock = clock
        self.pending_alert_s = pending_alert_s
        self.pending_said: str | None = None
        self.waiting: Waiting | None = None  # the job not running yet: since when, and whether that was alerted
        self.said_ended: set[str] = set()

    def pending(self, job: JobState) -> None:
        """A job not running yet: Slurm's reason when it changes (info for its routine waits), and one alert once it
        waited pending_alert_s."""
        if self.pending_said != job.reason and job.given_reason:  # a reason worth saying
            self.pending_said = job.reason
            self.emit(AlertEvent(severity=Severity.INFO if job.given_reason in ROUTINE_PENDING else Severity.WARNING,
                                 text=f"slurm job {job.job_id} ({self.group}) is pending: {job.reason}",
                                 evidence=job.words(), key=f"slurm-pending:{self.group}"))
        self._pending_too_long(job)

    def _pending_too_long(self, job: JobState) -> None:
        """One alert once the job has waited pending_alert_s (it will not start: Slurm's reason); [notify] sends it."""
        if self.waiting is None or self.waiting.job_id != job.job_id:
            self.waiting = Waiting(job.job_id, self.clock(), time.time())
        waited = self.clock() - self.waiting.since
        if self.waiting.alerted or waited < self.pending_alert_s:
            return
        no_reason = not job.given_reason  # slurmctld has not evaluated the job yet (seconds after a submit)
        if no_reason and waited < 2 * self.pending_alert_s:
            return  # the alert is for Slurm's reason: wait a little longer for it
        self.waiting.alerted = True
        reason = "no reason given" if no_reason else job.reason
        self.emit(AlertEvent(
            severity=Severity.WARNING, text=f"slurm job {job.job_id} ({self.group}) has been {job.state} for "
                                     f"{duration_text(waited)}: {reason}",
            evidence=f"{job.words()}; Slurm's expected start: squeue -j {job.job_id} --start; the alert's threshold: "
                     f"[slurm] pending_alert_s = {self.pending_alert_s}",
            key=job_alerts.key(job_alerts.PENDING_LONG, self.group, job.job_id)))

    def started(self, job: JobState) -> None:
        """The job runs: a wait that was alerted ends with an alert of its own (sent too)."""
        waiting, self.waiting = self.waiting, None
        if waiting is None or not waiting.alerted or waiting.job_id != job.job_id:
            return
        self.emit(AlertEvent(
            severity=Severity.INFO, text=f"slurm job {job.job_id} ({self.group}) started on {job.nodes} after "
                                  f"{duration_text(self.clock() - waiting.since)} waiting",
            evidence=job.words(), key=job_alerts.key(job_alerts.STARTED, self.group, job.job_id)))

    def ended(self, job: JobState, *, stopping: bool, taking_over: str | None) -> None:
        """The alert for a job that ended, once per job, in Slurm's words (job id, state, reason); `taking_over`: the
        job a hand-over queued, when this one's end is that hand-over's."""
        if job.job_id in self.said_ended or stopping:  # stopping: regen's own cancel, told in the log
            return
        reason = f" ({job.given_reason})" if job.given_reason else ""
        if job.active:  # requeued (preempted, a node failed, scontrol requeue): the same id runs again once placed
            self.emit(AlertEvent(severity=Severity.ERROR, text=f"slurm job {job.job_id} ({self.group}) was requeued "
                                 f"(restart {job.restarts}): {job.state}{reason}; its servers are lost until Slurm "
                                 "runs it again", evidence=job.words() + f", restart count {job.restarts}",
                                 key=job_alerts.key(job_alerts.REQUEUED, self.group,
                                                    f"{job.job_id}:{job.restarts}")))
            return
        self.said_ended.add(job.job_id)
        if taking_over and job.state == "TIMEOUT":  # the limit a hand-over was made for
            self.emit(AlertEvent(severity=Severity.INFO, text=f"slurm job {job.job_id} ({self.group}) reached its time "
                                 f"limit as planned; job {taking_over} takes over", evidence=job.words(),
                                 key=job_alerts.key(job_alerts.HANDED_OVER, self.group, job.job_id)))
            return
        self.emit(AlertEvent(severity=Severity.ERROR, text=f"slurm job {job.job_id} ({self.group}) ended: {job.state}"
                             f"{reason}", evidence=job.words(), key=job_alerts.key(job_alerts.ENDED, self.group, job.job_id)))

    def retired(self, job: JobState, taken_over_by: str, cancelled_by_regen: bool) -> None:
        """The end of a job whose group a hand-over already moved to the next job (its servers drained): info, never
        sent, when regen cancelled it once its last requests were answered or Slurm ended it at its limit; an end
        for another reason (NODE_FAIL, PREEMPTED, someone else's scancel) stays an error."""
        how = {"CANCELLED": "cancelled by regen once its servers had answered their last requests",
               "TIMEOUT": "at its time limit"}
        planned = job.state == "TIMEOUT" or (job.state == "CANCELLED" and cancelled_by_regen)
        if job.job_id in self.said_ended or not planned:
            self.ended(job, stopping=False, taking_over=None)
            return
        self.said_ended.add(job.job_id)
        self.emit(AlertEvent(severity=Severity.INFO, text=f"slurm job {job.job_id} ({self.group}) ended as planned "
                             f"({job.state}, {how[job.state]}); job {taken_over_by} takes the group over",
                             evidence=job.words(), key=job_alerts.key(job_alerts.HANDED_OVER, self.group, job.job_id)))
