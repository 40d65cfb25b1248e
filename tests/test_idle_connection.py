"""A pooled connection the server closed while idle is resent at once, uncounted; other disconnects count.

uvicorn closes keep-alive connections idle for 5 s (contract 7.4). A request sent on such a pooled
connection as it closes sees "Server disconnected" before any byte of an answer. The server here
reproduces that moment exactly: it answers the first request of each connection and closes the
connection, unanswered, when a second request arrives on it (the dispatcher's next request reuses the
pooled connection). The same server can also drop a request on a fresh connection, or mid-answer:
those reached the server and are counted as before.
"""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from engine.http_client import KEEPALIVE_S, client_session
from engine.run.dispatch.client import STREAM_END_WAIT_S
from engine.run.items import Generated, Retry
from tests.test_dispatcher_requeue import make_dispatcher, make_item
from tests.waiting import await_until

pytestmark = pytest.mark.timeout(60)

ANSWER = json.dumps({"output_ids": [11, 12, 13], "text": "abc",
                     "meta_info": {"finish_reason": {"type": "stop"}, "completion_tokens": 3}}).encode()
STREAMED = b"data: " + ANSWER + b"\n\ndata: [DONE]\n\n"  # the same answer as one final chunk (stream: true)


class LoopbackServer:
    """An asyncio server on a free loopback port; a subclass's _serve answers each connection."""

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        self.server.close()
        await self.server.wait_closed()


class ClosingServer(LoopbackServer):
    """HTTP/1.1 keep-alive server. mode: `reused` closes a connection when its second request arrives;
    `first` closes every connection on its first request; `mid` sends headers and half a body, then closes."""

    def __init__(self, mode: str):
        self.mode = mode
        self.connections = 0
        self.answered = 0
        self.dropped = 0


    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        requests = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = await reader.readexactly(length)
                streamed = bool(json.loads(body).get("stream"))
                answer, kind = (STREAMED, b"text/event-stream") if streamed else (ANSWER, b"application/json")
                requests += 1
                if (self.mode == "reused" and requests > 1) or self.mode == "first":
                    self.dropped += 1
                    return  # closed unanswered (finally)
                if self.mode == "mid":
                    self.dropped += 1
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\n" % kind
                                 + b"Content-Length: %d\r\n\r\n" % len(answer) + answer[:10])
                    await writer.drain()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nConnection: keep-alive\r\n" % kind
                             + b"Content-Length: %d\r\n\r\n" % len(answer) + answer)
                await writer.drain()
                self.answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed its end
        finally:
            writer.close()


def _dispatcher(session, url, guard: bool = True):
    d, w, plan, events = make_dispatcher(session, url)
    cfg = d.client.cfg
    d.client.cfg = cfg.model_copy(update=dict(runaway=cfg.runaway.model_copy(update=dict(enabled=guard))))
    outcomes: list[object] = []
    d.answers.deliver = outcomes.append
    d.answers.renderer = SimpleNamespace(answer_text=lambda ids, text, matched: (text, False), reasoning_tokens=lambda ids, prompt_opened=False: 0)
    return d, w, outcomes, events


def test_pooled_connections_are_given_up_before_uvicorns_5_s():
    assert KEEPALIVE_S < 5


@pytest.mark.parametrize("guard", [True, False], ids=["streamed", "not-streamed"])
async def test_a_reused_connection_closed_while_idle_is_resent_without_a_retry(guard):
    server = ClosingServer("reused")
    url = await server.start()
    session = client_session()
    d, w, outcomes, events = _dispatcher(session, url, guard)
    try:
        first, second = make_item("a#turn0", [1, 2, 3]), make_item("b#turn0", [4, 5])
        await d._send(w, first)  # opens the connection, which goes back to the pool
        await d._send(w, second)  # reuses it: the server closes it unanswered, as an idle close does
    finally:
        await d.close()
        await session.close()
        await server.close()
    assert server.dropped == 1 and server.connections == 2  # the resend went out on a new connection
    assert [type(o).__name__ for o in outcomes] == ["Generated", "Generated"]
    assert [o.item.sample_id for o in outcomes] == ["a#turn0", "b#turn0"]
    assert outcomes[1].row.output_ids.tolist() == [11, 12, 13]
    assert second.attempt == 0 and d.retried == 0  # no retry counted, no backoff
    assert events == []  # no alert either


@pytest.mark.parametrize("mode,error", [("first", "ServerDisconnectedError"), ("mid", "ClientPayloadError")])
async def test_a_disconnect_after_the_request_reached_the_server_still_counts(mode, error):
    server = ClosingServer(mode)
    url = await server.start()
    session = client_session()
    d, w, outcomes, _ = _dispatcher(session, url)
    item = make_item("a#turn0", [1, 2, 3])
    try:
        await d._send(w, item)
    finally:
        await d.close()
        await session.close()
        await server.close()
    assert server.connections == 1  # not resent
    assert len(outcomes) == 1 and isinstance(outcomes[0], Retry)
    assert outcomes[0].delay_s > 0 and item.attempt == 1 and d.retried == 1
    assert error in item.last_error


async def test_the_resend_counts_as_usual_when_it_fails_too():
    server = ClosingServer("reused")
    url = await server.start()
    session = client_session()
    d, w, outcomes, _ = _dispatcher(session, url)
    try:
        await d._send(w, make_item("a#turn0", [1]))
        server.mode = "first"  # the new connection is dropped too: that one reached the server
        item = make_item("b#turn0", [2])
        await d._send(w, item)
    finally:
        await d.close()
        await session.close()
        await server.close()
    assert isinstance(outcomes[0], Generated) and isinstance(outcomes[1], Retry)
    assert item.attempt == 1 and d.retried == 1 and server.connections == 2


class LateEndServer(LoopbackServer):
    """Streams each answer as SGLang does (chunked SSE): its final chunk at once, then `data: [DONE]` and the
    body's end only once `release` is set."""

    def __init__(self):
        self.connections = 0
        self.requests = 0
        self.release = asyncio.Event()


    @staticmethod
    def _chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                self.requests += 1
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n" + self._chunk(b"data: " + ANSWER + b"\n\n"))
                await writer.drain()
                await self.release.wait()
                writer.write(self._chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_a_streamed_answer_is_taken_at_its_final_chunk_and_its_connection_pooled_when_the_end_arrives():
    """The request's task does not wait for `data: [DONE]` and the body's end after the final chunk; aiohttp gives
    the connection back to the pool when they arrive, and the next request rides it."""
    server = LateEndServer()
    url = await server.start()
    session = client_session()
    d, w, outcomes, _ = _dispatcher(session, url)
    try:
        await d._send(w, make_item("a#turn0", [1, 2, 3]))  # returns with [DONE] still held by the server
        assert [type(o).__name__ for o in outcomes] == ["Generated"] and not server.release.is_set()
        assert len(d.client._unended) == 1
        assert outcomes[0].row.output_ids.tolist() == [11, 12, 13] and outcomes[0].row.finish_reason == "stop"
        server.release.set()
        await await_until(lambda: session.connector._conns, 10, "the connection back in the pool")
        d.client.close_unended(time.monotonic())  # the next capacity tick forgets it: its end came
        assert not d.client._unended
        await d._send(w, make_item("b#turn0", [4, 5]))
    finally:
        await d.close()
        await session.close()
        await server.close()
    assert [type(o).__name__ for o in outcomes] == ["Generated", "Generated"]
    assert server.connections == 1 and server.requests == 2 and d.retried == 0 and d.client.unended_closed == 0


async def test_a_stream_whose_end_never_comes_keeps_its_answer_and_its_connection_is_closed():
    server = LateEndServer()
    url = await server.start()
    session = client_session()
    d, w, outcomes, _ = _dispatcher(session, url)
    try:
        await d._send(w, make_item("a#turn0", [1, 2, 3]))
        d.client.close_unended(time.monotonic() + STREAM_END_WAIT_S)  # its end not come in time: closed, not pooled
        assert d.client.unended_closed == 1 and not d.client._unended
        await d._send(w, make_item("b#turn0", [4, 5]))
    finally:
        server.release.set()
        await d.close()
        await session.close()
        await server.close()
    assert [type(o).__name__ for o in outcomes] == ["Generated", "Generated"]
    assert server.connections == 2 and d.retried == 0
