"""One remote GPU host of a multi-host run, seen from the dispatch host: deploy the engine, start the host agent, open
the forwards, watch its servers until the host is lost, and join again with backoff.

A server joins the router only once its identity is proven twice (admission.py); a host whose servers all stop
answering for router.host_lost_after_s is lost: its servers leave the router and their open requests are re-dispatched.
"""
from __future__ import annotations

import asyncio
import logging
import shlex
import time
from pathlib import Path
from typing import Callable

import aiohttp

from engine.api.events import AlertEvent, Event
from engine.api.wire import AlertKind, HostState, Severity
from engine.config.load import Host, RunConfig, dump_toml, host_workers
from engine.api.status import HostStatus
from engine.placement.hosts.admission import AgentRecords
from engine.placement.hosts.deploy import engine_tarball, host_config, host_specs
from engine.placement.hosts.readings import READINGS_FILE
from engine.placement.hosts.readings_feed import ReadingsFeed, ReadingsUnavailable
from engine.placement.hosts.remote_worker import ENDED, GONE, RemoteWorker, health, scrape, server_log
from engine.placement.hosts.ssh import (
    AGENT_DIR, AGENT_STOP_WAIT_S, SSH_TIMEOUT_S, HostError, SshTunnel, agent_stop_command, free_local_port, run_ssh,
)
from engine.servers.capacity import ServerCapacity, configured_batch, discover
from engine.api.wire import WorkerState
from engine.servers.polling import read_server_info
from engine.servers.tuning import RunTuning
from engine.servers.tuning_record import RECORD_FILE, TuningRecord, record_json
from probes.shell import shell_path

log = logging.getLogger("regen.hosts")

POLL_S = 1.0
METRICS_EVERY_S = 2.0
MAX_BACKOFF_S = 30.0


class HostLink:
    # the agent's pid only if it lives (`kill -0` says why not on stderr, read with the rest)
    AGENT_ALIVE = '&& kill -0 "$p"'
    def __init__(self, cfg: RunConfig, host: Host, *, engine_root: Path, session: aiohttp.ClientSession,
                 emit: Callable[[Event], None], forward_base: int, tuning: RunTuning | None = None):
        self.cfg = cfg
        self.tuning = tuning  # the run's --schedule-conservativeness record (its one owner: the supervisor)
        self.host = host
        self.engine_root = engine_root
        self.session = session
        self.emit = emit
        self.state = HostState.CONNECTING
        self.error: str | None = None
        self.joins = 0
        self.lost_count = 0
        self.specs = host_specs(cfg, host)
        lan = cfg.router.link == "lan"
        self.forward_ports = {s.name: (s.port if lan else free_local_port(forward_base + i))
                              for i, s in enumerate(self.specs)}
        headers = {"Authorization": f"Bearer {cfg.workers.api_key}"} if cfg.workers.api_key else {}
        self.members = [
            RemoteWorker(spec=s, host=host.name, headers=headers,
                         url=(s.url if lan else f"http://127.0.0.1:{self.forward_ports[s.name]}"))
            for s in self.specs]
        self._stopping = False
        self.drained = False
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self.log_path = Path(cfg.run_dir) / "hosts" / host.name / "link.log"
        self.tunnel = SshTunnel(host, {self.forward_ports[s.name]: s.port for s in self.specs}, self.log_path)
        self.records = AgentRecords(lambda: self.host, lambda *a, **kw: self.ssh(*a, **kw), emit, session,
                                    self.AGENT_ALIVE, tuning)
        self.readings = ReadingsFeed(host.name, self._fetch_readings, emit)
        self._readings_task: asyncio.Task | None = None

    # -- public -----------------------------------------------------------------------------
    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._run(), name=f"host-{self.host.name}")

    async def stop(self, stop_agent: bool = True) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._stop_readings()
        await self._release(stop_agent)
        self.state = HostState.STOPPED
        for m in self.members:
            m.set_state(WorkerState.STOPPED)

    async def _release(self, stop_agent: bool) -> None:
        """What this link holds on the host once its loop is stopped: the tunnel, and the agent if asked."""
        await self.tunnel.close()
        if stop_agent:
            try:
                rc, out, err = await self.ssh(agent_stop_command(self.host), timeout=AGENT_STOP_WAIT_S + 10)
                if rc != 0:
                    log.warning("host %s: stopping the agent failed: %s", self.host.name, (err or out).strip())
            except HostError as exc:
                log.warning("host %s: cannot stop its agent: %s", self.host.name, exc)

    def set_drained(self, drained: bool) -> None:
        self.drained = drained
        if self.state in (HostState.UP, HostState.DRAINED):
            self.state = HostState.DRAINED if drained else HostState.UP
        for m in self.members:
            if drained and m.state == WorkerState.READY:
                m.set_state(HostState.DRAINED)  # leaves the router; its open requests still answer
            elif not drained and m.state == HostState.DRAINED:
                m.set_state(WorkerState.STARTING)  # the next health pass makes it ready: back in the router

    @property
    def failed(self) -> bool:
        """Reached, and every server of it failed: nothing more comes from it unless restarted."""
        return bool(self.members) and all(m.state == WorkerState.FAILED for m in self.members)

    def status(self) -> HostStatus:
        if self.failed and self.state in (HostState.UP, HostState.DRAINED):
            return HostStatus(name=self.host.name, address=self.host.address, state=HostState.FAILED,
                              error="every server failed: " + "; ".join(f"{m.name}: {m.error}" for m in self.members),
                              workers=[m.name for m in self.members], work_dir=self.host.work_dir, joins=self.joins,
                              lost=self.lost_count)
        return HostStatus(name=self.host.name, address=self.host.address, state=self.state, error=self.error,
                          workers=[m.name for m in self.members], work_dir=self.host.work_dir, joins=self.joins,
                          lost=self.lost_count)

    # -- ssh ---------------------------------------------------------------------------------
    async def ssh(self, command: str, stdin: bytes | None = None, timeout: float = SSH_TIMEOUT_S
                  ) -> tuple[int, str, str]:
        return await run_ssh(self.host, command, stdin, timeout)

    async def _checked(self, what: str, command: str, stdin: bytes | None = None) -> str:
        rc, out, err = await self.ssh(command, stdin)
        if rc != 0:
            raise HostError(f"{what} failed on {self.host.name} (exit {rc}): {err.strip() or out.strip() or '(no output)'}")
        return out

    # -- join -------------------------------------------------------------------------------
    async def deploy(self) -> None:
        wd = shell_path(self.host.work_dir)
        await self._checked("creating the work dir", f"mkdir -p {wd}/{AGENT_DIR} && chmod 700 {wd}")
        await self._checked("copying the engine",
                            f"rm -rf {wd}/{AGENT_DIR} && mkdir -p {wd}/{AGENT_DIR} && tar -x -C {wd}/{AGENT_DIR} -f -",
                            stdin=engine_tarball(self.engine_root))
        cfg = host_config(self.cfg, self.host)
        record = self.host_tuning(cfg)
        # a record of an earlier run (or start) in the work dir goes: the agent starts from this run's alone
        await self._checked("writing host.toml", f"rm -f {wd}/{RECORD_FILE} && cat > {wd}/host.toml",
                            stdin=dump_toml(cfg).encode())
        if record is not None:
            tmp = f"{wd}/.{RECORD_FILE}.tmp"
            await self._checked(f"writing {RECORD_FILE}", f"cat > {tmp} && mv -f {tmp} {wd}/{RECORD_FILE}",
                                stdin=record_json(record).encode())

    def host_tuning(self, host_cfg: RunConfig) -> TuningRecord | None:
        """Where the host's servers start (engine.servers.tuning.RunTuning.host_record); None: SGLang's default or
        the operator's value, said by the host's config."""
        return self.tuning.host_record(host_cfg, [s.name for s in self.specs]) if self.tuning is not None else None

    async def start_agent(self) -> str:
        wd = shell_path(self.host.work_dir)
        py = shlex.quote(self.host.host_python)
        name = shlex.quote(self.host.name)
        # the braces keep `&` on the agent alone: a backgrounded `cd && ...` list would be a subshell
        # holding the ssh channel open until the agent exits
        command = (f"cd {wd} && {{ PYTHONPATH={wd}/{AGENT_DIR} setsid nohup {py} -m engine.placement.hosts.agent --work-dir . "
                   f"--host-name {name} >> agent.log 2>&1 < /dev/null & }} && sleep 0.5"
                   " && { [ -f agent.pid ] && cat agent.pid || echo 'agent.pid not written yet'; };"
                   f" tail -n 2 agent.log")
        return await self._checked("starting the host agent", command)

    async def open_tunnel(self) -> None:
        if self.cfg.router.link != "lan":
            await self.tunnel.open()

    # -- the loop ---------------------------------------------------------------------------
    async def _run(self) -> None:
        backoff = 1.0
        while not self._stopping:
            self.state = HostState.CONNECTING if self.joins == 0 else self.state
            try:
                await self.deploy()
                agent = await self.start_agent()
                log.info("host %s: agent: %s", self.host.name, agent.strip().replace("\n", " | "))
                await self.open_tunnel()
            except HostError as exc:
                await self.tunnel.close()
                self._unreachable(str(exc))
                await self._sleep(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)
                continue
            backoff = 1.0
            rejoined = self.state == HostState.LOST
            self.state, self.error = (HostState.DRAINED if self.drained else HostState.UP), None
            self.joins += 1
            if rejoined:
                self.emit(AlertEvent(severity=Severity.INFO, text=f"host {self.host.name} rejoined; it gets work again",
                                     evidence=f"{self.host.address}: link up, agent running", key=f"host-rejoin:{self.host.name}"))
            # the link is up: unreachable / lost end (raised by this link, or by an earlier supervisor of the run;
            # telemetry says nothing when neither is raised)
            for key, what in ((f"host-unreachable:{self.host.name}", "can be reached"),
                              (f"host-lost:{self.host.name}", "is back")):
                self.emit(AlertEvent(severity=Severity.INFO, key=key, kind=AlertKind.CLEARED,
                                     text=f"cleared: host {self.host.name} {what}",
                                     evidence=f"{self.host.address}: link up, agent running"))
            log.info("host %s: up (join %d)", self.host.name, self.joins)
            self._readings_task = asyncio.create_task(self.readings.run(), name=f"readings-{self.host.name}")
            try:
                reason = await self._watch()
            finally:
                await self._stop_readings()
            if self._stopping:
                return
            await self._lose(reason)
            await self._sleep(2.0)

    def _unreachable(self, why: str) -> None:
        first = self.error != why
        self.error = why
        for m in self.members:
            m.set_state(WorkerState.UNREACHABLE if m.state != WorkerState.STOPPED else m.state, why)
        if self.state != HostState.LOST:
            self.state = HostState.LOST if self.joins else HostState.CONNECTING
        self.readings.mark_stale("the host cannot be reached")  # why: in its host row and alert
        if first:
            log.warning("host %s: %s", self.host.name, why)
            self.emit(AlertEvent(severity=Severity.ERROR, text=f"host {self.host.name} cannot be reached", evidence=why,
                                 key=f"host-unreachable:{self.host.name}", kind=AlertKind.RAISED))

    async def _lose(self, reason: str) -> None:
        self.lost_count += 1
        self.state, self.error = HostState.LOST, reason
        for m in self.members:
            m.set_state(WorkerState.LOST, reason)
        self.readings.mark_stale("the host is lost")
        # requests open through the forwards fail now instead of at their timeouts: re-dispatched
        await self.tunnel.close()
        log.error("host %s lost: %s", self.host.name, reason)
        self.emit(AlertEvent(severity=Severity.ERROR, text=f"host {self.host.name} lost: its in-flight samples are"
                             " re-dispatched to the other hosts", evidence=reason, key=f"host-lost:{self.host.name}",
                             kind=AlertKind.RAISED))

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass  # backoff over

    async def _watch(self) -> str:
        """Poll the members until the host is lost; returns why."""
        next_metrics = 0.0
        lost_after = self.cfg.router.host_lost_after_s
        for m in self.members:
            m.unhealthy_since = None
            m.ready_this_join = m.state == WorkerState.READY  # a [slurm] hand-over proved them before this join
            if m.state in GONE:
                m.set_state(WorkerState.STARTING)
        while not self._stopping:
            if (exited := self.tunnel.exit_reason()) is not None:
                return exited
            now = time.monotonic()
            results = await asyncio.gather(*(health(self.session, m) for m in self.members))
            for m, (ok, why) in zip(self.members, results):
                if ok:
                    m.unhealthy_since = None
                    if self.drained:
                        if m.state != HostState.DRAINED:
                            m.set_state(HostState.DRAINED)
                    elif m.state != WorkerState.READY and await self.records.admit(m):
                        await self._read_capacity(m)
                        m.ready_this_join = True
                        m.set_state(WorkerState.READY)
                else:
                    if m.unhealthy_since is None:
                        m.unhealthy_since = now
                    if m.state == WorkerState.READY:
                        m.set_state(WorkerState.LOADING, why)  # out of the router until healthy again
                    elif m.state == WorkerState.REFUSED:
                        await self.records.recheck_refused(m)
                    elif not self.records.mirror(m, (await self.records.read()).get(m.name)):
                        m.error = why
            # servers still loading (minutes for a 27B model) are not a lost host; ready ones that all
            # stop answering are (a cut link is usually caught sooner: ssh's ServerAlive ends the forwards),
            # unless the agent says they crashed: then the host answers, its servers do not
            if any(m.ready_this_join for m in self.members) and not any(m.state in ENDED for m in self.members) and all(
                    m.unhealthy_since is not None and now - m.unhealthy_since >= lost_after for m in self.members):
                return f"no server answered /health for {lost_after:.0f} s: " + "; ".join(
                    f"{m.name}: {m.error}" for m in self.members)
            if now >= next_metrics:
                next_metrics = now + METRICS_EVERY_S
                ready = [m for m in self.members if m.state == WorkerState.READY]
                # a drained server still runs what it was sent: its gauges are read as long as it answers
                serving = ready + [m for m in self.members if m.state == HostState.DRAINED]
                await asyncio.gather(*(scrape(self.session, m) for m in serving), *(self.records.still_admitted(m) for m in ready))
            await asyncio.sleep(POLL_S)
        return "stopping"

    def server_log(self, m: RemoteWorker) -> str:
        return server_log(self.host.work_dir, m)

    def server_log_where(self, m: RemoteWorker) -> str:
        """The server's log as the operator would find it: on its host."""
        return f"{self.host.name}:{self.server_log(m)}"

    # -- the agent's readings of its host -----------------------------------------------------
    async def _fetch_readings(self) -> str:
        path = f"{shell_path(self.host.work_dir)}/{READINGS_FILE}"
        try:
            rc, out, err = await self.ssh(f"cat {path}", timeout=20)
        except HostError as exc:
            raise ReadingsUnavailable(str(exc)) from exc
        if rc != 0:
            raise ReadingsUnavailable(f"reading {READINGS_FILE} failed (exit {rc}): {err.strip() or '(no output)'}")
        return out

    async def _stop_readings(self) -> None:
        task, self._readings_task = self._readings_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _read_capacity(self, m: RemoteWorker, records: AgentRecords | None = None) -> None:
        """Its batch size as a local worker finds it (engine/servers/capacity.py): the start-up log line is on the
        host, so the host agent's identity record (in `records`, default this link's) carries it."""
        reported = await read_server_info(self.session, m.url, m.headers, m.name)
        if reported is None:
            reported = ServerCapacity(max_total_num_tokens=m.capacity_info.max_total_num_tokens,
                                      context_length=m.capacity_info.context_length,
                                      max_req_input_len=m.capacity_info.max_req_input_len)
        record = (records or self.records).by_name.get(m.name)
        workers = host_workers(self.cfg, self.host)
        m.capacity_info = discover(reported, record.startup_batch if record else None,
                                   configured_batch(workers.launch, workers.extra_args))
        log.info("worker %s: batch size %d (source %s)", m.name, m.capacity_info.batch().size,
                 m.capacity_info.batch().source)
