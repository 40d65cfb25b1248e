"""One remote GPU host of a multi-host run, seen from the dispatch host.

The dispatch host reaches each remote host with its own OpenSSH client (`ssh`, keys and config
of the dispatch host, plus `[[hosts]].ssh_options`). On every (re)join the link:

1. copies the engine there (`tar | ssh tar -x` into <work_dir>/.regen/engine) with host.toml;
2. starts the host agent (`python -m engine.placement.hosts.agent`, detached with setsid/nohup; an agent
   that already runs keeps running and the new one exits at once), which supervises the host's
   SGLang servers with the same Worker code as a one-host run;
3. opens one `ssh -N -L` process forwarding a dispatch-host loopback port to each server's
   127.0.0.1 port (SGLang stays bound to loopback on the host), unless router.link = "lan";
4. watches each server through its forward (/health, /metrics, /get_server_info), and reads the
   agent's GPU and disk readings of its host (engine/placement/hosts/readings_feed.py: N/A once they stop).

A server joins the router only once its identity is proven twice: the host agent's Worker proved
on the host that it is its own launch (free port, per-launch served-model-name, socket owned by the
launched tree) and wrote so in workers/<name>/identity.json; and through the forward the server
answers with that same name (so the forward reaches that server, not another one on the port). An
agent's refusal shows here as a `refused` member with the agent's reason and a critical alert.

A link that dies or servers unreachable for `router.host_lost_after_s` make the host *lost*: an
alert, its servers leave the router (the fleet listens to their states), the forwards are killed
so every request still open through them fails now and is re-dispatched, and the link retries
with backoff until the host answers again (rejoin, another alert).
"""
from __future__ import annotations

import asyncio
import io
import logging
import os
import shlex
import signal
import socket
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import aiohttp

from engine.api.wire import AlertKind, HostState, InFlightSource, Severity
from engine.servers.capacity import BatchSize, ServerCapacity, configured_batch, discover
from engine.config.load import Host, RunConfig, Workers, dump_toml, host_workers
from engine.placement.hosts.readings import READINGS_FILE
from engine.placement.hosts.readings_feed import ReadingsFeed, ReadingsUnavailable
from engine.servers.metrics_client import ServerMetrics, parse_metrics
from engine.api.status import HostStatus
from engine.servers.identity import IdentityCheck, ServedNames, Verdict, read_served_names
from engine.servers.target import SingleServer
from engine.api.events import AlertEvent, Event, WorkerEvent
from engine.servers.workers import (
    IDENTITY_FILE, IdentityRecord, WorkerSpec, WorkerState, die_with_parent, read_server_info, worker_event,
)
from probes.shell import shell_path

if TYPE_CHECKING:
    from engine.run.counts import ServedTokens

log = logging.getLogger("regen.hosts")

AGENT_DIR = ".regen/engine"
POLL_S = 1.0
METRICS_EVERY_S = 2.0
SSH_TIMEOUT_S = 60.0
AGENT_STOP_WAIT_S = 20.0  # an agent stops each server within STOP_GRACE_S (engine.servers.workers)
FORWARD_READY_S = 20.0
MAX_BACKOFF_S = 30.0
IDENTITY_REFRESH_S = 2.0  # the agents' identity records are read over ssh at most this often
ENDED = (WorkerState.CRASHED, WorkerState.FAILED)
# a server whose host (or job) is not there: what was last read of it is not live
GONE = (WorkerState.UNREACHABLE, WorkerState.LOST, WorkerState.STOPPED)


class HostError(Exception):
    """A step towards a remote host failed; the message says which step and what ssh said."""


def named_specs(workers: Workers, host_name: str) -> list[WorkerSpec]:
    """One server per GPU group, named <host>.gpu<ids> so names stay unique across hosts."""
    return [WorkerSpec(name=f"{host_name}.gpu" + "-".join(str(g) for g in group), gpus=group, host=workers.host,
                       port=workers.base_port + i)
            for i, group in enumerate(workers.groups())]


def host_specs(cfg: RunConfig, host: Host) -> list[WorkerSpec]:
    return named_specs(host_workers(cfg, host), host.name)


def host_config(cfg: RunConfig, host: Host) -> RunConfig:
    """The config a host agent runs with: this host's workers and nothing of the others."""
    return cfg.model_copy(update=dict(run_dir=host.work_dir, host_python=host.host_python,
                                      workers=host_workers(cfg, host), hosts=())).with_source(None)


def engine_tarball(engine_root: Path) -> bytes:
    """engine/ and probes/ (.py files) as an uncompressed tar, for `ssh host tar -x`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for pkg in ("engine", "probes"):
            for f in sorted((engine_root / pkg).rglob("*.py")):
                if "__pycache__" not in f.parts:
                    tar.add(f, arcname=str(f.relative_to(engine_root)))
    return buf.getvalue()


@dataclass
class RemoteWorker(SingleServer):  # a dispatch target (engine.servers.target.DispatchTarget)
    """An SGLang server on a remote host, watched through its forward; launched by the host agent."""
    spec: WorkerSpec
    host: str
    url: str
    headers: dict[str, str]
    state: str = WorkerState.STARTING
    pid: int | None = None
    restarts: int = 0
    error: str | None = None
    capacity_info: ServerCapacity = field(default_factory=ServerCapacity)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    # behind the router (always, in a multi-host run): the router's count of requests open on it, or None where the
    # router keeps none or the server has no live figure (engine.placement.router.RouterEndpoint.refresh)
    in_flight: int | None = 0
    in_flight_source: str = InFlightSource.DISPATCH
    held: int = 0
    capacity: int = 0
    batch: BatchSize | None = None  # set by a dispatcher that sends to it directly (the router's members: never)
    node: str = ""  # a [slurm] group's server: the node its job runs on (pid is that node's)
    job_id: str = ""  # a [slurm] group's server: its job
    listeners: list[Callable[["RemoteWorker", str], None]] = field(default_factory=list)
    unhealthy_since: float | None = None
    ready_this_join: bool = False
    served_model_name: str | None = None  # the proven name it was admitted with (None: not admitted)
    last_error_lines: list[str] = field(default_factory=list)  # its last crash's fatal lines, as its agent read them
    agent_seen: tuple = ()  # the agent's (state, restarts, pid) last mirrored
    crashes_told: tuple[int | None, int] = (None, 0)  # (agent pid, its crash count) told: each crash told once
    served: ServedTokens | None = None  # the ledger's ServedTokens when it is a dispatch target (behind a router: None)

    @property
    def name(self) -> str:
        return self.spec.name

    def restart(self) -> None:
        raise NotImplementedError(f"{self.name} runs on host {self.host}: restart it there (its host agent"
                                  " restarts crashed servers itself)")

    def set_state(self, state: str, error: str | None = None) -> None:
        self.error = error
        if state in GONE or state in ENDED:
            self.drop_live_figures()
        if state == self.state:
            return
        log.info("worker %s: %s -> %s%s", self.name, self.state, state, f" ({error})" if error else "")
        self.state = state
        for listener in list(self.listeners):
            listener(self, state)

    def drop_live_figures(self) -> None:
        """Its host or job is gone (lost, unreachable, stopped): no reading of it is live any more. Its gauges, pid and
        in-flight count go (N/A), not kept at their last values; they come back with the next reading once it
        answers again."""
        self.metrics = ServerMetrics()
        self.pid = None
        self.in_flight = None

    def snapshot(self) -> WorkerEvent:
        return worker_event(self, host=self.host, remote=True)


def admit_remote(record: IdentityRecord | None, answer: ServedNames, where: str) -> IdentityCheck:
    """Whether a remote server may join the router: its host agent proved it is its own launch, and
    the server reached at `where` answers with that launch's name."""
    if record is None:
        return IdentityCheck(Verdict.PENDING, f"the host agent has not recorded this server's identity yet ({IDENTITY_FILE})")
    if record.state == WorkerState.REFUSED:
        return IdentityCheck(Verdict.FOREIGN, f"the host agent refused it: {record.error}", names=answer.names)
    if record.state != WorkerState.READY or not record.served_model_name:
        return IdentityCheck(Verdict.PENDING, f"the host agent has not proven it yet (its state: {record.state})")
    if record.served_model_name in answer.names:
        return IdentityCheck(Verdict.PROVEN, f"{where} answers as {record.served_model_name!r}, the host agent's "
                             f"proven launch (pid {record.pid})", names=answer.names)
    if not answer.names:
        return IdentityCheck(Verdict.PENDING, f"{where} does not say its name yet ({answer.error})")
    return IdentityCheck(Verdict.FOREIGN, f"{where} answers as {', '.join(map(repr, answer.names))}, but the host "
                         f"agent's launch on port {record.port} (pid {record.pid}) is {record.served_model_name!r}: "
                         "another server answers there", names=answer.names)


def parse_identity_records(text: str) -> tuple[dict[str, IdentityRecord], list[str]]:
    """The records `cat workers/*/identity.json` printed, by worker name, and the lines that did not parse."""
    records, bad = {}, []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = IdentityRecord.from_json(line)
        except (ValueError, KeyError, TypeError) as exc:
            bad.append(f"{line[:120]!r}: {exc}")
            continue
        records[rec.name] = rec
    return records, bad


AGENT_LINE = "agent "


def live_records(text: str) -> tuple[dict[str, IdentityRecord], list[str]]:
    """The records of the live agent from `_identity_records`' output: its first line `agent <pid>` (`agent none`
    when no agent runs), then the records. A record another agent wrote (one that has gone since, whose servers'
    failures are not this run's) is dropped; one from an agent before the field is kept."""
    head, _, rest = text.partition("\n")
    pid_text = head.removeprefix(AGENT_LINE).strip() if head.startswith(AGENT_LINE) else ""
    if not pid_text.isdigit():
        return {}, [] if head.startswith(AGENT_LINE) else [f"no agent line: {head[:120]!r}"]
    records, bad = parse_identity_records(rest)
    return {k: r for k, r in records.items() if r.agent_pid in (None, int(pid_text))}, bad


def _free_local_port(preferred: int) -> int:
    for port in [preferred] + [0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise HostError("no free loopback port for an SSH forward")


class HostLink:
    # the agent's pid only if it lives (`kill -0` says why not on stderr, read with the rest)
    AGENT_ALIVE = '&& kill -0 "$p"'
    def __init__(self, cfg: RunConfig, host: Host, *, engine_root: Path, session: aiohttp.ClientSession,
                 emit: Callable[[Event], None], forward_base: int):
        self.cfg = cfg
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
        self.forward_ports = {s.name: (s.port if lan else _free_local_port(forward_base + i))
                              for i, s in enumerate(self.specs)}
        headers = {"Authorization": f"Bearer {cfg.workers.api_key}"} if cfg.workers.api_key else {}
        self.members = [
            RemoteWorker(spec=s, host=host.name, headers=headers,
                         url=(s.url if lan else f"http://127.0.0.1:{self.forward_ports[s.name]}"))
            for s in self.specs]
        self._tunnel: asyncio.subprocess.Process | None = None
        self._stopping = False
        self.drained = False
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self.log_path = Path(cfg.run_dir) / "hosts" / host.name / "link.log"
        self._records: dict[str, IdentityRecord] = {}
        self._records_at = float("-inf")
        self._records_error = ""
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
        await self._close_tunnel()
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

    # -- ssh --------------------------------------------------------------------------------
    def ssh_argv(self, *extra: str) -> list[str]:
        return ssh_argv(self.host, *extra)

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
        await self._checked("writing host.toml", f"cat > {wd}/host.toml", stdin=dump_toml(cfg).encode())

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
        if self.cfg.router.link == "lan":
            return
        forwards: list[str] = []
        for s in self.specs:
            forwards += ["-L", f"127.0.0.1:{self.forward_ports[s.name]}:127.0.0.1:{s.port}"]
        argv = self.ssh_argv("-N", "-o", "ExitOnForwardFailure=yes", *forwards)
        logf = open(self.log_path, "ab")
        try:
            logf.write(f"[regen {time.strftime('%H:%M:%S')}] {shlex.join(argv)}\n".encode())
            logf.flush()
            self._tunnel = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True,
                preexec_fn=die_with_parent)
        except OSError as exc:
            raise HostError(f"cannot run ssh for the port forwards: {exc}") from exc
        finally:
            logf.close()
        deadline = time.monotonic() + FORWARD_READY_S
        pending = set(self.forward_ports.values())
        while pending and time.monotonic() < deadline:
            if self._tunnel.returncode is not None:
                raise HostError(f"the SSH port forwards to {self.host.address} exited ({self._tunnel.returncode}):"
                                f" {self._link_log_tail()}")
            for port in list(pending):
                try:
                    _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1.0)
                    writer.close()
                    pending.discard(port)
                except (OSError, asyncio.TimeoutError):
                    pass  # not listening yet
            if pending:
                await asyncio.sleep(0.1)
        if pending:
            raise HostError(f"the SSH port forwards to {self.host.address} did not listen within {FORWARD_READY_S:.0f} s")

    def _link_log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-3:])

    async def _close_tunnel(self) -> None:
        proc, self._tunnel = self._tunnel, None
        if proc is not None and proc.returncode is None:
            _kill_group(proc.pid)
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except asyncio.TimeoutError:
                log.warning("host %s: ssh forward pid %d did not exit", self.host.name, proc.pid)

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
                await self._close_tunnel()
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
        await self._close_tunnel()
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
            m.ready_this_join = False
            if m.state in GONE:
                m.set_state(WorkerState.STARTING)
        while not self._stopping:
            if self._tunnel is not None and self._tunnel.returncode is not None:
                return f"the SSH port forwards exited ({self._tunnel.returncode}): {self._link_log_tail()}"
            now = time.monotonic()
            results = await asyncio.gather(*(self._health(m) for m in self.members))
            for m, (ok, why) in zip(self.members, results):
                if ok:
                    m.unhealthy_since = None
                    if self.drained:
                        if m.state != HostState.DRAINED:
                            m.set_state(HostState.DRAINED)
                    elif m.state != WorkerState.READY and await self._admit(m):
                        await self._read_capacity(m)
                        m.ready_this_join = True
                        m.set_state(WorkerState.READY)
                else:
                    if m.unhealthy_since is None:
                        m.unhealthy_since = now
                    if m.state == WorkerState.READY:
                        m.set_state(WorkerState.LOADING, why)  # out of the router until healthy again
                    elif m.state == WorkerState.REFUSED:
                        await self._recheck_refused(m)
                    elif not self._mirror_agent(m, (await self._identity_records()).get(m.name)):
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
                await asyncio.gather(*(self._scrape(m) for m in serving), *(self._still_admitted(m) for m in ready))
            await asyncio.sleep(POLL_S)
        return "stopping"

    def _mirror_agent(self, m: RemoteWorker, record: IdentityRecord | None) -> bool:
        """An unanswering server whose host agent says it crashed or failed takes that state, its error and last
        words (the crash itself is told by _tell_crashes, a failure here, once); one the agent launched again is
        starting. False when the record says nothing of that (the caller keeps the /health reason)."""
        if record is None:
            return False
        self._tell_crashes(m, record)
        if record.state in ENDED:
            seen = (record.state, record.restarts, record.pid)
            if m.agent_seen != seen:
                m.agent_seen, m.restarts, m.last_error_lines = seen, record.restarts, list(record.last_words)
                m.set_state(record.state, record.error)
                if record.state == WorkerState.FAILED:
                    self.emit(AlertEvent(
                        severity=Severity.CRITICAL, text=f"worker {m.name} failed, not restarted again on host "
                        f"{self.host.name}: {record.error}",
                        evidence="\n".join([*record.last_words, f"log: {self.host.name}:{self.server_log(m)}"]),
                        key=f"worker:{m.name}:failed"))
            return True
        if m.state in ENDED and record.state in (WorkerState.STARTING, WorkerState.LOADING):
            m.restarts, m.pid = record.restarts, record.pid
            m.set_state(record.state, f"the host agent's server: {record.state} (restart {record.restarts})")
            return True
        return False

    def _tell_crashes(self, m: RemoteWorker, record: IdentityRecord) -> None:
        """Each crash the agent counted and this link has not told yet, as one alert. The agent relaunches a
        crashed server within about a second, faster than this link reads its records: the count (not the record's
        state at the moment it is read) says a crash happened. A new agent (a rejoin, a new Slurm job) counts from
        zero."""
        agent, told = m.crashes_told
        if agent != record.agent_pid:
            told = 0
        new = record.crashes - told
        m.crashes_told = (record.agent_pid, max(told, record.crashes))
        if new <= 0:
            return
        more = f" ({new} crashes since the last one told)" if new > 1 else ""
        self.emit(AlertEvent(
            severity=Severity.ERROR, text=f"worker {m.name} crashed on host {self.host.name}: {record.last_crash}{more}",
            evidence="\n".join([*record.last_words, f"log: {self.host.name}:{self.server_log(m)}"]),
            key=f"worker:{m.name}:crash"))

    def server_log(self, m: RemoteWorker) -> str:
        return f"{self.host.work_dir}/workers/{m.name}/server.log"

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

    # -- identity -----------------------------------------------------------------------------
    async def _identity_records(self, fresh: bool = False) -> dict[str, IdentityRecord]:
        """The host agent's workers/*/identity.json, read over ssh at most every IDENTITY_REFRESH_S
        unless `fresh`."""
        if not fresh and time.monotonic() - self._records_at < IDENTITY_REFRESH_S:
            return self._records
        self._records_at = time.monotonic()
        command = (f"cd {shell_path(self.host.work_dir)} && if [ -f agent.pid ] && p=$(cat agent.pid)"
                   f' {self.AGENT_ALIVE}; then echo "{AGENT_LINE}$p"; else echo "{AGENT_LINE}none"; fi;'
                   f' for f in workers/*/{IDENTITY_FILE}; do [ -e "$f" ] || continue; cat "$f"; echo; done')
        try:
            rc, out, err = await self.ssh(command, timeout=20)
        except HostError as exc:
            self._records_error = f"cannot read the host agent's identity records: {exc}"
            return self._records
        if rc != 0:
            self._records_error = f"reading the host agent's identity records failed (exit {rc}): {err.strip()}"
            return self._records
        self._records, bad = live_records(out)
        self._records_error = ""
        for line in bad:
            log.warning("host %s: unreadable identity record %s", self.host.name, line)
        return self._records

    async def _admit(self, m: RemoteWorker) -> bool:
        """A healthy server that is not ready yet: True when it may join the router. A server the agent
        refused, or another server answering its port, is refused here too, with a critical alert."""
        answer = await read_served_names(self.session, m.url, m.headers)
        record = (await self._identity_records()).get(m.name)
        where = f"{m.name} ({m.url})"
        check = admit_remote(record, answer, where)
        if check.verdict == Verdict.FOREIGN and m.state != WorkerState.REFUSED:
            # before alerting: the cached record may predate the agent's latest launch
            record = (await self._identity_records(fresh=True)).get(m.name)
            check = admit_remote(record, answer, where)
        if record is not None:
            self._tell_crashes(m, record)  # a crash and relaunch between two reads is said before the rejoin
        if check.verdict == Verdict.PROVEN:
            if record is None:  # admit_remote proves only a launch its agent recorded
                raise RuntimeError(f"{m.name} was proven without its host agent's identity record")
            m.pid = record.pid  # the host agent's launch, on its host
            if m.state == WorkerState.REFUSED:
                self.emit(AlertEvent(severity=Severity.INFO, text=f"worker {m.name}: its own server answers again; it rejoins",
                                     evidence=f"refused before: {m.error}", key=f"worker:{m.name}:refused",
                                     kind=AlertKind.CLEARED))
            m.served_model_name = record.served_model_name
            log.info("worker %s: %s", m.name, check.reason)
            return True
        if check.verdict == Verdict.FOREIGN:
            self._refuse(m, check.reason, record)
        elif m.state != WorkerState.REFUSED:
            m.error = check.reason + (f" ({self._records_error})" if self._records_error else "")
        return False

    def _refuse(self, m: RemoteWorker, reason: str, record: IdentityRecord | None) -> None:
        first = m.state != WorkerState.REFUSED
        m.served_model_name = None
        m.set_state(WorkerState.REFUSED, reason)
        if first:
            evidence = f"host: {self.host.name} ({self.host.address})\nserver: {m.url}\n" + (
                f"agent record: {record.to_json()}" if record else "agent record: none")
            self.emit(AlertEvent(severity=Severity.CRITICAL, text=f"worker {m.name} refused on host {self.host.name}: {reason}",
                                 evidence=evidence, key=f"worker:{m.name}:refused", kind=AlertKind.RAISED))

    async def _recheck_refused(self, m: RemoteWorker) -> None:
        """A refused server that stopped answering: once the agent no longer refuses it (the port was
        freed, its own server is loading), it is starting again, and admitted when it answers."""
        record = (await self._identity_records()).get(m.name)
        if record is not None and record.state != WorkerState.REFUSED:
            m.set_state(WorkerState.STARTING, f"the host agent's server: {record.state}")

    async def _still_admitted(self, m: RemoteWorker) -> None:
        """A ready server must keep answering with the name it was admitted with (a restart by the agent
        makes a new launch, to be proven again; another server on the port must not stay in the router)."""
        answer = await read_served_names(self.session, m.url, m.headers)
        if answer.names and m.served_model_name not in answer.names:
            m.set_state(WorkerState.LOADING, f"answers as {', '.join(map(repr, answer.names))}, admitted as "
                        f"{m.served_model_name!r}: its identity is checked again")

    async def _health(self, m: RemoteWorker) -> tuple[bool, str]:
        try:
            async with self.session.get(m.url + "/health", headers=m.headers,
                                        timeout=aiohttp.ClientTimeout(total=5)) as resp:
                await resp.read()
                return resp.status == 200, f"/health -> HTTP {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return False, f"/health: {type(exc).__name__}: {exc}"

    async def _read_capacity(self, m: RemoteWorker) -> None:
        """Its batch size as a local worker finds it (engine/servers/capacity.py): the start-up log line is on the
        host, so the host agent's identity record carries it."""
        reported = await read_server_info(self.session, m.url, m.headers, m.name)
        if reported is None:
            reported = ServerCapacity(max_total_num_tokens=m.capacity_info.max_total_num_tokens,
                                      context_length=m.capacity_info.context_length,
                                      max_req_input_len=m.capacity_info.max_req_input_len)
        record = self._records.get(m.name)
        workers = host_workers(self.cfg, self.host)
        m.capacity_info = discover(reported, record.startup_batch if record else None,
                                   configured_batch(workers.launch, workers.extra_args))
        log.info("worker %s: batch size %d (source %s)", m.name, m.capacity_info.batch().size,
                 m.capacity_info.batch().source)

    async def _scrape(self, m: RemoteWorker) -> None:
        try:
            async with self.session.get(m.url + "/metrics", headers=m.headers,
                                        timeout=aiohttp.ClientTimeout(total=5)) as resp:
                text = await resp.text()
            m.metrics = parse_metrics(text) if resp.status == 200 else ServerMetrics()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            m.metrics = ServerMetrics()


def ssh_argv(host: Host, *extra: str) -> list[str]:
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=2",
            "-o", "ServerAliveCountMax=3", *host.ssh_options, *extra, *host.ssh_destination()]


async def run_ssh(host: Host, command: str, stdin: bytes | None = None, timeout: float = SSH_TIMEOUT_S
                  ) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `command` on the host; HostError when ssh itself failed (255) or timed out."""
    argv = ssh_argv(host) + ["--", command]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        raise HostError(f"cannot run ssh: {exc}") from exc
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout=timeout)
    except asyncio.TimeoutError:
        _kill_group(proc.pid)
        await proc.wait()
        raise HostError(f"ssh {host.address} `{command[:80]}` timed out after {timeout:.0f} s") from None
    rc = await proc.wait()  # communicate() returned once it exited: its exit code, at once
    if rc == 255:
        raise HostError(f"ssh {host.address}: {err.decode(errors='replace').strip() or 'exit 255'}")
    return rc, out.decode(errors="replace"), err.decode(errors="replace")


def agent_stop_command(host: Host) -> str:
    """Stops the host's agent and waits for it to have stopped its servers (engine.placement.hosts.agent --stop);
    a host where no agent was ever deployed says so."""
    wd = shell_path(host.work_dir)
    return (f"if [ -d {wd}/{AGENT_DIR} ]; then cd {wd} && PYTHONPATH={wd}/{AGENT_DIR} {shlex.quote(host.host_python)}"
            f" -m engine.placement.hosts.agent --work-dir . --stop {AGENT_STOP_WAIT_S:g};"
            f" else echo 'no agent was deployed in '{wd}; fi")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone
