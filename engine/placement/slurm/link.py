"""One server group of a [slurm] run, seen from the login node: the host link with Slurm where SSH was.

A join submits the group's job (or waits for the one it submitted, or a requeued job's next life) and attaches to the
node its step names; an unplanned end of the job loses the host. Before its time limit the next job is submitted early
enough (the run's measured queue wait and load time) that its servers are proven by the time the drain is due
(handover_s before the limit); the group then moves onto them in one step and the old job, drained, is cancelled once
its servers answered their last requests (engine/placement/slurm/handover.py). Stopping cancels the job ids this link
submitted, and nothing else.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Callable

import aiohttp

from engine.placement.slurm import jobs as slurm_jobs
from engine.config.load import Host, RunConfig
from engine.placement.hosts.deploy import host_config
from engine.placement.hosts.link import HostLink
from engine.placement.hosts.ssh import HostError
from engine.api.status import HostStatus, SlurmJobStatus
from engine.placement.hosts.remote_worker import RemoteWorker
from engine.placement.slurm.handover import Successor
from engine.placement.slurm.job_alerts import JobAlerts
from engine.placement.slurm.jobs import JobState, SlurmError, time_left_s, time_left_text
from engine.placement.slurm.plan import (base_port, job_name, jobs_file, layout_of, sbatch_argv, slurm_section,
                                         slurm_work_dir)
from engine.placement.slurm.schedule import Schedule, first_limit_min, limit_text, minutes
from engine.placement.slurm.takeover import Takeover
from engine.placement.slurm.workdir import prepare_work_dir, run_here, write_group_tuning
from engine.placement.slurm.ranks import RankCrashes
from engine.placement.slurm.step import NODE_FILE, group_dir, job_dir
from engine.api.events import AlertEvent, Event
from engine.api.wire import HostState, Severity, WorkerState
from engine.servers.tuning import RunTuning

log = logging.getLogger("regen.slurm")

POLL_S = 2.0
NODE_FILE_WAIT_S = 60.0
RELEASE_WAIT_S = 5.0  # a job cancelled at the run's end: its end is read this long at most (the status shows it)


def group_host(cfg: RunConfig, group: int) -> Host:
    """The group as a [[hosts]]-like entry: its name is its job's name, its work dir the group's dir. Each group
    has ports of its own (base_port + group x servers per group): Slurm may put two groups' jobs on one node."""
    return Host(name=job_name(cfg, group), address=f"slurm partition {slurm_section(cfg).partition}", gpus=cfg.workers.gpus,
                work_dir=str(group_dir(Path(slurm_work_dir(cfg)), group)), host_python=cfg.host_python,
                lan_address="0.0.0.0", base_port=base_port(cfg, group))


def job_status(job: JobState, next_job: str | None = None, waiting_since: float | None = None) -> SlurmJobStatus:
    """A job as the status carries it: Slurm's words, its time left as the operator reads it, whether it ended."""
    return SlurmJobStatus(job_id=job.job_id, state=job.state, reason=job.reason, nodes=job.nodes,
                          time_left=time_left_text(job.time_left) if job.state == "RUNNING" else "",
                          next_job=next_job, waiting_since=waiting_since, ended=not job.active, source=job.source)


class SlurmLink(HostLink):
    # the agent runs on a compute node, where the login node's `kill -0` cannot see it: a job's dir is that job's
    # agent's alone, and whether the job (so its agent) lives is squeue's to say
    AGENT_ALIVE = ""
    def __init__(self, cfg: RunConfig, group: int, *, engine_root: Path, session: aiohttp.ClientSession,
                 emit: Callable[[Event], None], schedule: Schedule | None = None, tuning: RunTuning | None = None):
        # the servers are reached over the cluster network at the node's address (no SSH forwards)
        lan = cfg.model_copy(update={"router": cfg.router.model_copy(update={"link": "lan"})})
        self.group = group
        self.slurm = slurm_section(cfg)  # the run's [slurm] (a link of a run without one is a ValueError here)
        self.group_host = group_host(cfg, group)
        super().__init__(lan, self.group_host, engine_root=engine_root, session=session, emit=emit, forward_base=0,
                         tuning=tuning)
        self.slurm_dir = Path(slurm_work_dir(cfg))
        self.jobs_file = jobs_file(cfg)
        self.job: JobState | None = None
        self.next_job: str | None = None  # submitted at a hand-over, taken by the next join
        self.clock = time.monotonic  # how long a job waits (a test's own clock)
        self.alerts = JobAlerts(self.group_host.name, emit, lambda: self.clock(), self.slurm.pending_alert_s)
        self.ranks = RankCrashes(self.group_host.name, emit)
        self.schedule = schedule or Schedule()  # the run's: its groups' measured timings and job ends
        self.takeover = Takeover(self)  # the hand-overs at the time limits
        self._attached: set[str] = set()  # jobs whose servers this link attached to
        self._life = 0  # the restart count of the job life attached to (a requeue keeps the id, not the life)
        self._slots: dict[str, int] = {}  # each submitted job's port block (0 or 1)
        self._limits: dict[str, int] = {}  # each submitted job's --time, minutes
        self._submitted_at: dict[str, float] = {}
        self._loading_since: float | None = None  # the job runs; its servers are not all proven yet
        for m in self.members:
            m.listeners.append(self._member_changed)

    # -- commands "on the host": the work dir is shared with the nodes ----------------------------
    async def ssh(self, command: str, stdin: bytes | None = None, timeout: float = 60.0) -> tuple[int, str, str]:
        return await run_here(command, stdin, timeout)

    # -- join: the job instead of ssh + agent --------------------------------------------------
    async def deploy(self) -> None:
        cfg = self.group_config()
        await prepare_work_dir(self.slurm_dir, self.group, Path(self.group_host.work_dir), self.engine_root, cfg,
                               self.host_tuning(cfg))

    def group_config(self) -> RunConfig:
        """The config each of the group's jobs runs its agent with (its step binds it to the node)."""
        return host_config(self.cfg, self.group_host).model_copy(update={"slurm": None})

    async def start_agent(self) -> str:
        try:
            if self.next_job is not None:
                job_id, self.next_job = self.next_job, None
                self.job = JobState(job_id, "PENDING")
            elif self.job is None or not self.job.active:
                self.job = JobState(await self.submit(), "PENDING")
            running_since = None
            while not self._stopping:
                self.job = await slurm_jobs.state(self.job.job_id)
                if not self.job.active and self.job.job_id in self._attached:
                    # the job this link served from ended (said once, in Slurm's words): the next one is queued
                    self._ended(await slurm_jobs.final_state(self.job))
                    self.job = JobState(await self.submit(), "PENDING")
                    continue
                if self.job.state == "RUNNING":
                    if running_since is None:
                        running_since = time.monotonic()
                        await self._started(self.job)
                    attached = self._attach(self.job, time.monotonic() - running_since)
                    if attached:
                        return attached
                    await asyncio.sleep(0.2)
                    continue
                running_since = None  # requeued (a node failed, or its launch did): waits again
                if not self.job.active:  # ended before its step ran: resubmitted after the link's backoff
                    self._ended(self.job)
                    raise HostError(f"slurm {self.job.words()}")
                self._pending(self.job)
                await asyncio.sleep(POLL_S)
        except SlurmError as exc:
            raise HostError(str(exc)) from exc
        raise HostError("stopping")

    async def _started(self, job: JobState) -> None:
        """A job seen running for the first time (a life of it): its queue wait and the start of its servers' load
        are measured, its limit kept apart from the other groups'."""
        submitted = self._submitted_at.pop(job.job_id, None)
        if submitted is not None and job.restarts == 0:
            self.schedule.queue_waits.append(self.clock() - submitted)
        if job.job_id not in self._attached:
            self._loading_since = self.clock()
            await self.stagger(job)

    async def stagger(self, job: JobState) -> None:
        """A job that just started: its limit kept out of the other groups' hand-over windows (Takeover.stagger)."""
        new = await self.takeover.stagger(job, self._limits.get(job.job_id))
        if new is not None:
            self._limits[job.job_id] = new

    def slot_of(self, job_id: str) -> int:
        return self._slots.get(job_id, 0)

    def submitted_at(self, job_id: str) -> float:
        """When the job was submitted (the link's clock); its queue wait is measured from then (once)."""
        return self._submitted_at.pop(job_id, self.clock())

    async def submit(self) -> str:
        """sbatch the group's next job: the group's first one with its staggered limit, any later one with time_limit,
        each in the other port block than the job before it."""
        current = self._slots.get(self.job.job_id) if self.job is not None else None
        slot = 0 if current is None else 1 - current
        limit = (first_limit_min(self.slurm, layout_of(self.cfg).groups, self.group) if not self._slots else
                 minutes(self.slurm.time_limit_s))
        argv = sbatch_argv(self.cfg, self.group, time_limit_min=limit, slot=slot)
        # the job starts its servers where the run's record says now (a restart since the last join may have changed
        # one: the next job of a hand-over keeps it)
        try:
            write_group_tuning(Path(self.group_host.work_dir), self.host_tuning(self.group_config()))
        except HostError as exc:
            log.warning("group %s: %s; its next job starts its servers from the record written before", self.host.name,
                        exc)
        job_id = await slurm_jobs.submit(argv, self.jobs_file, self.group)
        self._slots[job_id], self._limits[job_id], self._submitted_at[job_id] = slot, limit, self.clock()
        log.info("group %s: submitted job %s (port block %d, --time=%s)", self.host.name, job_id, slot, limit_text(limit))
        self.emit(AlertEvent(severity=Severity.INFO, text=f"slurm job {job_id} submitted for {self.host.name}",
                             evidence=" ".join(argv), key=f"slurm-submit:{self.host.name}"))
        return job_id

    def port_of(self, m: RemoteWorker, slot: int) -> int:
        """The member's port in a job of port block `slot`."""
        return m.spec.port + base_port(self.cfg, self.group, slot) - base_port(self.cfg, self.group, 0)

    @property
    def loading(self) -> bool:
        """The watched job runs and its servers are not all proven yet (their load is being measured)."""
        return self._loading_since is not None

    def _member_changed(self, m: RemoteWorker, state: str) -> None:
        """Every server of the job proven: its load time (RUNNING to the last one ready) is measured."""
        if state == WorkerState.READY and self._loading_since is not None and all(
                x.state == WorkerState.READY for x in self.members):
            self.schedule.loads.append(self.clock() - self._loading_since)
            self._loading_since = None

    def _pending(self, job: JobState) -> None:
        self.error = f"slurm {job.words()}"
        if self.state != HostState.LOST:
            self.state = HostState.CONNECTING
        self.alerts.pending(job)

    def _attach(self, job: JobState, running_s: float) -> str | None:
        """The running job's node and address (node.json of its step): the members' URLs point there. None while
        the step has not written it yet."""
        here = job_dir(self.slurm_dir, self.group, job.job_id, job.restarts)
        try:
            node = json.loads((here / NODE_FILE).read_text())
        except (FileNotFoundError, ValueError):
            if running_s > NODE_FILE_WAIT_S:
                raise HostError(f"slurm job {job.job_id} runs on {job.nodes} but its step wrote no {NODE_FILE} "
                                f"within {NODE_FILE_WAIT_S:.0f} s; see {self.slurm_dir}/job-{job.job_id}.out") from None
            return None
        self._attached.add(job.job_id)
        self.alerts.started(job)
        self._life = job.restarts
        self.host = self.group_host.model_copy(update={"work_dir": str(here)})
        slot = self._slots.get(job.job_id, 0)
        for m in self.members:
            m.url = f"http://{node['address']}:{self.port_of(m, slot)}"
            m.node, m.job_id = str(node.get("node") or job.nodes), job.job_id
        self.alerts.pending_said = None
        if self.takeover.draining:  # the drain was the last job's hand-over, not the operator's
            self.takeover.draining, self.drained = False, False
        return f"slurm job {job.job_id} running on {node['node']} ({node['address']}), GPUs {node['gpus'] or '?'}"

    # -- watching the job beside the servers ------------------------------------------------------
    async def _watch(self) -> str:
        servers = asyncio.create_task(super()._watch(), name=f"servers-{self.host.name}")
        job = asyncio.create_task(self._watch_job(), name=f"job-{self.host.name}")
        try:
            done, _ = await asyncio.wait({servers, job}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # also when this task is cancelled (the link stopping): asyncio.wait leaves its tasks running, and the job's
            # watcher would see the cancel of the run's end as a job that ended, with an error alert
            for task in (servers, job):
                task.cancel()
            await asyncio.gather(servers, job, return_exceptions=True)
        return next(iter(done)).result()

    async def _watch_job(self) -> str:
        assert self.job is not None
        while not self._stopping:
            if (s := self.takeover.successor) is not None:  # its servers proven: the group moves onto them at once
                try:
                    await asyncio.wait_for(s.ready.wait(), POLL_S)
                    return f"slurm job {s.job_id} takes over from job {self.job.job_id}"
                except asyncio.TimeoutError:
                    pass
            else:
                await asyncio.sleep(POLL_S)
            try:
                self.job = await slurm_jobs.state(self.job.job_id)
            except SlurmError as exc:
                log.warning("group %s: %s", self.host.name, exc)
                continue  # slurmctld busy: the servers' own health still tells
            if self.job.state != "RUNNING" or self.job.restarts != self._life:  # ended, or requeued (maybe run again)
                self.job = await slurm_jobs.final_state(self.job)
                self._ended(self.job)
                return f"slurm {self.job.words()}"
            self.ranks.tell(self.job, job_dir(self.slurm_dir, self.group, self.job.job_id, self.job.restarts))
            left = time_left_s(self.job.time_left)
            if left is not None:
                await self.takeover.at(self.job, left)
        return "stopping"

    def _ended(self, job: JobState) -> None:
        handing_over = self.takeover.draining or self.takeover.successor is not None
        if handing_over and self.next_job and job.state == "CANCELLED" and self.takeover.planned_end(job):
            self.alerts.retired(job, self.next_job, cancelled_by_regen=True)  # drained, cancelled by regen
            return
        self.alerts.ended(job, stopping=self._stopping, taking_over=self.next_job if handing_over else None)

    async def _lose(self, reason: str) -> None:
        """A planned hand-over is the takeover's (info, never a lost host); any other end of the job loses it."""
        if not await self.takeover.job_ended(self.job):
            await super()._lose(reason)

    def took_over(self, s: Successor) -> None:
        """The group serves from the next job of a hand-over now (its members moved onto its servers)."""
        self.job, self._life, self.next_job, self._loading_since = s.job, s.job.restarts, None, None
        self._attached.add(s.job_id)
        self.host = self.group_host.model_copy(update={"work_dir": str(s.here)})
        self.state, self.error = (HostState.DRAINED if self.drained else HostState.UP), None

    def watched_job(self) -> JobState:
        """The job whose servers this link watches (start_agent set it before the watch began)."""
        if self.job is None:
            raise RuntimeError(f"group {self.host.name}: no slurm job is watched (start_agent sets it first)")
        return self.job

    def server_log_where(self, m) -> str:
        """On the filesystem the nodes share with the login node: a path there."""
        return self.server_log(m)

    # -- stop: cancel what this link submitted ------------------------------------------------------
    async def _release(self, stop_agent: bool) -> None:
        """Cancel the jobs this link submitted (the live one, the next one of a hand-over, drained ones not ended yet),
        by id, never by name."""
        retiring = await self.takeover.release()
        live = [j for j in (self.job.job_id if self.job and self.job.active else None, self.next_job, *retiring) if j]
        if stop_agent and live:
            try:
                said = await slurm_jobs.cancel(live)
            except SlurmError as exc:
                said = str(exc)
            if said:
                log.warning("group %s: %s", self.host.name, said)
            else:
                self.next_job = None  # cancelled with it: nothing takes over
            if self.job is not None:
                self.job = await slurm_jobs.read_end(self.job, RELEASE_WAIT_S, self.host.name)

    def status(self) -> HostStatus:
        st = super().status()
        job = self.job
        waiting = self.alerts.waiting if job and self.alerts.waiting and self.alerts.waiting.job_id == job.job_id else None
        st.job = job_status(job, self.next_job, waiting.wall_since if waiting else None) if job else None
        if self._stopping and job is not None and not job.active:
            st.state = HostState.ENDED  # stopped with the run, its job's end read from Slurm (_release)
        return st
