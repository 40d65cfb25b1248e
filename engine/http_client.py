"""The HTTP client to the SGLang servers: a pool whose idle connections end before the server ends them,
and a mark saying whether a request rode a pooled (reused) connection."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import aiohttp

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
    """Passed as a request's trace_request_ctx: set when the request was sent on a reused connection."""
    reused: bool = False


async def _on_reuse(session: aiohttp.ClientSession, ctx: SimpleNamespace, params: object) -> None:
    mark = ctx.trace_request_ctx
    if isinstance(mark, ConnectionMark):
        mark.reused = True


def reuse_tracer() -> aiohttp.TraceConfig:
    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(_on_reuse)
    return trace


def client_session() -> aiohttp.ClientSession:
    """The supervisor's one session to its servers (no connection limit: the dispatcher sizes the load)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                                 trace_configs=[reuse_tracer()])


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
