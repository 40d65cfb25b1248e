"""One server group of a [slurm] run, seen from the login node: its Slurm job, and the servers the job's host agent
runs on the node Slurm gave it.

The same link as an SSH host (engine/placement/hosts/link.py: identity proof, health, admission to the router, capacity,
metrics, GPU/disk readings, loss and rejoin), with Slurm where SSH was:
- a (re)join submits the group's job with sbatch (the exact line `regen plan` prints), unless one it submitted is
  still queued or running, and waits while Slurm keeps it PENDING (the reason, e.g. Resources, is the host's
  error in `regen status`); once RUNNING, the step (engine/placement/slurm/step.py) says in node.json which node and address
  its servers are on, and the members' URLs point there (the router reaches them over the cluster network);
- the work dir is on a filesystem the nodes share with the login node, so "running a command on the host" (reading
  identity records and readings) is a local command on that shared dir;
- the job ending (TIMEOUT, CANCELLED by someone else, NODE_FAIL, PREEMPTED) loses the host with an alert in Slurm's
  words; its in-flight requests are re-dispatched and the next join submits a new job; a requeue (preemption in a
  REQUEUE partition, a node failure, `scontrol requeue`) is the same but the next join waits for the same job id's
  next life (its restart count: engine/placement/slurm/step.py's job-<id>.r<N> dir);
- handover_s before the job's time limit (squeue's time left; no signal: it would reach the servers) the group's
  servers are drained (in-flight requests finish) and the next job is queued at once; it takes over when the
  old one ends;
- a group of several nodes is one server across them: rank 0 (the job dir's node.json) is the member; each rank
  > 0 runs under its own agent in the job dir's rank<I>/, and its crash is an alert naming the rank and node;
- stopping cancels the job ids this link submitted, and nothing else.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import aiohttp

from engine.placement.slurm import alerts as job_alerts
from engine.placement.slurm import jobs as slurm_jobs
from engine.config.load import Host, RunConfig, dump_toml
from engine.config.schema import time_limit_seconds
from engine.placement.hosts.link import AGENT_DIR, HostError, HostLink, engine_tarball, host_config
from engine.api.status import HostStatus, SlurmJobStatus
from engine.placement.slurm.jobs import JobState, SlurmError, time_left_text
from engine.placement.slurm.plan import job_name, jobs_file, layout_of, sbatch_argv, slurm_section, slurm_work_dir
from engine.placement.slurm.step import NODE_FILE, group_dir, job_dir
from engine.api.events import AlertEvent, Event
from engine.api.wire import HostState, duration_text
from engine.api.wire import Severity

log = logging.getLogger("regen.slurm")

POLL_S = 2.0
NODE_FILE_WAIT_S = 60.0
FINAL_STATE_WAIT_S = 15.0
RELEASE_WAIT_S = 5.0  # a job cancelled at the run's end: its end is read this long at most (the status shows it)
# pending reasons that are Slurm's routine, told as info: waiting its turn, and the delay Slurm puts on a requeued
# job before it may start again (right after the requeue alert)
ROUTINE_PENDING = ("Priority", "BeginTime")


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


@dataclass
class Waiting:
    """A job seen queued and not yet running (PENDING, CONFIGURING, requeued ...)."""
    job_id: str
    since: float  # the link's clock (monotonic)
    wall_since: float  # time.time(), for the status
    alerted: bool = False


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
        self._pending_said: str | None = None
        self._waiting: Waiting | None = None  # the job not running yet: since when, and whether that was alerted
        self.clock = time.monotonic  # how long a job waits (a test's own clock)
        self._handing_over = False
        self._attached: set[str] = set()  # jobs whose servers this link attached to
        self._said_ended: set[str] = set()
        self._rank_offsets: dict[Path, int] = {}  # how far each rank > 0 agent's telemetry.jsonl was read
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
        if self._pending_said != job.reason and job.given_reason:  # a reason worth saying
            self._pending_said = job.reason
            self.emit(AlertEvent(severity=Severity.INFO if job.given_reason in ROUTINE_PENDING else Severity.WARNING,
                                 text=f"slurm job {job.job_id} ({self.host.name}) is pending: {job.reason}",
                                 evidence=job.words(), key=f"slurm-pending:{self.host.name}"))
        self._pending_too_long(job)

    def _pending_too_long(self, job: JobState) -> None:
        """One alert once the job has waited pending_alert_s (it will not start: Slurm's reason); [notify] sends it."""
        if self._waiting is None or self._waiting.job_id != job.job_id:
            self._waiting = Waiting(job.job_id, self.clock(), time.time())
        waited = self.clock() - self._waiting.since
        if self._waiting.alerted or waited < self.slurm.pending_alert_s:
            return
        no_reason = not job.given_reason  # slurmctld has not evaluated the job yet (seconds after a submit)
        if no_reason and waited < 2 * self.slurm.pending_alert_s:
            return  # the alert is for Slurm's reason: wait a little longer for it
        self._waiting.alerted = True
        reason = "no reason given" if no_reason else job.reason
        self.emit(AlertEvent(
            severity=Severity.WARNING, text=f"slurm job {job.job_id} ({self.host.name}) has been {job.state} for "
                                     f"{duration_text(waited)}: {reason}",
            evidence=f"{job.words()}; Slurm's expected start: squeue -j {job.job_id} --start; the alert's threshold: "
                     f"[slurm] pending_alert_s = {self.slurm.pending_alert_s}",
            key=job_alerts.key(job_alerts.PENDING_LONG, self.host.name, job.job_id)))

    def _started(self, job: JobState) -> None:
        """The job runs: a wait that was alerted ends with an alert of its own (sent too)."""
        waiting, self._waiting = self._waiting, None
        if waiting is None or not waiting.alerted or waiting.job_id != job.job_id:
            return
        self.emit(AlertEvent(
            severity=Severity.INFO, text=f"slurm job {job.job_id} ({self.host.name}) started on {job.nodes} after "
                                  f"{duration_text(self.clock() - waiting.since)} waiting",
            evidence=job.words(), key=job_alerts.key(job_alerts.STARTED, self.host.name, job.job_id)))

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
        self._started(job)
        self._life = job.restarts
        self.host = self.group_host.model_copy(update={"work_dir": str(here)})
        for m in self.members:
            m.url = f"http://{node['address']}:{m.spec.port}"
            m.node, m.job_id = str(node.get("node") or job.nodes), job.job_id
        self._pending_said = None
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
            self._said_ranks()
            left = time_left_s(self.job.time_left)
            if self.next_job is None and left is not None and left <= self.slurm.handover_s:
                await self._hand_over()
        return "stopping"

    def _said_ranks(self) -> None:
        """A server across nodes: a rank > 0 that crashed or failed (its node's agent said so in its telemetry) is
        an alert here naming the rank and its node, once per crash; rank 0's own crash, which follows, is the
        member's."""
        job = self._watched_job()
        here = job_dir(self.slurm_dir, self.group, job.job_id, job.restarts)
        for path in sorted(here.glob("rank*/telemetry.jsonl")):
            offset = self._rank_offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
                node = json.loads((path.parent / NODE_FILE).read_text())
            except (OSError, ValueError):
                continue  # not there yet: read at the next poll
            cut = data.rfind(b"\n") + 1  # a line being written is read whole at the next poll
            self._rank_offsets[path] = offset + cut
            for line in data[:cut].decode(errors="replace").splitlines():
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                key = str(ev.get("key", ""))
                if ev.get("type") != "alert" or not key.startswith("worker:") or not key.endswith((":crash", ":failed")):
                    continue
                self.emit(AlertEvent(
                    severity=ev.get("severity", "error"),
                    text=f"node rank {node.get('node_rank', '?')} of the server of {self.host.name} (job "
                         f"{job.job_id}, node {node.get('node', '?')}): {ev.get('text', '')}; losing a rank ends "
                         "the server, its agent launches the rank again",
                    evidence=f"{ev.get('evidence', '')}\nlog: {path.parent}/workers/", key=key))

    def _ended(self, job: JobState) -> None:
        """The alert for a job that ended, once per job, in Slurm's words (job id, state, reason)."""
        if job.job_id in self._said_ended or self._stopping:  # stopping: regen's own cancel, told in the log
            return
        reason = f" ({job.given_reason})" if job.given_reason else ""
        if job.active:  # requeued (preempted, a node failed, scontrol requeue): the same id runs again once placed
            self.emit(AlertEvent(severity=Severity.ERROR, text=f"slurm job {job.job_id} ({self.host.name}) was requeued "
                                 f"(restart {job.restarts}): {job.state}{reason}; its servers are lost until Slurm "
                                 "runs it again", evidence=job.words() + f", restart count {job.restarts}",
                                 key=job_alerts.key(job_alerts.REQUEUED, self.host.name,
                                                    f"{job.job_id}:{job.restarts}")))
            return
        self._said_ended.add(job.job_id)
        if self._handing_over and self.next_job and job.state == "TIMEOUT":  # the limit a hand-over was made for
            self.emit(AlertEvent(severity=Severity.INFO, text=f"slurm job {job.job_id} ({self.host.name}) reached its time "
                                 f"limit as planned; job {self.next_job} takes over", evidence=job.words(),
                                 key=job_alerts.key(job_alerts.HANDED_OVER, self.host.name, job.job_id)))
            return
        self.emit(AlertEvent(severity=Severity.ERROR, text=f"slurm job {job.job_id} ({self.host.name}) ended: {job.state}"
                             f"{reason}", evidence=job.words(), key=job_alerts.key(job_alerts.ENDED, self.host.name, job.job_id)))

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
        waiting = self._waiting if job and self._waiting and self._waiting.job_id == job.job_id else None
        st.job = job_status(job, self.next_job, waiting.wall_since if waiting else None) if job else None
        if self._stopping and job is not None and not job.active:
            st.state = HostState.ENDED  # stopped with the run, its job's end read from Slurm (_release)
        return st
