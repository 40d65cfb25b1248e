"""The notifier: a telemetry listener that sends failures and the run's end from the host.

`on_event` only picks and queues; one asyncio task rate-limits and delivers. A failed delivery is an `error`
alert (notify.failed) that is never itself sent.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import socket
import time
from pathlib import Path
from typing import Callable

import aiohttp

from engine.config.load import NotifyConfig
from engine.notify.deliver import DeliveryError, Destination, destinations, with_retries
from engine.notify.limiter import Limiter
from engine.notify.message import Notification, notification_for
from engine.api.events import AlertEvent, Event, FatalEvent, RunEndEvent
from engine.api.wire import RunState, Severity

log = logging.getLogger("regen.notify")

CLOSE_GRACE_S = 0.5  # past the flush deadline, for the task to notice it and return


class Notifier:
    def __init__(self, cfg: NotifyConfig, run_dir: Path | str, emit: Callable[[Event], None],
                 host: str | None = None):
        self.cfg = cfg
        self.run_dir = str(run_dir)
        self.host = host or socket.gethostname()
        self.emit = emit  # where the notify.failed alerts go (Telemetry.emit)
        self.limiter = Limiter(cfg.max_per_minute, cfg.dedupe_s)
        self.delivered: list[tuple[str, Notification]] = []  # (destination, notification), for status and tests
        self._pending: collections.deque[Notification] = collections.deque()
        self._session: aiohttp.ClientSession | None = None
        self._dests: list[Destination] = destinations(cfg, self._get_session)
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._current: tuple[Notification, list[str]] | None = None  # in delivery, destinations not settled
        self._deadline: float | None = None  # monotonic; set by aclose
        self._closing = False
        self._fatal_sent = False

    # -- the listener (sync, never raises, never blocks) ---------------------------------------
    def on_event(self, event: Event) -> None:
        try:
            n = notification_for(event, self.cfg, run_dir=self.run_dir, host=self.host)
        except Exception:  # a listener must not take Telemetry.emit down; the traceback is in the log
            log.exception("notify: cannot build a notification for %s", type(event).__name__)
            return
        if n is None:
            return
        if isinstance(event, FatalEvent):
            self._fatal_sent = True
        elif isinstance(event, RunEndEvent) and event.state == RunState.FAILED and self._fatal_sent:
            log.info("notify: the run's failed end is not sent apart: the fatal notification carries its cause")
            return
        self.submit(n)

    def submit(self, n: Notification) -> None:
        self._pending.append(n)
        loop = self._loop
        if loop is None or loop.is_closed() or self._wake is None:
            return  # delivered when the task starts (start or aclose)
        if _running_loop() is loop:
            self._wake.set()
        else:
            loop.call_soon_threadsafe(self._wake.set)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start delivering (in the running loop)."""
        if self._task is None or self._task.done():
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._task = self._loop.create_task(self._run(), name="notifier")

    async def aclose(self, timeout: float | None = None) -> None:
        """Deliver what is queued (the held ones as one summary) within `timeout` (default
        notify.flush_timeout_s); what is left is logged and alerted. May be called again for
        events that came after an earlier close."""
        timeout = self.cfg.flush_timeout_s if timeout is None else timeout
        self._deadline = time.monotonic() + timeout
        self._closing = True
        self.start()
        task, wake = self._task, self._wake
        if task is None or wake is None:
            raise RuntimeError("notifier: start() left no delivery task")
        wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout + CLOSE_GRACE_S)
        except asyncio.TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        all_dests = [d.name for d in self._dests]
        left = [self._current] if self._current is not None else []
        left += [(n, all_dests) for n in self._pending] + [(h.notification, all_dests) for h in self.limiter.held]
        self._pending.clear()
        self.limiter.held.clear()
        self._current = None
        for n, dests in left:
            self._report(n, ", ".join(dests), f"the exit flush ran out of time ({timeout:g} s, notify.flush_timeout_s)")
        if self._session is not None:
            await self._session.close()
            self._session = None

    def close(self, timeout: float | None = None) -> None:
        """aclose() from synchronous code with no running loop (e.g. after asyncio.run returned)."""
        asyncio.run(self.aclose(timeout))

    # -- the delivery task --------------------------------------------------------------------
    async def _run(self) -> None:
        wake = self._wake  # start() made it with this task (a new one only once this task is done)
        if wake is None:
            raise RuntimeError("notifier: the delivery task runs without its wake-up event")
        while True:
            wake.clear()
            await self._process()
            if self._closing and not self._pending:
                return
            due_in = self.limiter.summary_due_in(time.monotonic())
            try:
                await asyncio.wait_for(wake.wait(), due_in)
            except asyncio.TimeoutError:
                continue  # a summary is due

    async def _process(self) -> None:
        if self._closing:  # the exit's own words first, before alerts that may use up the deadline
            urgent = [n for n in self._pending if n.kind in ("fatal", "run_end")]
            rest = [n for n in self._pending if n.kind not in ("fatal", "run_end")]
            self._pending.clear()
            self._pending.extend(urgent + rest)
        while self._pending:
            n = self._pending.popleft()
            if self.limiter.admit(n, time.monotonic()):
                await self._deliver(n)
        summary = self.limiter.take_summary(time.monotonic(), force=self._closing)
        if summary is not None:
            await self._deliver(summary)

    async def _deliver(self, n: Notification) -> None:
        for i, dest in enumerate(self._dests):
            # kept until this destination settles: a cancel at the exit deadline reports it
            self._current = (n, [d.name for d in self._dests[i:]])
            try:
                answer = await with_retries(dest, n, self.cfg, lambda: self._deadline)
            except DeliveryError as exc:
                self._report(n, dest.name, str(exc))
            else:
                self.delivered.append((dest.name, n))
                log.info("notification sent to %s (%s): %s", dest.name, answer, n.title)
        self._current = None

    def _report(self, n: Notification, dest: str, why: str) -> None:
        """Not delivered: in supervisor.log and as an alert in telemetry (which is never itself sent)."""
        log.error("notification not delivered to %s: %s: %s", dest, n.title, why)
        try:
            self.emit(AlertEvent(severity=Severity.ERROR, key="notify.failed",
                                 text=f"notification not delivered: {n.title} ({dest}: {why})",
                                 evidence=f"{n.text}\n{n.evidence}".strip()))
        except Exception:  # telemetry already closed (a late close): the log line above is the record
            log.exception("notify: cannot record the notify.failed alert in telemetry")

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # called from a thread without a loop (e.g. asyncio.to_thread)
        return None
