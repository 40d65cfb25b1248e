"""The one loop that follows a run (the TUI, `regen status --follow`): connect, ask the status, stream the telemetry;
on a lost connection reconnect with backoff and backfill from the last event's ts (no event missed or doubled). Only
reads are retried, never a control op; a refusal (host key, auth) or an error reply stops it."""
from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from console.view.model_parts import ConnectionState
from engine.api.status import RunStatus
from engine.api.events import Event


class SourceErrorKind(StrEnum):
    CONNECTION = "connection"  # reconnect with backoff
    NO_SUPERVISOR = "no_supervisor"  # the run is not running: show what its run dir recorded
    # unknown or changed host key, authentication: retrying cannot help, the text says what the operator must do
    REFUSED = "refused"
    ERROR = "error"  # an operation was refused: show the text


class SourceError(Exception):
    def __init__(self, message: str, kind: SourceErrorKind = SourceErrorKind.ERROR):
        super().__init__(message)
        self.kind = kind


class FollowSource(Protocol):
    """What the loop reads: console.host.source.HostSource (a host) or ReplaySource (a recording)."""

    host: str

    @property
    def run_dir(self) -> str | None:
        """The run dir it reads (None: none given); read-only here, so a source whose run dir is always known
        (ReplaySource: str) is one too."""
        ...

    async def connect(self) -> None: ...
    async def reconnect(self) -> None: ...
    async def status(self) -> RunStatus: ...
    async def last_status(self) -> RunStatus: ...
    def follow(self, since: float | None) -> AsyncIterator[Event]: ...


@dataclass(frozen=True)
class FollowState:
    state: ConnectionState
    error: str = ""  # why (connected: "regained" after a reconnect)
    retry_in_s: float | None = None


@dataclass(frozen=True)
class Backoff:
    first_s: float = 1.0
    max_s: float = 60.0
    lost_after: int = 5  # failed attempts before "reconnecting" is reported as "lost"

    def delay_s(self, failures: int) -> float:
        return min(self.max_s, self.first_s * 2.0 ** (failures - 1))


def _ignore(_: Any) -> None:
    return None


class RunFollower:
    """events() yields the run's telemetry across reconnects; on_state gets each FollowState, on_status each status
    (live, or the run dir's last one when the supervisor is gone; a coroutine function is awaited), on_warning what could not be read but does not
    stop the loop. watch_ended: after the run ended, keep checking every ended_check_s whether it runs again (the
    TUI) instead of returning (`regen status --follow`). `stopped_by` is the error that stopped it, if any.
    One follower keeps its place (the last ts) across calls of events(), e.g. after a refusal and ctrl+r."""

    def __init__(self, source: FollowSource, *, since: float | None,
                 on_state: Callable[[FollowState], None] = _ignore,
                 on_status: Callable[[RunStatus], None | Awaitable[None]] = _ignore,
                 on_warning: Callable[[str], None] = _ignore,
                 backoff: Backoff = Backoff(), ended_check_s: float = 15.0, watch_ended: bool = True,
                 wake: asyncio.Event | None = None):
        self.source = source
        self.last_ts = since
        self._seen_at_last: set[bytes] = set()  # events delivered whose ts == last_ts: the backfill repeats them
        self.on_state, self.on_status, self.on_warning = on_state, on_status, on_warning
        self.backoff = backoff
        self.ended_check_s = ended_check_s
        self.watch_ended = watch_ended
        self.wake = wake or asyncio.Event()  # set it to cut a backoff or an ended wait short
        self.stopped_by: SourceError | None = None

    async def events(self, again: bool = False) -> AsyncIterator[Event]:
        """again: start over through source.reconnect() (a refused source forgets its refusal there)."""
        self.stopped_by = None
        failures = 1 if again else 0
        while True:
            try:
                if failures:
                    await self.source.reconnect()
                else:
                    await self.source.connect()
                running = await self._status()
                if running:
                    self.on_state(FollowState(ConnectionState.CONNECTED, "regained" if failures else ""))
                failures = 0
                if self.source.run_dir is not None:
                    async for ev in self.source.follow(self.last_ts):
                        if self._fresh(ev):
                            yield ev
                if running:
                    continue  # the stream ended: the supervisor exited (or restarted); ask again
                if not self.watch_ended:
                    return
                await self._sleep_or_wake(self.ended_check_s)
            except SourceError as exc:
                # refused (host key, auth) or an error reply: retrying cannot help
                if exc.kind != SourceErrorKind.CONNECTION:
                    self.stopped_by = exc
                    ended = ConnectionState.REFUSED if exc.kind == SourceErrorKind.REFUSED else ConnectionState.ENDED
                    self.on_state(FollowState(ended, str(exc)))
                    return
                failures += 1
                delay = self.backoff.delay_s(failures)
                self.on_state(FollowState(ConnectionState.RECONNECTING if failures <= self.backoff.lost_after else ConnectionState.LOST,
                                          str(exc), delay))
                await self._sleep_or_wake(delay)

    async def _status(self) -> bool:
        """Whether a supervisor runs the run; either way the status to show goes to on_status."""
        try:
            await self._said(await self.source.status())
            return True
        except SourceError as exc:
            if exc.kind != SourceErrorKind.NO_SUPERVISOR:
                raise
            self.on_state(FollowState(ConnectionState.ENDED, str(exc)))
        try:
            await self._said(await self.source.last_status())
        except SourceError as exc:
            if exc.kind == SourceErrorKind.CONNECTION:
                raise
            # a recording without a status has nothing more to say; else: say it
            if exc.kind != SourceErrorKind.NO_SUPERVISOR:
                self.on_warning(f"the run dir's last state could not be read: {exc}")
        return False

    async def _said(self, status: RunStatus) -> None:
        said = self.on_status(status)
        if inspect.isawaitable(said):
            await said

    def _fresh(self, ev: Event) -> bool:
        """False for an event already delivered: a backfill starts at last_ts inclusive."""
        key = ev.to_json()
        if self.last_ts is not None and ev.ts == self.last_ts and key in self._seen_at_last:
            return False
        if self.last_ts is None or ev.ts > self.last_ts:
            self.last_ts, self._seen_at_last = ev.ts, set()
        self._seen_at_last.add(key)
        return True

    async def _sleep_or_wake(self, seconds: float) -> None:
        self.wake.clear()
        try:
            await asyncio.wait_for(self.wake.wait(), seconds)
        except asyncio.TimeoutError:
            return
