"""One launch of a Worker's server watched until it ends: its log and /health until it is ready (proving it is this
launch, engine.servers.identity), then /health and /metrics; a hung or never-ready server is killed here."""
from __future__ import annotations

import asyncio
import logging
import time
from enum import StrEnum
from typing import TYPE_CHECKING

from engine.api.wire import Severity, WorkerState
from engine.servers.capacity import ServerCapacity, batch_from_log, configured_batch, discover
from engine.servers.identity import IdentityCheck, Verdict, check_identity, judge_health_only, socket_owner
from engine.servers.polling import health_ok, read_server_info, scrape_metrics
from engine.servers.port_holder import PortCheck, check_port
from engine.servers.server_log import LOADING_HINTS, READY_LINE, bind_failure, read_whole_lines, startup_text

if TYPE_CHECKING:
    from engine.servers.workers import Worker

log = logging.getLogger("regen.workers")

HEALTH_INTERVAL_S = 5.0
POLL_S = 0.25  # a server's process, log and health are looked at this often
# ... while it starts: its ready line is seen sooner (a resume's first dispatch and a restarted server's share of
# the work wait on it), and reading a few new bytes of a local file costs nothing
STARTING_POLL_S = 0.05
METRICS_INTERVAL_S = 0.5  # the dispatcher's feedback reads each server's queue this often (engine.run.batch_feedback)
STOP_GRACE_S = 10.0


class LaunchEnd(StrEnum):
    CRASHED = "crashed"  # or hung / never ready: killed already
    REFUSED = "refused"  # another process's server holds or answers the port (not a crash of ours)
    MANUAL = "manual"  # the operator asked for a restart


class LaunchWatch:
    def __init__(self, w: Worker, proc: asyncio.subprocess.Process):
        self.w = w
        self.proc = proc

    async def run(self) -> LaunchEnd:
        """How the launch ended. Kills the process itself when hung or never ready."""
        proc = self.proc
        launched = time.monotonic()
        seen = self.w._log_offset
        next_health = 0.0
        next_metrics = 0.0
        health_failures = 0
        unproven = ""
        while True:
            if self.w._manual_restart.is_set():
                return LaunchEnd.MANUAL
            if proc.returncode is not None:
                return await self._exited(proc.returncode)
            now = time.monotonic()
            if self.w.state in (WorkerState.STARTING, WorkerState.LOADING):
                text, seen = read_whole_lines(self.w.log_path, seen, self.w.name)
                if self.w.state == WorkerState.STARTING and (text.strip() or now - launched > 1.0):
                    if any(h in text for h in LOADING_HINTS) or now - launched > 1.0:
                        self.w._set_state(WorkerState.LOADING)
                ready = READY_LINE in text
                if not ready and now >= next_health:
                    next_health = now + 1.0
                    ready = await self._health_ok(timeout=2.0)
                if ready:  # by its log line or /health: either way, only once it proves it is this launch
                    check = await self._prove_identity()
                    if check.verdict == Verdict.PROVEN:
                        if self.w.serves_http:
                            await self._read_capacity()
                        self.w._set_state(WorkerState.READY)
                    elif check.verdict == Verdict.FOREIGN:
                        self.w._refuse(check.reason, self._identity_evidence(check))
                        return LaunchEnd.REFUSED
                    elif check.verdict == Verdict.OWN_MISMATCH:
                        await self.w._kill(STOP_GRACE_S)
                        return self.w._crashed(proc.returncode, reason=check.reason)
                    else:
                        unproven = check.reason
                if self.w.state != WorkerState.READY and now - launched > self.w.cfg.workers.ready_timeout_s:
                    self.w.error = f"not ready after {self.w.cfg.workers.ready_timeout_s:.0f} s (workers.ready_timeout_s)"
                    if unproven:
                        self.w.error += f"; it answered, but its identity was not proven: {unproven}"
                    await self.w._kill(STOP_GRACE_S)
                    return self.w._crashed(proc.returncode, reason=self.w.error)
            else:
                if now >= next_metrics and self.w.serves_http:
                    next_metrics = now + METRICS_INTERVAL_S
                    await self._scrape_metrics()
                if now >= next_health:
                    timeout = self.w.cfg.workers.health_timeout_s
                    if await self._health_ok(timeout=timeout):
                        health_failures = 0
                    else:
                        health_failures += 1
                        if health_failures >= self.w.cfg.workers.health_failures and proc.returncode is None:
                            self.w.error = f"hung: /health failed {health_failures} times while the process lives; killed"
                            self.w._alert(Severity.ERROR, f"worker {self.w.name} hung, killing it", self.w.error, "hung")
                            await self.w._kill(2.0)
                            return self.w._crashed(proc.returncode, reason=self.w.error)
                    next_health = time.monotonic() + min(HEALTH_INTERVAL_S, timeout)
            starting = self.w.state in (WorkerState.STARTING, WorkerState.LOADING)
            try:
                await asyncio.wait_for(self.w._manual_restart.wait(), timeout=STARTING_POLL_S if starting else POLL_S)
            except asyncio.TimeoutError:
                pass  # poll tick

    async def _prove_identity(self) -> IdentityCheck:
        assert self.w._expected is not None
        if self.w.serves_http:
            check = await check_identity(self.w.session, self.w.url, self.w.headers, self.w._expected)
        else:
            owner = await asyncio.to_thread(socket_owner, self.w._expected.host, self.w._expected.port, self.w._expected.pid)
            check = judge_health_only(self.w._expected, owner)
        log.info("worker %s: identity %s: %s", self.w.name, check.verdict, check.reason)
        if check.warning and not self.w._proxy_warned:
            self.w._proxy_warned = True
            self.w._alert(Severity.WARNING, f"worker {self.w.name}: {check.warning}", self._identity_evidence(check), "proxy")
        return check

    def _identity_evidence(self, check: IdentityCheck) -> str:
        expected = self.w._expected
        lines = [f"port: {self.w.spec.port} on {self.w.spec.host}",
                 f"launched: pid {expected.pid if expected else None}, served-model-name "
                 f"{expected.served_model_name if expected else None!r}",
                 f"answered: served-model-name {', '.join(map(repr, check.names)) or '(none)'}"]
        for h in check.holders:
            lines.append(f"holder pid: {h.pid if h.pid is not None else 'not visible'}")
            lines.append(f"holder command: {h.cmdline or h.note}")
        return "\n".join(lines)

    async def _exited(self, returncode: int) -> LaunchEnd:
        """The launched server exited. When it could not bind its port because another process took it
        after the check, that is a refusal naming the holder; if the holder has gone since, a crash that
        says why."""
        line = bind_failure(self.w.log_path, self.w._log_offset, self.w.spec.port)
        if line is None:
            return self.w._crashed(returncode)
        check: PortCheck = await asyncio.to_thread(check_port, self.w.spec.host, self.w.spec.port)
        taken = f"port {self.w.spec.port} on {self.w.spec.host} was taken before the server could bind it ({line})"
        if check.held:
            self.w._refuse(f"{taken}; it is held by {check.holder_text()}", check.evidence() + f"\nserver log: {line}")
            return LaunchEnd.REFUSED
        return self.w._crashed(returncode, reason=f"{taken}; the holder has gone since")

    async def _health_ok(self, timeout: float) -> bool:
        return await health_ok(self.w.session, self.w.url, self.w.headers, timeout)

    async def _read_capacity(self) -> None:
        """The server's batch size from what it reports, its start-up log line or the launch flag
        (engine/servers/capacity.py); its context length from /get_server_info (kept from before if it does not answer)."""
        reported = await read_server_info(self.w.session, self.w.url, self.w.headers, self.w.name)
        if reported is None:
            reported = ServerCapacity(max_total_num_tokens=self.w.capacity_info.max_total_num_tokens,
                                      context_length=self.w.capacity_info.context_length,
                                      max_req_input_len=self.w.capacity_info.max_req_input_len)
        self.w._startup_batch = batch_from_log(startup_text(self.w.log_path, self.w._log_offset))
        flag = configured_batch(self.w.cfg.workers.launch, self.w.cfg.workers.extra_args)
        self.w.capacity_info = discover(reported, self.w._startup_batch, flag)
        log.info("worker %s: batch size %s (source %s)", self.w.name, self.w.capacity_info.batch().size,
                 self.w.capacity_info.batch().source)

    async def _scrape_metrics(self) -> None:
        self.w.metrics, problem = await scrape_metrics(self.w.session, self.w.url, self.w.headers)
        if problem is not None:
            self.w.error = problem
            return
        if self.w.error and self.w.error.startswith("/metrics"):
            self.w.error = None
        self.w.server_tuner.observe(self.w.metrics, time.time(), self.w.capacity_info.max_running_requests)
