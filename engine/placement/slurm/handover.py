"""A [slurm] group's hand-over from one job to the next, seen from the login node: the next job, submitted before the
drain is due, has its servers proven while the old job's still serve (Successor); the old job, its servers drained, is
cancelled once they have answered their last requests, or Slurm ends it at its limit (retire).

The successor's servers are proven on copies of the group's members (same names, the job's own port block and node),
never in the router: the link moves its members onto them in one step (engine/placement/slurm/link.py _switch).
"""
from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from engine.api.wire import WorkerState
from engine.placement.hosts.admission import AgentRecords
from engine.placement.hosts.remote_worker import RemoteWorker, health, scrape
from engine.placement.slurm import jobs as slurm_jobs
from engine.placement.slurm.jobs import JobState, SlurmError
from engine.placement.slurm.step import NODE_FILE, job_dir

if TYPE_CHECKING:
    from engine.placement.slurm.link import SlurmLink

log = logging.getLogger("regen.slurm")

POLL_S = 2.0  # the next job's state, while it waits to start
PROVE_POLL_S = 0.5  # its servers' health and identity, once it runs
RETIRE_POLL_S = 1.0  # the old servers' open requests
IDLE_READS = 2  # the old servers are cancelled after this many reads in a row with no request open


def server_copy(m: RemoteWorker, url: str = "") -> RemoteWorker:
    """A member's server as another job runs it: the same name and launch, its own URL and state, no listeners (it is
    in no router until the link moves its member onto it)."""
    return RemoteWorker(spec=m.spec, host=m.host, url=url, headers=m.headers)


class Successor:
    """The group's next job, submitted while the current one still serves: waits for it to run, reads its node, and
    proves its servers (the host agent's identity records in the job's own dir); `ready` is set once every one is."""

    def __init__(self, link: SlurmLink, job_id: str, slot: int, submitted_at: float):
        self.link = link
        self.job = JobState(job_id, "PENDING")
        self.slot = slot
        self.submitted_at = submitted_at
        self.running_since: float | None = None
        self.here: Path | None = None  # the job's dir once its step wrote node.json
        self.node = ""
        self.members = [server_copy(m) for m in link.members]
        self.records = AgentRecords(lambda: link.group_host.model_copy(update={"work_dir": str(self.here)}),
                                    link.ssh, link.emit, link.session, link.AGENT_ALIVE, link.tuning)
        self.ready = asyncio.Event()
        self.ended: JobState | None = None  # ended before its servers were ready (said by the link)
        self.task = asyncio.create_task(self._run(), name=f"successor-{link.host.name}-{job_id}")

    @property
    def job_id(self) -> str:
        return self.job.job_id

    def words(self) -> str:
        if self.job.state != "RUNNING":
            return self.job.words()
        proven = sum(m.state == WorkerState.READY for m in self.members)
        return f"{self.job.words()}, {proven} of {len(self.members)} server(s) proven"

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def _run(self) -> None:
        link = self.link
        life = 0
        while True:
            try:
                self.job = await slurm_jobs.state(self.job.job_id)
            except SlurmError as exc:
                log.warning("group %s: the next job %s: %s", link.host.name, self.job.job_id, exc)
                await asyncio.sleep(POLL_S)
                continue
            if not self.job.active:
                self.ended = await slurm_jobs.final_state(self.job)
                return
            if self.job.state != "RUNNING" or self.job.restarts != life:  # waits (again, if requeued)
                life, self.running_since, self.here = self.job.restarts, None, None
                await asyncio.sleep(POLL_S)
                continue
            now = link.clock()
            if self.running_since is None:
                self.running_since = now
                if life == 0:
                    link.schedule.queue_waits.append(now - self.submitted_at)
                log.info("group %s: next job %s running on %s, %.1f s after its submission", link.host.name,
                         self.job.job_id, self.job.nodes, now - self.submitted_at)
                await link.stagger(self.job)
            if self.here is None and not self._read_node(life):
                await asyncio.sleep(PROVE_POLL_S)
                continue
            if await self._prove():
                link.schedule.loads.append(link.clock() - self.running_since)
                log.info("group %s: next job %s's servers proven %.1f s after its start", link.host.name,
                         self.job.job_id, link.clock() - self.running_since)
                self.ready.set()
                return
            await asyncio.sleep(PROVE_POLL_S)

    def _read_node(self, life: int) -> bool:
        here = job_dir(self.link.slurm_dir, self.link.group, self.job.job_id, life)
        try:
            node = json.loads((here / NODE_FILE).read_text())
        except (FileNotFoundError, ValueError):
            return False  # the step has not written it yet (the link's forced drain bounds the wait)
        self.here, self.node = here, str(node.get("node") or self.job.nodes)
        for m in self.members:
            m.url = f"http://{node['address']}:{self.link.port_of(m, self.slot)}"
            m.node, m.job_id = self.node, self.job.job_id
        return True

    async def _prove(self) -> bool:
        """Each server not proven yet: healthy and answering as its agent's launch. True once all are."""
        for m in self.members:
            if m.state == WorkerState.READY:
                continue
            ok, why = await health(self.link.session, m)
            if ok and await self.records.admit(m):
                await self.link._read_capacity(m, self.records)
                m.state = WorkerState.READY  # a copy: no listener, no router
            elif not ok:
                m.error = why
        return all(m.state == WorkerState.READY for m in self.members)


async def retire(link: SlurmLink, job: JobState, servers: list[RemoteWorker], taken_over_by: str,
                 end_at: float | None) -> None:
    """The old job of a hand-over, its servers out of the router: cancelled once they have no request open (read
    IDLE_READS times in a row), or ended by Slurm at its limit (its kill lag measured against `end_at`, the link's
    clock); its end said as planned (info) or, for another end, in Slurm's words (error)."""
    idle, cancelled = 0, False
    while True:
        await asyncio.sleep(RETIRE_POLL_S)
        try:
            job = await slurm_jobs.state(job.job_id)
        except SlurmError as exc:
            log.warning("group %s: the drained job %s: %s", link.host.name, job.job_id, exc)
            continue
        if not job.active or job.restarts:  # ended (or requeued: its servers are gone either way)
            break
        if cancelled:
            continue
        await asyncio.gather(*(scrape(link.session, m) for m in servers))
        open_requests = [(m.metrics.running_reqs, m.metrics.queued_reqs) for m in servers]
        idle = idle + 1 if all(r == 0 and q == 0 for r, q in open_requests) else 0
        if idle >= IDLE_READS:
            said = await slurm_jobs.cancel([job.job_id])
            cancelled = not said
            log.info("group %s: job %s drained (no request open): %s", link.host.name, job.job_id,
                     said or "cancelled")
    ended_at = link.clock()
    job = await slurm_jobs.final_state(job)
    if job.state == "TIMEOUT" and end_at is not None:
        link.schedule.kill_lags.append(max(0.0, ended_at - end_at))
    link.alerts.retired(job, taken_over_by, cancelled)
