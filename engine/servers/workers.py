"""A Worker: one SGLang server launched here (engine.servers.launch), watched until it crashes, and relaunched.

States: starting -> loading -> ready -> crashed -> (backoff, engine.servers.restart) starting ... -> failed. A worker is
only ever the server it launched: the port must be free and the server must prove it is this launch
(engine.servers.identity) before it is ready; otherwise it is `refused` (not a crash) until the port is free again.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import aiohttp

from engine.api.events import AlertEvent, Event, WorkerEvent
from engine.api.tuning import LaunchTuning
from engine.api.wire import AlertKind, InFlightSource, Severity, WorkerState
from engine.config.load import RunConfig
from engine.servers import stream_flag
from engine.servers.capacity import BatchSize, ServerCapacity
from engine.servers.identity import (
    Expected, launch_token, operator_served_name,
    served_name,
)
from engine.servers.identity_record import IDENTITY_FILE, IdentityRecord, write_identity
from engine.servers.launch import WorkerSpec, kill_group, launch_argv, launch_env, reap_orphan, redact, spawn
from engine.servers.metrics_client import ServerMetrics
from engine.servers.port_holder import check_port
from engine.servers.restart import RESTART_WINDOW_S, CrashWindow
from engine.servers.server_log import (
    crash_cause, error_lines, log_tail,
)
from engine.servers.target import SingleServer
from engine.servers.tuning import RunTuning, ServerTuner
from engine.servers.watch import STOP_GRACE_S, LaunchEnd, LaunchWatch
from engine.servers.worker_event import worker_event

if TYPE_CHECKING:
    from engine.run.counts import ServedTokens

log = logging.getLogger("regen.workers")

REFUSED_RECHECK_S = (1.0, 30.0)  # first and longest wait between checks of a refused worker's port


@dataclass
class Worker(SingleServer):  # a dispatch target (engine.servers.target.DispatchTarget)
    spec: WorkerSpec
    cfg: RunConfig
    run_dir: Path
    session: aiohttp.ClientSession
    emit: Callable[[Event], None]  # telemetry sink (WorkerEvent / AlertEvent)
    python: str = sys.executable
    state: str = WorkerState.STARTING
    pid: int | None = None
    restarts: int = 0
    capacity_info: ServerCapacity = field(default_factory=ServerCapacity)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    error: str | None = None
    # maintained by the dispatcher; behind the router (a [[hosts]] run's local servers) by the router's endpoint:
    # the router's count of it, or None where the router keeps none (engine.placement.router.RouterEndpoint.refresh)
    in_flight: int | None = 0
    in_flight_source: str = InFlightSource.DISPATCH
    held: int = 0  # maintained by the dispatcher: regen's queued items held for it
    capacity: int = 0  # maintained by the dispatcher
    batch: BatchSize | None = None  # maintained by the dispatcher: the batch size it works with
    listeners: list[Callable[["Worker", str], None]] = field(default_factory=list)
    host_name: str = ""  # the [[hosts]] name in a multi-host run
    served: ServedTokens | None = None  # the ledger's figures of it as a dispatch target (set by the supervisor)
    # its --schedule-conservativeness (engine.servers.tuning); default: the config's start, nothing recorded
    tuner: ServerTuner | None = None

    def __post_init__(self) -> None:
        self.log_path = self.run_dir / "workers" / self.spec.name / "server.log"
        self._proc: asyncio.subprocess.Process | None = None
        self._log_offset = 0
        self._crashes = CrashWindow()
        self._stopping = False
        self._manual_restart = asyncio.Event()
        self._stream_flag: stream_flag.StreamFlag | None = None  # chosen at the first launch (engine.servers.stream_flag)
        self._ready_event = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._expected: Expected | None = None  # the identity of the current launch
        self._proxy_warned = False
        self._startup_batch: int | None = None  # from the current launch's start-up log line
        self.last_error_lines: list[str] = []  # the last crash's fatal lines (or its log's tail)
        self.crashes = 0  # every crash of this worker, in its identity record (engine/placement/hosts/link.py reads it)
        self.last_crash: str | None = None
        if self.tuner is None:
            self.tuner = RunTuning(self.cfg, None).for_server(self.spec.name)

    # -- public -----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def headers(self) -> dict[str, str]:
        key = self.cfg.workers.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def start(self) -> None:
        self._task = asyncio.create_task(self._lifecycle(), name=f"worker-{self.name}")

    async def wait_ready(self) -> None:
        await self._ready_event.wait()

    def restart(self) -> None:
        """Operator-requested restart: kill and relaunch; not counted as a crash. A failed worker
        gets a fresh crash budget and is launched again."""
        if self._task is not None and self._task.done() and not self._stopping:
            self._crashes.clear()
            self.restarts += 1
            self.start()
            return
        self._manual_restart.set()

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        self._stopping = True
        self._manual_restart.set()
        await self._kill(grace_s)
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=grace_s + 5)
            except asyncio.TimeoutError:
                self._task.cancel()
        self._set_state(WorkerState.STOPPED)

    def snapshot(self) -> WorkerEvent:
        return worker_event(self, host=self.host_name)

    # -- lifecycle --------------------------------------------------------------------------
    def _set_state(self, state: str) -> None:
        if state == self.state:
            return
        log.info("worker %s: %s -> %s%s", self.name, self.state, state, f" ({self.error})" if self.error else "")
        self.state = state
        if state == WorkerState.READY:
            self._ready_event.set()
        else:
            self._ready_event.clear()
        for listener in list(self.listeners):
            listener(self, state)
        self.emit(self.snapshot())
        self._record_identity()

    def _record_identity(self) -> None:
        expected = self._expected
        ended = self.state in (WorkerState.CRASHED, WorkerState.FAILED)
        record = IdentityRecord(name=self.name, state=self.state, pid=self.pid, port=self.spec.port, error=self.error,
                                served_model_name=expected.served_model_name if expected else None,
                                startup_batch=self._startup_batch, agent_pid=os.getpid(), restarts=self.restarts,
                                last_words=tuple(self.last_error_lines) if ended or self.crashes else (),
                                crashes=self.crashes, last_crash=self.last_crash, tuning=self.tuning)
        try:
            write_identity(self.log_path.parent / IDENTITY_FILE, record)
        except OSError as exc:
            log.warning("worker %s: cannot write %s: %s", self.name, IDENTITY_FILE, exc)

    @property
    def port_remedy(self) -> str:
        where = "[[hosts]] base_port (or workers.base_port)" if self.host_name else "workers.base_port"
        return f"stop that process, or set {where} in run.toml to a free range"

    def _refuse(self, reason: str, evidence: str) -> None:
        """Another process's server holds or answers the port: refused, alerted once per refusal."""
        first = self.state != WorkerState.REFUSED
        error = f"{reason}; {self.port_remedy}"
        changed = error != self.error
        self.error = error
        self.pid = None  # no server of ours runs: the pid shown must never be the other process's
        if first:
            self._set_state(WorkerState.REFUSED)
            self._alert(Severity.CRITICAL, f"worker {self.name} refused: {error}", evidence, "refused",
                        AlertKind.RAISED)
        elif changed:  # another holder now: show it, without a second alert
            log.warning("worker %s: still refused: %s", self.name, error)
            self.emit(self.snapshot())
            self._record_identity()

    def _clear_refusal(self) -> None:
        where = f"port {self.spec.port} on {self.spec.host}"
        log.info("worker %s: %s is free again; launching its server", self.name, where)
        self._alert(Severity.INFO, f"worker {self.name}: {where} is free again; launching its server",
                    f"refused before: {self.error}", "refused", AlertKind.CLEARED)
        self.error = None

    async def _wait_for_port(self) -> bool:
        """Launch only on a free port: while another process holds it the worker stays refused and the
        port is checked again with backoff (not a crash). True when free, False when stopping."""
        delay, longest = REFUSED_RECHECK_S
        self.log_path.parent.mkdir(parents=True, exist_ok=True)  # identity.json records a refusal too
        while not self._stopping:
            pid_path = self.log_path.parent / "server.pid"
            reaped = await asyncio.to_thread(reap_orphan, pid_path, self.spec.port)
            if reaped:
                log.warning("worker %s: %s", self.name, reaped)
            check = await asyncio.to_thread(check_port, self.spec.host, self.spec.port)
            if not check.held:
                if not check.free:  # not a holder (e.g. an address this host does not have): the launch says why
                    log.warning("worker %s: %s; %s", self.name, check.bind_error, check.note)
                if self.state == WorkerState.REFUSED:
                    self._clear_refusal()
                return True
            self._refuse(f"port {check.port} on {check.host} is already in use by {check.holder_text()}",
                         check.evidence())
            try:
                await asyncio.wait_for(self._manual_restart.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass  # check again
            self._manual_restart.clear()
            delay = min(longest, delay * 2)
        return False

    async def _lifecycle(self) -> None:
        while not self._stopping:
            self._manual_restart.clear()
            if not await self._wait_for_port():
                break
            self._retune()
            try:
                await self._launch()
            except OSError as exc:
                self.error = f"cannot launch: {exc}"
                self.last_error_lines = [self.error]
                self._count_crash()
                self._set_state(WorkerState.CRASHED)
                self._alert(Severity.ERROR, f"worker {self.name} could not be launched", str(exc), "launch")
            else:
                assert self._proc is not None
                outcome = await LaunchWatch(self, self._proc).run()
                if self._stopping:
                    break
                if outcome == LaunchEnd.MANUAL:
                    await self._kill(STOP_GRACE_S)
                    self.restarts += 1
                    self.error = None
                    continue
                if outcome == LaunchEnd.REFUSED:  # not a crash of ours: wait for the port, then launch again
                    await self._kill(STOP_GRACE_S)
                    continue
            # crashed (or hung / never ready, already killed)
            delay = self._crashes.crashed(time.time(), self.cfg.workers.max_restarts)
            if delay is None:
                self._set_state(WorkerState.FAILED)
                self._alert(
                    Severity.CRITICAL,
                    f"worker {self.name} failed: {self._crashes.count} crashes in {RESTART_WINDOW_S:.0f} s,"
                    f" not restarted again",
                    "\n".join([self.error or ""] + self.last_error_lines), "failed",
                )
                return
            log.info("worker %s: restarting in %.0f s", self.name, delay)
            try:
                await asyncio.wait_for(self._manual_restart.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass  # backoff elapsed: restart
            if self._stopping:
                break
            self.restarts += 1

    async def _launch(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        pid_path = self.log_path.parent / "server.pid"
        ours = served_name(self.cfg.run_dir, self.name, launch_token())
        tuner = self.server_tuner
        argv = launch_argv(self.cfg, self.spec, self.python, served_model_name=ours,
                           conservativeness=tuner.flag_value(), mixed_chunk=tuner.mixed_chunk)
        if self.cfg.runaway.enabled:  # answers are streamed: have the server stream deltas where it can
            if self._stream_flag is None:
                self._stream_flag = await stream_flag.choose_logged(argv, self.python, self.name)
            if self._stream_flag.flag:
                argv.append(self._stream_flag.flag)
        name = operator_served_name(argv) or ours
        env = launch_env(self.cfg, self.spec, self.log_path.parent, tuner.env())
        tuner.launched()
        shown = redact(shlex.join(argv), self.cfg.workers.api_key)
        self._proc, self._log_offset = await spawn(argv, env, shown, self.log_path, self.run_dir)
        self.pid = self._proc.pid
        pid_path.write_text(f"{self.pid}\n")
        self._expected = Expected(served_model_name=name, token_is_ours=name == ours, pid=self.pid,
                                  host=self.spec.host, port=self.spec.port)
        self.error = None
        self.metrics = ServerMetrics()
        self._startup_batch = None
        log.info("worker %s: launched pid %d: %s (log %s)", self.name, self.pid, shown, self.log_path)
        self._set_state(WorkerState.STARTING)

    @property
    def server_tuner(self) -> ServerTuner:
        assert self.tuner is not None  # set in __post_init__
        return self.tuner

    @property
    def tuning(self) -> LaunchTuning:
        """Its --schedule-conservativeness as its event and its identity record carry it."""
        return self.server_tuner.launch()

    def _retune(self) -> None:
        """Before a relaunch: the value the last launch's /metrics call for (engine.servers.tuning), said in an alert."""
        change = self.server_tuner.at_restart()
        if change is not None:
            log.info("worker %s: %s", self.name, change.text)
            self._alert(change.severity, change.text, change.evidence, "tuning")

    @property
    def serves_http(self) -> bool:
        """False for a rank > 0 of a server across nodes: only a dummy /health, no API, no metrics, no name."""
        return self.spec.rank is None or self.spec.rank.serves_http

    def _crashed(self, returncode: int | None, reason: str | None = None) -> LaunchEnd:
        lines = error_lines(self.log_path, self._log_offset)
        evidence_lines = lines or log_tail(self.log_path, self._log_offset)
        code = "unknown" if returncode is None else (
            f"signal {-returncode}" if returncode < 0 else f"exit code {returncode}")
        cause = crash_cause(lines)
        self.error = (reason + "; " if reason else "") + f"{code}" + (f": {cause}" if cause else "")
        self.last_error_lines = evidence_lines
        self._count_crash()
        self._set_state(WorkerState.CRASHED)
        self._alert(Severity.ERROR, f"worker {self.name} crashed ({code})", "\n".join(evidence_lines), "crash")
        return LaunchEnd.CRASHED

    def _count_crash(self) -> None:
        """Into the identity record: a reader that polls tells each crash once (engine/placement/hosts/link.py)."""
        self.crashes, self.last_crash = self.crashes + 1, self.error

    async def _kill(self, grace_s: float) -> None:
        await kill_group(self._proc, grace_s, self.name)

    def _alert(self, severity: Severity, text: str, evidence: str, key: str, kind: AlertKind = AlertKind.EVENT) -> None:
        self.emit(AlertEvent(severity=severity, text=text, evidence=redact(evidence, self.cfg.workers.api_key),
                             key=f"worker:{self.name}:{key}", kind=kind))
