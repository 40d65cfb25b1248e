"""The HTTP client to the SGLang servers: a pool whose idle connections end before the server ends them,
and a mark saying whether a request rode a pooled (reused) connection."""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from aiohttp.client_proto import ResponseHandler
    from aiohttp.client_reqrep import ClientRequest
    from aiohttp.connector import Connection
    from aiohttp.tracing import Trace

# uvicorn, under every SGLang version, closes a keep-alive connection idle for 5 s (contract 7.4: 0.5.5
# http_server.py:1387, 0.5.23 SGLANG_TIMEOUT_KEEP_ALIVE=5); aiohttp keeps one pooled for 15 s by default,
# so a request sent on it after 5 s meets a closed socket ("Server disconnected"). Giving pooled
# connections up first leaves only the race of a close in flight (the dispatcher resends those).
KEEPALIVE_S = 4.0
# A connection the server closed while idle fails the request within a round trip of sending it; a
# disconnect later than this came after the server had the request (a crash, a kill): not an idle close.
DROP_WINDOW_S = 2.0


@dataclass
class ConnectionMark:
    """Set when the request sent within `marking(mark)` went out on a reused (pooled) connection."""
    reused: bool = False


_MARK: ContextVar[ConnectionMark | None] = ContextVar("regen_connection_mark", default=None)


@contextlib.contextmanager
def marking(mark: ConnectionMark) -> Iterator[ConnectionMark]:
    """Requests sent in this block (by this task, and by tasks it creates meanwhile: they inherit the context) set
    `mark.reused` when they ride a pooled connection. The mark is read only for a failure before any answer."""
    token = _MARK.set(mark)
    try:
        yield mark
    finally:
        _MARK.reset(token)


class MarkingConnector(aiohttp.TCPConnector):
    """A TCPConnector that says whether connect() handed out a connection it had handed out before (a pooled one)
    to the ConnectionMark of the request's task. aiohttp's tracing (on_connection_reuseconn) says the same, but a
    session with a trace config sends every signal of every request: ~50-70 us of client CPU a request, ~10% of
    what the engine spends on a 4,000-token answer."""

    def __init__(self, **kwargs: Any) -> None:  # Any: TCPConnector's own keyword arguments, passed on
        super().__init__(**kwargs)
        self._handed_out: weakref.WeakSet[ResponseHandler] = weakref.WeakSet()

    async def connect(self, req: ClientRequest, traces: list[Trace], timeout: aiohttp.ClientTimeout) -> Connection:
        conn = await super().connect(req, traces, timeout)
        proto = conn.protocol
        if proto is not None:
            if proto in self._handed_out:
                mark = _MARK.get()
                if mark is not None:
                    mark.reused = True
            else:
                self._handed_out.add(proto)
        return conn


def client_session() -> aiohttp.ClientSession:
    """The supervisor's one session to its servers (no connection limit: the dispatcher sizes the load)."""
    return aiohttp.ClientSession(connector=MarkingConnector(limit=0, keepalive_timeout=KEEPALIVE_S))


def fresh_session() -> aiohttp.ClientSession:
    """A session whose every request opens its own connection (never a pooled one that may be closing)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))


def dropped_idle(exc: BaseException, mark: ConnectionMark, elapsed_s: float) -> bool:
    """A reused connection that the server had closed (idle) when the request went out: it failed with a
    disconnect or reset before any byte of a response (the caller's to know), at once. Never a failure to
    connect: that is the server's."""
    return (mark.reused and elapsed_s < DROP_WINDOW_S
            and isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError))
            and not isinstance(exc, aiohttp.ClientConnectorError))
