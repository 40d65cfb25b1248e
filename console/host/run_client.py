"""Console side of the control socket: each op is one `engine.ctl` process on the host, or goes over the open control
channel (console/host/control_channel.py); each reply is decoded once, here, into the type its op declares
(engine.api.op_codec). follow() streams telemetry; the loop that reconnects and backfills is console/host/follow.py."""
from __future__ import annotations

import asyncio
from enum import StrEnum
from typing import Any, AsyncIterator, Callable

import orjson

from console.host.control_channel import ChannelClosed, ControlChannel, FollowRefused, OlderProtocol
from console.host.remote_engine import engine_command
from console.host.transport import Transport, TransportError
from engine.api.protocol import ErrorKind, ProtocolError, Reply, decode_reply
from engine.api.ops import (ChannelOp, Drain, DrainHost, Follow, LastStatus, LogTail, LogText, Pause, RestartWorker,
                            Resume, RunEnding, ShardsChanged, Status, Stop, UndrainHost, WorkerRestarted)
from engine.api.op_cli import ctl_argv
from engine.api.op_codec import decode_result
from engine.api.status import HostStatus, RunStatus
from engine.api.events import Event, UnknownEventType, event_from_dict
from engine.api.wire import WireError

CTL_TIMEOUT_S = 60.0
EXIT_ERROR_REPLY, EXIT_UNREACHABLE = 1, 2


class ClientErrorKind(StrEnum):
    ERROR = "error"  # the host answered with an error
    UNREACHABLE = "unreachable"  # no supervisor could be reached


class RunClientError(Exception):
    """The host answered with an error, or no supervisor could be reached (`kind` says which)."""

    def __init__(self, message: str, kind: ClientErrorKind = ClientErrorKind.ERROR, stderr: str = ""):
        super().__init__(message)
        self.kind = kind
        self.stderr = stderr


class NoSupervisor(RunClientError):
    """Nothing answers at the run dir's control socket: the run is stopped, finished, or its supervisor died."""

    def __init__(self, message: str, stderr: str = ""):
        super().__init__(message, kind=ClientErrorKind.UNREACHABLE, stderr=stderr)


class RunClient:
    def __init__(self, transport: Transport, run_dir: str, host_python: str = "python3",
                 engine_path: str | None = None):
        self.transport = transport
        self.run_dir = run_dir
        self.host_python = host_python
        self.engine_path = engine_path
        self._ctl_lacks_no_shards = False
        self.channel: ControlChannel | None = None  # open_channel(): ops go over it
        self.protocol_note = ""  # open_channel() found an engine without the channel: why ops go one process each

    def _command(self, *args: str) -> str:
        return engine_command(self.host_python, ["-m", "engine.ctl", "--run-dir", self.run_dir, *args],
                              engine_path=self.engine_path)

    @property
    def where(self) -> str:
        return f"{self.transport.name}:{self.run_dir}"

    async def open_channel(self) -> None:
        """Carry every op over one `engine.ctl serve` process from now on. An engine that does not answer its hello
        (deployed before the channel) keeps the one-process form, and protocol_note says so."""
        if self.channel is not None:
            await self.close_channel()
        try:
            self.channel = await ControlChannel.open(self.transport, self._command("serve"), self.where)
            self.protocol_note = ""
        except OlderProtocol as exc:
            self.channel, self.protocol_note = None, str(exc)
        except ChannelClosed as exc:
            raise RunClientError(f"cannot reach {self.transport.name}: {exc}",
                                 kind=ClientErrorKind.UNREACHABLE) from exc.transport
        except TransportError as exc:
            raise RunClientError(f"cannot reach {self.transport.name}: {exc}",
                                 kind=ClientErrorKind.UNREACHABLE) from exc
        except asyncio.TimeoutError as exc:
            raise RunClientError(f"control channel to {self.where}: `engine.ctl serve` did not answer hello",
                                 kind=ClientErrorKind.UNREACHABLE) from exc
        except ProtocolError as exc:
            raise RunClientError(f"control channel to {self.where}: {exc}", kind=ClientErrorKind.UNREACHABLE) from exc

    async def close_channel(self) -> None:
        channel, self.channel = self.channel, None
        if channel is not None:
            try:
                await channel.close()
            except TransportError as exc:
                raise RunClientError(f"closing the control channel to {self.where}: {exc}") from exc

    async def call(self, op: ChannelOp) -> Any:
        """Any op answered by one reply, as its declared type: a new op needs no method here (those below name theirs)."""
        return await self._decoded(op)

    async def _decoded(self, op: ChannelOp) -> Any:
        """The op's reply as its declared type (the op's Reply); a reply that is not one (a field of the wrong type) is
        an error naming the field, not a screen that shows half of it."""
        try:
            return decode_result(op, (await self._op(op)).result, f"{op.op} reply from {self.where}")
        except WireError as exc:
            raise RunClientError(f"{exc} (is the engine there another version than this console's?)") from exc

    async def _op(self, op: ChannelOp) -> Reply:
        """The op's ok reply (an error reply raises); its result's wire type comes from _decoded."""
        if self.channel is None:
            return await self._ctl(*ctl_argv(op))
        try:
            reply = await self.channel.call(op, timeout=CTL_TIMEOUT_S)
        except ChannelClosed as exc:
            raise RunClientError(f"{exc}; {op.op} may or may not have been done (not sent again)",
                                 kind=ClientErrorKind.UNREACHABLE) from exc.transport
        except asyncio.TimeoutError as exc:
            raise RunClientError(f"control channel to {self.where}: no reply to {op.op} in {CTL_TIMEOUT_S:g} s; "
                                 "it may or may not have been done (not sent again)",
                                 kind=ClientErrorKind.UNREACHABLE) from exc
        return self._result(reply)

    def _result(self, reply: Reply, stderr: str = "") -> Reply:
        if reply.ok:
            return reply
        if reply.kind is ErrorKind.NO_SUPERVISOR:
            raise NoSupervisor(f"no supervisor at {self.where}: {reply.error}", stderr=stderr or reply.error)
        raise RunClientError(f"{self.where}: {reply.error or stderr or 'error reply'}",
                             kind=ClientErrorKind.ERROR, stderr=stderr)

    async def _ctl(self, *args: str) -> Reply:
        command = self._command(*args)
        try:
            result = await self.transport.run(command, timeout=CTL_TIMEOUT_S)
        except TransportError as exc:
            raise RunClientError(f"cannot reach {self.transport.name}: {exc}",
                                 kind=ClientErrorKind.UNREACHABLE) from exc
        stderr = result.stderr.strip()
        if result.exit_status is None:
            why = "timed out" if result.timed_out else (result.error or "no exit status")
            raise RunClientError(f"`{command}` on {self.transport.name}: {why}; stderr: {stderr or '(empty)'}",
                                 kind=ClientErrorKind.UNREACHABLE, stderr=stderr)
        if result.exit_status == EXIT_UNREACHABLE:
            raise NoSupervisor(f"no supervisor at {self.where}: {stderr or '(no stderr)'}", stderr=stderr)
        reply = None
        for line in reversed(result.stdout.splitlines()):
            if line.strip().startswith("{"):
                try:
                    reply = decode_reply(line)
                except ProtocolError:
                    continue
                break
        if reply is None:
            raise RunClientError(
                f"`{command}` on {self.transport.name} exited {result.exit_status} without a JSON reply;"
                f" stderr: {stderr or '(empty)'}; stdout: {result.stdout.strip()[:500] or '(empty)'}",
                kind=ClientErrorKind.UNREACHABLE if result.exit_status != EXIT_ERROR_REPLY else ClientErrorKind.ERROR,
                stderr=stderr)
        return self._result(reply, stderr)

    async def status(self, shards: bool = True) -> RunStatus:
        """shards=False: without the shard list (a console that folds the shard events has it); an engine deployed
        before the option existed refuses it (argparse), and the full status is asked for from then on."""
        if shards or self._ctl_lacks_no_shards:
            return await self._decoded(Status())
        try:
            return await self._decoded(Status(shards=False))
        except NoSupervisor as exc:
            if self.channel is not None or "unrecognized arguments: --no-shards" not in exc.stderr:
                raise
            self._ctl_lacks_no_shards = True
            return await self._decoded(Status())

    async def last_status(self) -> RunStatus:
        """What the run dir last recorded, without a supervisor (a finished or killed run)."""
        return await self._decoded(LastStatus())

    async def pause(self, shards: list[str] | None) -> ShardsChanged:
        return await self._decoded(Pause(shards=None if shards is None else tuple(shards)))

    async def resume(self, shards: list[str] | None) -> ShardsChanged:
        return await self._decoded(Resume(shards=None if shards is None else tuple(shards)))

    async def restart_worker(self, name: str) -> WorkerRestarted:
        return await self._decoded(RestartWorker(worker=name))

    async def log_tail(self, worker: str, lines: int) -> LogText:
        return await self._decoded(LogTail(worker=worker, lines=lines))

    async def drain(self) -> RunEnding:
        return await self._decoded(Drain())

    async def drain_host(self, host: str, undo: bool = False) -> HostStatus:
        return await self._decoded(UndrainHost(host=host) if undo else DrainHost(host=host))

    async def stop(self) -> RunEnding:
        return await self._decoded(Stop())

    async def follow(self, since: float | None = None,
                     on_malformed: Callable[[str], None] = lambda why: None) -> AsyncIterator[Event]:
        """The run's telemetry events from `since`, until the supervisor has exited and every event was sent: over the
        open channel (protocol 2), else one `engine.ctl follow` process. A line that is not an event of this
        console's wire (a field of the wrong type) is skipped and said to on_malformed, an event type newer than this
        console skipped quietly. The stream's loss raises TransportError (the connection) or RunClientError."""
        channel = self.channel
        if channel is not None and channel.can_follow:
            try:
                async for line in channel.follow(Follow(since=since)):
                    ev = self._event(line.event, on_malformed)
                    if ev is not None:
                        yield ev
            except ChannelClosed as exc:
                if exc.transport is not None:
                    raise exc.transport
                raise RunClientError(f"{exc}; following again", kind=ClientErrorKind.UNREACHABLE) from exc
            except FollowRefused as exc:  # as the one-process follow's exit status 2: checked again, later
                raise RunClientError(f"telemetry of {self.where}: {exc}", kind=ClientErrorKind.UNREACHABLE) from exc
            return
        async for text in self.transport.stream_lines(self._command(*ctl_argv(Follow(since=since)))):
            if not text.strip():
                continue
            try:
                ev = self._event(orjson.loads(text), on_malformed)
            except orjson.JSONDecodeError as exc:
                on_malformed(f"telemetry from {self.where}: not JSON: {exc}")
                continue
            if ev is not None:
                yield ev

    def _event(self, data: Any, on_malformed: Callable[[str], None]) -> Event | None:
        try:
            return event_from_dict(data)
        except UnknownEventType:
            return None  # a newer engine's event: the rest still shows
        except WireError as exc:
            on_malformed(f"telemetry from {self.where}: {exc}")
            return None
