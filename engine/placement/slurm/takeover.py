"""One [slurm] group's hand-overs from job to job (the link's part at each time limit): the next job submitted the lead
(measured queue wait + load + margin) before the drain is due, the group moved onto its servers once they are proven,
the drain at handover_s before the limit when they are not, and a just-started job's limit lowered out of another
group's hand-over window. An end that was planned is info and never a lost host; any other stays an error.
"""
from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING

from engine.api.events import AlertEvent
from engine.api.wire import HostState, Severity, WorkerState
from engine.placement.slurm import jobs as slurm_jobs
from engine.placement.slurm.handover import IDLE_READS, Successor, retire, server_copy
from engine.placement.slurm.jobs import JobState, SlurmError, time_left_s, time_left_text
from engine.placement.slurm.schedule import LEAD_MARGIN_S, limit_text, trimmed_limit_min, window_s

if TYPE_CHECKING:
    from engine.placement.slurm.link import SlurmLink

log = logging.getLogger("regen.slurm")


class Takeover:
    """The hand-over state of one group's link: the next job (`successor`) while the current one serves, the drained
    old jobs not ended yet (`retiring`), and whether the servers were drained for a hand-over (`draining`), not by
    the operator."""

    def __init__(self, link: SlurmLink):
        self.link = link
        self.successor: Successor | None = None
        self.retiring: dict[str, asyncio.Task] = {}
        self.draining = False
        self.end_at: float | None = None  # the watched job's limit (the link's clock), from squeue's time left
        self.idle_reads = 0  # the drained job's servers read with no request open, in a row
        self.cancelled: str | None = None  # the drained job regen cancelled before its limit (planned)

    @property
    def name(self) -> str:
        return self.link.host.name

    async def stagger(self, job: JobState, limit_min: int | None) -> int | None:
        """A job that just started (its --time `limit_min`): if its limit falls within a hand-over window (window_s)
        of another group's, it is lowered (`scontrol update`) to fall before it, so no two groups drain together;
        a lowering that would leave less than a minute of serving is not made. Returns the new limit, if lowered."""
        link = self.link
        left = time_left_s(job.time_left)
        if left is None or limit_min is None:
            return None
        if link.slurm.time_min is not None:  # backfill may have started it with a shorter limit than it asked for
            limit_min = min(limit_min, math.ceil(left / 60))
        now = link.clock()
        started = now + left - limit_min * 60
        new = trimmed_limit_min(started, now + left, link.schedule.others(link.group), window_s(link.slurm),
                                link.slurm.handover_s + LEAD_MARGIN_S + 60)
        if new is None:
            return None
        try:
            await slurm_jobs.lower_limit(job.job_id, limit_text(new))
        except SlurmError as exc:
            log.warning("group %s: lowering job %s's limit: %s", self.name, job.job_id, exc)
            return None
        link.emit(AlertEvent(severity=Severity.INFO, text=f"slurm job {job.job_id} ({self.name}): time limit lowered "
                             f"to {limit_text(new)} so that its hand-over falls apart from the other groups'",
                             evidence=f"scontrol update JobId={job.job_id} TimeLimit={limit_text(new)}; its limit fell "
                             f"within {window_s(link.slurm):.0f} s (handover_s + {LEAD_MARGIN_S:.0f} s) of another "
                             "group's", key=f"slurm-stagger:{self.name}"))
        return new

    async def at(self, job: JobState, left: int) -> None:
        """The watched job has `left` seconds before its limit: the next job is submitted once the lead (queue wait +
        load + margin) reaches the drain (handover_s before the limit); at the drain the servers leave the router
        whether or not the next job's are proven."""
        link = self.link
        self.end_at = link.clock() + left
        link.schedule.ends[link.group] = self.end_at
        s = self.successor
        if s is not None and s.ended is not None:  # it ended before it could take over: said, and submitted again
            link.alerts.ended(s.ended, stopping=False, taking_over=None)
            self.successor, link.next_job = None, None
        # not while this job's own servers still load: their load is the run's latest measurement of the lead
        loading = link.loading and left > link.slurm.handover_s
        if self.successor is None and not loading and left <= link.slurm.handover_s + link.schedule.lead_s():
            try:
                job_id = await link.submit()
            except SlurmError as exc:
                link.emit(AlertEvent(severity=Severity.ERROR, text=f"the next slurm job for {self.name} was not "
                                     "submitted", evidence=str(exc), key=f"slurm-handover:{self.name}"))
                return
            link.next_job = job_id
            self.successor = Successor(link, job_id, link.slot_of(job_id), link.submitted_at(job_id))
            link.emit(AlertEvent(severity=Severity.INFO, text=f"slurm job {job.job_id} ({self.name}) has "
                                 f"{time_left_text(job.time_left)} left: job {job_id} submitted to take over",
                                 evidence=f"{job.words()}; submitted {link.schedule.lead_s():.0f} s before the drain "
                                 f"(handover_s = {link.slurm.handover_s} before the limit): "
                                 f"{link.schedule.lead_words()}", key=f"slurm-handover:{self.name}"))
        if self.draining:
            await self._release_drained(job)
        if left <= link.slurm.handover_s and not self.draining:
            self.draining = True
            link.set_drained(True)
            nxt = self.successor.words() if self.successor else "none submitted"
            link.emit(AlertEvent(severity=Severity.WARNING, text=f"slurm job {job.job_id} ({self.name}) is drained "
                                 f"{link.slurm.handover_s} s before its limit, before the next job's servers are "
                                 "proven: the group serves nothing until they are", evidence=f"next job: {nxt}; "
                                 f"{link.schedule.lead_words()}; the old job is cancelled once its servers answered "
                                 f"their last requests, else Slurm ends it at its limit, "
                                 f"{link.schedule.kill_lag_words()}", key=f"slurm-handover:{self.name}"))

    async def _release_drained(self, job: JobState) -> None:
        """Drained before the next job is ready: once its servers have answered their last requests (read IDLE_READS
        times in a row), the old job is cancelled, not held idle to its limit; on a full cluster that frees the nodes
        the next job waits for."""
        if self.cancelled == job.job_id or self.successor is None:
            return
        idle = all(m.metrics.running_reqs == 0 and m.metrics.queued_reqs == 0 for m in self.link.members)
        self.idle_reads = self.idle_reads + 1 if idle else 0
        if self.idle_reads >= IDLE_READS and not await slurm_jobs.cancel([job.job_id]):
            self.cancelled = job.job_id
            log.info("group %s: job %s drained (no request open) before job %s is ready: cancelled", self.name,
                     job.job_id, self.successor.job_id)

    def planned_end(self, job: JobState) -> bool:
        """A job's end that a hand-over planned: its limit, or regen's own cancel once it was drained."""
        return job.state == "TIMEOUT" or (job.state == "CANCELLED" and job.job_id == self.cancelled)

    async def job_ended(self, job: JobState | None) -> bool:
        """The watch ended (the next job's servers proven, or the watched job ended): True when that was a planned
        hand-over, handled here (the group moved onto the next job, or waits for it quietly after a limit reached
        first); False for any other end, a lost host. The next join takes the next job either way (next_job)."""
        s, self.successor = self.successor, None
        if s is not None and s.ready.is_set():
            self.switch(s)
            return True
        if s is None:
            return False
        await s.stop()
        link = self.link
        if job is not None and job.active:  # requeued while the next job was on its way: no longer needed
            said = await slurm_jobs.cancel([job.job_id])
            log.info("group %s: job %s requeued during a hand-over, cancelled: %s", self.name, job.job_id,
                     said or "done")
        if job is None or not self.planned_end(job):
            return False
        link.state, link.error = HostState.CONNECTING, f"slurm job {s.job_id} takes over: {s.words()}"
        for m in link.members:
            m.drop_live_figures()
            m.set_state(WorkerState.STARTING, link.error)
        link.readings.mark_stale(f"the job ended ({job.state}): a hand-over")
        log.info("group %s: %s reached its limit; %s", self.name, job.words(), link.error)
        return True

    def switch(self, s: Successor) -> None:
        """The next job's servers are proven: each member leaves the router at its old URL (its open requests still
        answer there) and joins it at the new job's; the old job is retired."""
        link = self.link
        old = link.watched_job()
        old_servers = [server_copy(m, m.url) for m in link.members]
        keep_drained = link.drained and not self.draining  # drained by the operator: stays out
        for m, new in zip(link.members, s.members):
            if m.state == WorkerState.READY:
                m.set_state(HostState.DRAINED)
            m.url, m.pid, m.node, m.job_id = new.url, new.pid, new.node, new.job_id
            m.served_model_name, m.capacity_info, m.tuning = new.served_model_name, new.capacity_info, new.tuning
            m.crashes_told, m.agent_seen, m.unhealthy_since = new.crashes_told, new.agent_seen, None
            m.set_state(HostState.DRAINED if keep_drained else WorkerState.READY)
        self.draining, link.drained, self.idle_reads = False, keep_drained, 0
        link.took_over(s)
        old_id = old.job_id
        task = self.retiring[old_id] = asyncio.create_task(retire(link, old, old_servers, s.job_id, self.end_at),
                                                           name=f"retire-{self.name}-{old_id}")
        task.add_done_callback(lambda _t: self.retiring.pop(old_id, None))
        left = "" if self.end_at is None else f", {self.end_at - link.clock():.0f} s before its limit"
        link.emit(AlertEvent(severity=Severity.INFO, text=f"slurm job {s.job_id} ({self.name}) serves the group: its "
                             f"servers are proven; job {old_id} drains{left}", evidence=s.words(),
                             key=f"slurm-handover:{self.name}"))

    async def release(self) -> list[str]:
        """The link stops: the next job's and the drained jobs' watches end; their ids, to be cancelled."""
        ids = list(self.retiring)
        if self.successor is not None:
            await self.successor.stop()
        for task in list(self.retiring.values()):
            task.cancel()
        await asyncio.gather(*self.retiring.values(), return_exceptions=True)
        return ids
