"""One long-lived `engine.ctl serve` process on the host carrying an attached console's control ops: requests carry
ids, a reader task hands each reply (and a follow's events) to its caller. An engine without hello raises
OlderProtocol (the caller goes one process per op); once the channel ends every call raises ChannelClosed, and an op
in flight then is never sent again."""
from __future__ import annotations

import asyncio
import itertools
from typing import AsyncIterator

from console.host.transport import Ended, Process, Transport, TransportError
from engine.api.protocol import (PROTOCOL_VERSION, SUPPORTED_PROTOCOLS, ProtocolError, Reply, Request, decode_reply,
                                 encode_request)
from engine.api.ops import ChannelOp, Follow, Hello, HelloResult
from engine.api.op_codec import decode_result
from engine.api.wire import WireError

HELLO_TIMEOUT_S = 30.0  # a new interpreter and its imports on a loaded host
READER_END_WAIT_S = 5.0  # a send failed: how long the reader may take to say how the process ended


class ChannelClosed(Exception):
    """The channel's process ended (`ended`) or its connection broke (`transport`); the text says how."""

    def __init__(self, message: str, transport: TransportError | None = None, ended: Ended | None = None):
        super().__init__(message)
        self.transport = transport
        self.ended = ended


class FollowRefused(Exception):
    """The engine answered a follow with an error (no run dir, no telemetry and no supervisor): the text says which."""


class OlderProtocol(Exception):
    """The engine does not speak this console's channel; the text is the note for the operator."""


class ControlChannel:
    def __init__(self, process: Process, where: str):
        self.process = process
        self.where = where  # host:run_dir, for messages
        self.hello: HelloResult | None = None
        self.closed: ChannelClosed | None = None  # set once the channel can carry nothing more
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Reply]] = {}
        self._streams: dict[int, asyncio.Queue[Reply | ChannelClosed]] = {}  # a follow's events, then its last reply
        self._left: set[int] = set()  # follows whose reader stopped listening: their lines are dropped
        self._send_lock = asyncio.Lock()
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def open(cls, transport: Transport, command: str, where: str,
                   hello_timeout: float = HELLO_TIMEOUT_S) -> "ControlChannel":
        """Start `command` (engine.ctl serve) and say hello; OlderProtocol, ChannelClosed or TransportError if not."""
        channel = cls(await transport.open_process(command), where)
        try:
            reply = await channel.call(Hello(), timeout=hello_timeout)
            if not reply.ok:
                raise OlderProtocol(f"engine at {where} refused hello ({reply.error}): one process per op")
            try:
                channel.hello = decode_result(Hello(), reply.result, f"hello's reply from {where}")
            except WireError as exc:
                raise ProtocolError(str(exc)) from exc
        except ChannelClosed as exc:
            await channel.close()
            if exc.transport is not None:
                raise  # the connection broke: not the engine's answer
            raise OlderProtocol(_no_hello_note(where, exc.ended)) from exc
        except (OlderProtocol, ProtocolError, asyncio.TimeoutError, TransportError, asyncio.CancelledError):
            await channel.close()
            raise
        if channel.hello.protocol not in SUPPORTED_PROTOCOLS:
            await channel.close()
            raise OlderProtocol(f"engine {channel.hello.engine_version} at {where} speaks protocol "
                                f"{channel.hello.protocol}, this console {PROTOCOL_VERSION}: one process per op")
        return channel

    async def call(self, op: ChannelOp, timeout: float) -> Reply:
        """Send one op and wait for its reply; ChannelClosed when the channel ends first, TimeoutError (the channel
        is closed then: a reply that comes late would answer nobody) when none comes in `timeout` s."""
        if self.closed is not None:
            raise self.closed
        rid = next(self._ids)
        waiter: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = waiter
        try:
            async with self._send_lock:  # one request line at a time: lines never interleave
                try:
                    await self.process.write(encode_request(Request(rid, op)))
                except TransportError as exc:
                    # the process may have ended before reading: the reader says how (its exit status, its stderr)
                    await asyncio.wait([self._reader], timeout=READER_END_WAIT_S)
                    self._fail(ChannelClosed(f"control channel to {self.where}: {exc}", exc))
            try:
                return await asyncio.wait_for(asyncio.shield(waiter), timeout)
            except asyncio.TimeoutError:
                self._waiting.pop(rid, None)
                waiter.cancel()
                self._fail(ChannelClosed(f"control channel to {self.where}: no reply to {op.op} in {timeout:g} s; "
                                         "closed"))
                await self.close()
                raise
        finally:
            self._waiting.pop(rid, None)

    @property
    def can_follow(self) -> bool:
        """The engine streams the telemetry over the channel (protocol 2)."""
        return self.hello is not None and self.hello.protocol >= 2

    async def follow(self, op: Follow) -> AsyncIterator[Reply]:
        """A follow's event lines (Reply.event: one telemetry line, for the caller to decode) until its last reply: ends when the supervisor
        has exited and every event was sent; an error reply (nothing to follow) raises FollowRefused, the channel's
        end ChannelClosed. Closing the iterator early leaves the stream: its lines are dropped, and the next follow
        on the channel ends it on the host."""
        if self.closed is not None:
            raise self.closed
        rid = next(self._ids)
        queue: asyncio.Queue[Reply | ChannelClosed] = asyncio.Queue()
        self._streams[rid] = queue
        ended = False  # its last reply came: nothing more will
        try:
            async with self._send_lock:
                try:
                    await self.process.write(encode_request(Request(rid, op)))
                except TransportError as exc:
                    await asyncio.wait([self._reader], timeout=READER_END_WAIT_S)
                    self._fail(ChannelClosed(f"control channel to {self.where}: {exc}", exc))
            while True:
                item = await queue.get()
                if isinstance(item, ChannelClosed):
                    raise item
                if item.event is not None:
                    yield item
                    continue
                ended = True
                if not item.ok:
                    raise FollowRefused(item.error)
                return
        finally:
            self._streams.pop(rid, None)
            if not ended and self.closed is None:
                self._left.add(rid)

    async def _read(self) -> None:
        try:
            while line := await self.process.readline():
                if not line.strip():
                    continue
                try:
                    reply = decode_reply(line)
                except ProtocolError as exc:
                    self._fail(ChannelClosed(f"control channel to {self.where} sent a line that is not a reply: {exc}"))
                    return
                stream = self._streams.get(reply.id) if reply.id is not None else None
                if stream is not None:
                    stream.put_nowait(reply)
                    continue
                if reply.id in self._left:
                    if reply.event is None:
                        self._left.discard(reply.id)  # its last reply: nothing more comes for it
                    continue
                waiter = self._waiting.get(reply.id) if reply.id is not None else None
                if waiter is None:
                    self._fail(ChannelClosed(f"control channel to {self.where} answered request {reply.id}, which "
                                             f"nobody waits for: {reply.error or 'ok'}"))
                    return
                if not waiter.done():
                    waiter.set_result(reply)
            ended = await self.process.ended()
            self._fail(ChannelClosed(f"control channel to {self.where} closed: `engine.ctl serve` {ended}",
                                     ended=ended))
        except TransportError as exc:
            self._fail(ChannelClosed(f"control channel to {self.where}: {exc}", exc))
        except Exception as exc:  # e.g. a line over the reader's limit: every waiting call must hear it, none hang
            self._fail(ChannelClosed(f"control channel to {self.where}: reading the replies failed: "
                                     f"{type(exc).__name__}: {exc}"))

    def _fail(self, closed: ChannelClosed) -> None:
        if self.closed is None:
            self.closed = closed
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(self.closed)
        for stream in self._streams.values():
            stream.put_nowait(self.closed)

    async def close(self) -> None:
        """End the remote process (the reader stops with it)."""
        self._fail(ChannelClosed(f"control channel to {self.where} closed by the console"))
        try:
            await self.process.close()
        finally:
            if not self._reader.done():
                self._reader.cancel()
            await asyncio.wait([self._reader])


def _no_hello_note(where: str, ended: Ended | None) -> str:
    """The operator's note for an engine that ended the channel without answering hello. Exit status 2 is argparse's
    usage error: an engine.ctl without `serve`, i.e. an engine deployed before the channel."""
    if ended is None:
        return f"engine at {where} did not answer hello: one process per op"
    lines = ended.stderr.strip().splitlines()
    said = lines[-1] if lines else "(no stderr)"
    if ended.exit_status == 2:
        return (f"engine at {where} speaks an older protocol (its engine.ctl has no `serve`: {said}): "
                "one process per op")
    return f"engine at {where} did not answer hello (`engine.ctl serve` {ended.how}: {said}): one process per op"
