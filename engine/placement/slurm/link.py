"""One server group of a [slurm] run, seen from the login node: the host link with Slurm where SSH was.

A join submits the group's job (or waits for the one it submitted, or a requeued job's next life) and attaches to the
node its step names; the job's end loses the host; handover_s before its time limit its servers are drained and the
next job queued; stopping cancels the job ids this link submitted, and nothing else.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import aiohttp

from engine.placement.slurm import jobs as slurm_jobs
from engine.config.load import Host, RunConfig, dump_toml
from engine.config.schema import time_limit_seconds
from engine.placement.hosts.deploy import engine_tarball, host_config
from engine.placement.hosts.link import HostLink
from engine.placement.hosts.ssh import AGENT_DIR, HostError
from engine.api.status import HostStatus, SlurmJobStatus
from engine.placement.slurm.job_alerts import JobAlerts
from engine.placement.slurm.jobs import JobState, SlurmError, time_left_text
from engine.placement.slurm.plan import job_name, jobs_file, layout_of, sbatch_argv, slurm_section, slurm_work_dir
from engine.placement.slurm.ranks import RankCrashes
from engine.placement.slurm.step import NODE_FILE, group_dir, job_dir
from engine.api.events import AlertEvent, Event
from engine.api.wire import HostState
from engine.api.wire import Severity

log = logging.getLogger("regen.slurm")

POLL_S = 2.0
NODE_FILE_WAIT_S = 60.0
FINAL_STATE_WAIT_S = 15.0
RELEASE_WAIT_S = 5.0  # a job cancelled at the run's end: its end is read this long at most (the status shows it)


def time_left_s(text: str) -> int | None:
    """squeue's %L (`9:58`, `1:00:00`, `1-02:00:00`) in seconds; 0 for INVALID (past its limit, not killed yet);
    None for UNLIMITED, NOT_SET."""
    if text.strip() == "INVALID":
        return 0
    try:
        return time_limit_seconds(text)
    except ValueError:
        return None


def group_host(cfg: RunConfig, group: int) -> Host:
    """The group as a [[hosts]]-like entry: its name is its job's name, its work dir the group's dir. Each group
    has ports of its own (base_port + group x servers per group): Slurm may put two groups' jobs on one node."""
    per_group = layout_of(cfg).servers_per_group
    return Host(name=job_name(cfg, group), address=f"slurm partition {slurm_section(cfg).partition}", gpus=cfg.workers.gpus,
                work_dir=str(group_dir(Path(slurm_work_dir(cfg)), group)), host_python=cfg.host_python,
                lan_address="0.0.0.0", base_port=cfg.workers.base_port + group * per_group)


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
                 emit: Callable[[Event], None]):
        # the servers are reached over the cluster network at the node's address (no SSH forwards)
        lan = cfg.model_copy(update={"router": cfg.router.model_copy(update={"link": "lan"})})
        self.group = group
        self.slurm = slurm_section(cfg)  # the run's [slurm] (a link of a run without one is a ValueError here)
        self.group_host = group_host(cfg, group)
        super().__init__(lan, self.group_host, engine_root=engine_root, session=session, emit=emit, forward_base=0)
        self.slurm_dir = Path(slurm_work_dir(cfg))
        self.jobs_file = jobs_file(cfg)
        self.job: JobState | None = None
        self.next_job: str | None = None  # queued at a hand-over, taken by the next join
        self.clock = time.monotonic  # how long a job waits (a test's own clock)
        self.alerts = JobAlerts(self.group_host.name, emit, lambda: self.clock(), self.slurm.pending_alert_s)
        self.ranks = RankCrashes(self.group_host.name, emit)
        self._handing_over = False
        self._attached: set[str] = set()  # jobs whose servers this link attached to
        self._life = 0  # the restart count of the job life attached to (a requeue keeps the id, not the life)

    # -- commands "on the host": the work dir is shared with the nodes ----------------------------
    async def ssh(self, command: str, stdin: bytes | None = None, timeout: float = 60.0) -> tuple[int, str, str]:
        try:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", command, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
        except OSError as exc:
            raise HostError(f"cannot run /bin/sh: {exc}") from exc
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise HostError(f"`{command[:80]}` timed out after {timeout:.0f} s") from None
        rc = await proc.wait()  # communicate() returned once it exited: its exit code, at once
        return rc, out.decode(errors="replace"), err.decode(errors="replace")

    # -- join: the job instead of ssh + agent --------------------------------------------------
    async def deploy(self) -> None:
        engine_dir = self.slurm_dir / AGENT_DIR
        marker = engine_dir / ".deployed-by"
        me = f"supervisor pid {os.getpid()}"  # one deploy per supervisor: every group's job runs from the same copy
        gdir = Path(self.group_host.work_dir)
        try:
            gdir.mkdir(parents=True, exist_ok=True)
            if not marker.exists() or marker.read_text() != me:  # once per supervisor, not under running jobs
                staging = self.slurm_dir / f".engine-{self.group}"
                shutil.rmtree(staging, ignore_errors=True)
                staging.mkdir(parents=True)
                proc = await asyncio.create_subprocess_exec("tar", "-x", "-C", str(staging), "-f", "-",
                                                            stdin=asyncio.subprocess.PIPE)
                await proc.communicate(engine_tarball(self.engine_root))
                if not marker.exists() or marker.read_text() != me:
                    shutil.rmtree(engine_dir, ignore_errors=True)
                    engine_dir.parent.mkdir(parents=True, exist_ok=True)
                    staging.rename(engine_dir)
                    marker.write_text(me)
                else:
                    shutil.rmtree(staging, ignore_errors=True)
            cfg = host_config(self.cfg, self.group_host).model_copy(update={"slurm": None})
            (gdir / "host.toml").write_text(dump_toml(cfg))
        except OSError as exc:
            raise HostError(f"preparing the Slurm work dir {self.slurm_dir}: {exc}") from exc

    async def start_agent(self) -> str:
        try:
            if self.next_job is not None:
                job_id, self.next_job = self.next_job, None
                self.job = JobState(job_id, "PENDING")
            elif self.job is None or not self.job.active:
                self.job = JobState(await self._submit(), "PENDING")
            running_since = None
            while not self._stopping:
                self.job = await slurm_jobs.state(self.job.job_id)
                if not self.job.active and self.job.job_id in self._attached:
                    # the job this link served from ended (said once, in Slurm's words): the next one is queued
                    self._ended(await self._final_state(self.job))
                    self.job = JobState(await self._submit(), "PENDING")
                    continue
                if self.job.state == "RUNNING":
                    running_since = running_since or time.monotonic()
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

    async def _submit(self, after: str | None = None) -> str:
        """sbatch the group's job; `after`: it may start only once that job ended (a hand-over: the new job never
        shares a node's ports with the old one)."""
        argv = sbatch_argv(self.cfg, self.group)
        if after is not None:
            argv.insert(-1, f"--dependency=afterany:{after}")
        job_id = await slurm_jobs.submit(argv, self.jobs_file, self.group)
        log.info("group %s: submitted job %s", self.host.name, job_id)
        self.emit(AlertEvent(severity=Severity.INFO, text=f"slurm job {job_id} submitted for {self.host.name}",
                             evidence=" ".join(argv), key=f"slurm-submit:{self.host.name}"))
        return job_id

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
        for m in self.members:
            m.url = f"http://{node['address']}:{m.spec.port}"
            m.node, m.job_id = str(node.get("node") or job.nodes), job.job_id
        self.alerts.pending_said = None
        if self._handing_over:  # the drain was the last job's hand-over, not the operator's
            self._handing_over, self.drained = False, False
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
            await asyncio.sleep(POLL_S)
            try:
                self.job = await slurm_jobs.state(self.job.job_id)
            except SlurmError as exc:
                log.warning("group %s: %s", self.host.name, exc)
                continue  # slurmctld busy: the servers' own health still tells
            if self.job.state != "RUNNING" or self.job.restarts != self._life:  # ended, or requeued (maybe run again)
                self.job = await self._final_state(self.job)
                self._ended(self.job)
                return f"slurm {self.job.words()}"
            self.ranks.tell(self.job, job_dir(self.slurm_dir, self.group, self.job.job_id, self.job.restarts))
            left = time_left_s(self.job.time_left)
            if self.next_job is None and left is not None and left <= self.slurm.handover_s:
                await self._hand_over()
        return "stopping"

    def _ended(self, job: JobState) -> None:
        self.alerts.ended(job, stopping=self._stopping, taking_over=self.next_job if self._handing_over else None)

    async def _final_state(self, job: JobState) -> JobState:
        """A job COMPLETING is on its way out: wait a little for the state it ends in (CANCELLED, TIMEOUT,
        NODE_FAIL ...), which is what the operator is told."""
        deadline = time.monotonic() + FINAL_STATE_WAIT_S
        while job.state == "COMPLETING" and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            try:
                job = await slurm_jobs.state(job.job_id)
            except SlurmError:
                break  # the last state seen is said
        return job

    async def _hand_over(self) -> None:
        """The time limit is near: no new work for these servers, the next job queued now."""
        self._handing_over = True
        self.set_drained(True)
        try:
            self.next_job = await self._submit(after=self._watched_job().job_id)
        except SlurmError as exc:
            self.emit(AlertEvent(severity=Severity.ERROR, text=f"the next slurm job for {self.host.name} was not submitted",
                                 evidence=str(exc), key=f"slurm-handover:{self.host.name}"))
            return
        job = self._watched_job()
        self.emit(AlertEvent(severity=Severity.INFO, text=f"slurm job {job.job_id} ({self.host.name}) nears its time "
                             f"limit: its servers are drained, job {self.next_job} queued to take over",
                             evidence=job.words() + f", time left {time_left_text(job.time_left)}",
                             key=f"slurm-handover:{self.host.name}"))

    def _watched_job(self) -> JobState:
        """The job whose servers this link watches (start_agent set it before the watch began)."""
        if self.job is None:
            raise RuntimeError(f"group {self.host.name}: no slurm job is watched (start_agent sets it first)")
        return self.job

    def server_log_where(self, m) -> str:
        """On the filesystem the nodes share with the login node: a path there."""
        return self.server_log(m)

    # -- stop: cancel what this link submitted ------------------------------------------------------
    async def _release(self, stop_agent: bool) -> None:
        """Cancel the jobs this link submitted (the live one and a queued successor), by id, never by name."""
        live = [j for j in (self.job.job_id if self.job and self.job.active else None, self.next_job) if j]
        if stop_agent and live:
            try:
                said = await slurm_jobs.cancel(live)
            except SlurmError as exc:
                said = str(exc)
            if said:
                log.warning("group %s: %s", self.host.name, said)
            else:
                self.next_job = None  # cancelled with it: nothing takes over
            await self._read_end()

    async def _read_end(self) -> None:
        """The job's state once cancelled, as Slurm says it (CANCELLED, or COMPLETING for a moment): what the status
        shows from now on, not the RUNNING read before the cancel. Read for at most RELEASE_WAIT_S."""
        if self.job is None:
            return
        deadline = time.monotonic() + RELEASE_WAIT_S
        while True:
            try:
                self.job = await slurm_jobs.state(self.job.job_id)
            except SlurmError as exc:
                log.warning("group %s: the state of job %s after its cancel: %s", self.host.name, self.job.job_id, exc)
                return
            if not self.job.active or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.5)
        log.info("group %s: %s%s", self.host.name, self.job.words(), "" if not self.job.active else
                 f" {RELEASE_WAIT_S:.0f} s after its cancel (its end is read again by `regen status` once the "
                 "supervisor is gone)")

    def status(self) -> HostStatus:
        st = super().status()
        job = self.job
        waiting = self.alerts.waiting if job and self.alerts.waiting and self.alerts.waiting.job_id == job.job_id else None
        st.job = job_status(job, self.next_job, waiting.wall_since if waiting else None) if job else None
        if self._stopping and job is not None and not job.active:
            st.state = HostState.ENDED  # stopped with the run, its job's end read from Slurm (_release)
        return st
