"""The SGLang HTTP client of dispatch: POST /generate (streamed under the runaway guard) and POST /abort_request.

It speaks sglang_contract.md exactly: a pooled connection uvicorn closed while idle is resent on a new one (7.4),
a stream's end ([DONE]) is left to aiohttp to pool its connection, and a runaway is stopped by its rid.
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from typing import Awaitable, Callable

import aiohttp
import orjson
from multidict import CIMultiDict
from yarl import URL

from engine.api.events import AlertEvent, Event
from engine.api.wire import Severity
from engine.config.load import RunConfig
from engine.http_client import ConnectionMark, dropped_idle, fresh_session, marking
from engine.run.answer_stream import AnswerStream, StreamError
from engine.run.items import WorkItem
from engine.run.runaway import Repetition, RunawayDetector
from engine.servers.target import DispatchTarget

log = logging.getLogger("regen.dispatch")

STREAM_END_WAIT_S = 10.0  # a stream's end ([DONE]) not come this long after its final chunk: its connection closed
# sglang-router's 503 when it has no server to route to ({"error": {"code": "no_available_workers", "message": "No
# available workers (all circuits open or unhealthy)"}}): the request reached no server
NO_SERVERS_CODE = "no_available_workers"
NO_SERVERS_TEXT = "No available workers"
# a request that never got an answer raises one of these out of generate()
SEND_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError, StreamError)
# what POST /generate's response is read into: its body, or (streamed) the answer followed chunk by chunk
Answer = bytes | AnswerStream


class SGLangClient:
    """Sends one request and reads its answer; stops requests by rid. `on_output(rid)` is called at each chunk of
    a streamed answer (the request runs: it is no longer in its server's waiting queue)."""

    def __init__(self, cfg: RunConfig, session: aiohttp.ClientSession, emit: Callable[[Event], None],
                 on_output: Callable[[str], None]):
        self.cfg = cfg
        self.session = session
        self.emit = emit
        self.on_output = on_output
        self._aborts: set[asyncio.Task[None]] = set()  # /abort_request calls in flight (kept referenced until done)
        self._abort_alerted: set[str] = set()
        self._unstreamed_alerted: set[str] = set()
        # per worker, (its url, the /generate URL, the request headers), built once in aiohttp's own types
        # (yarl's URL, multidict's CIMultiDict, both aiohttp's dependencies): handed a str and a dict,
        # aiohttp parses the URL and copies the headers again on every request
        self._generate_target: dict[str, tuple[str, URL, CIMultiDict[str]]] = {}
        self._request_timeout = aiohttp.ClientTimeout(total=cfg.dispatch.request_timeout_s)
        self._fresh: aiohttp.ClientSession | None = None  # one-connection-per-request, for a resend after an idle drop
        # streams answered at their final chunk whose end is still on its way: (when to give up on it, response)
        self._unended: collections.deque[tuple[float, aiohttp.ClientResponse]] = collections.deque()
        self.unended_closed = 0  # of those, closed because their end did not come

    async def close(self) -> None:
        self.close_unended()
        if self._fresh is not None:
            await self._fresh.close()

    def _target(self, w: DispatchTarget) -> tuple[str, URL, CIMultiDict[str]]:
        target = self._generate_target.get(w.name)
        if target is None or target[0] != w.url:
            target = (w.url, URL(w.url + "/generate"), CIMultiDict({**w.headers, "Content-Type": "application/json"}))
            self._generate_target[w.name] = target
        return target

    async def generate(self, w: DispatchTarget, item: WorkItem) -> tuple[int, Answer]:
        """POST /generate of `item`: (status, its body or, streamed with a 200, its AnswerStream). Raises one of
        SEND_ERRORS when no answer came."""
        params = self.cfg.sampling.as_sglang()
        params["max_new_tokens"] = item.max_new_tokens
        guard = self.cfg.runaway.enabled
        if guard:
            params["stream_interval"] = self.cfg.runaway.stream_interval
        payload = {"rid": item.rid, "input_ids": item.prompt_ids, "sampling_params": params, "stream": guard}
        _, url, headers = self._target(w)
        read: Callable[[aiohttp.ClientResponse], Awaitable[Answer]] = (
            functools.partial(self._read_stream, w, item) if guard else _read_body)
        return await self._post(w, item, url, orjson.dumps(payload), headers, read)

    async def _post(self, w: DispatchTarget, item: WorkItem, url: URL, data: bytes, headers: CIMultiDict[str],
                    read: Callable[[aiohttp.ClientResponse], Awaitable[Answer]]) -> tuple[int, Answer]:
        """POST /generate: (status, what `read` made of the response: the body, or an AnswerStream). A pooled
        connection the server had closed while idle (uvicorn closes them after 5 s, contract 7.4) is no fault of
        the server's: the request is sent again at once on a new connection, without a retry counted or a backoff.
        Any other failure raises as it came."""
        mark = ConnectionMark()
        sent = time.monotonic()
        try:
            with marking(mark):
                resp = await self.session.post(url, data=data, headers=headers, timeout=self._request_timeout)
        except (aiohttp.ClientError, OSError) as exc:
            if not dropped_idle(exc, mark, time.monotonic() - sent):
                raise
            log.info("%s: %s on a reused connection before any answer (closed while idle): %s sent again on a new"
                     " connection", w.name, type(exc).__name__, item.rid)
            if self._fresh is None:
                self._fresh = fresh_session()
            resp = await self._fresh.post(url, data=data, headers=headers, timeout=self._request_timeout)
        return resp.status, await self._answer_of(resp, read)

    async def _answer_of(self, resp: aiohttp.ClientResponse,
                         read: Callable[[aiohttp.ClientResponse], Awaitable[Answer]]) -> Answer:
        """`read(resp)`, then the response released (as `async with` would), unless it is a stream read up to its
        final chunk whose end ([DONE], the chunked body's last chunk) is still on its way: aiohttp gives that
        connection back to the pool itself when the end arrives (the response's own end-of-body callback), with no
        wake-up of this task for it (released now, a connection whose body has not ended is closed, not pooled).
        One whose end has not come STREAM_END_WAIT_S later is released then (closed)."""
        try:
            answer = await read(resp)
        except BaseException:
            resp.release()
            raise
        if not (isinstance(answer, AnswerStream) and answer.finish is not None):
            resp.release()
        elif not resp.closed:
            self._unended.append((time.monotonic() + STREAM_END_WAIT_S, resp))
        return answer

    def close_unended(self, now: float | None = None) -> None:
        """Forget the streams whose end has come since (from the oldest on: most ends come within milliseconds, so the
        list holds about one capacity tick of answers) and release those whose end has not come STREAM_END_WAIT_S
        after their final chunk (now None: all)."""
        while self._unended:
            deadline, resp = self._unended[0]
            if not resp.closed and now is not None and deadline > now:
                break
            self._unended.popleft()
            if not resp.closed:
                self.unended_closed += 1
                if self.unended_closed == 1:
                    log.info("a stream's end ([DONE]) did not come %g s after its final chunk: its connection closed "
                             "(logged once)", STREAM_END_WAIT_S)
                resp.release()

    async def _read_stream(self, w: DispatchTarget, item: WorkItem, resp: aiohttp.ClientResponse) -> Answer:
        """A 200 answer followed chunk by chunk (an AnswerStream); any other status: its body, read whole. Once the
        guard has stopped the request, a stream that breaks off is still the answer: what it delivered is exact."""
        if resp.status != 200:
            return await resp.read()
        if resp.content_type != "text/event-stream":
            # not a stream (something in between that buffers, or no SGLang): the whole answer, unguarded
            if w.name not in self._unstreamed_alerted:
                self._unstreamed_alerted.add(w.name)
                self.emit(AlertEvent(
                    severity=Severity.WARNING, text=f"{w.name}: /generate did not stream (stream: true): the runaway guard "
                    "cannot stop its loops", evidence=f"{item.rid}: Content-Type {resp.content_type}",
                    key=f"not-streamed:{w.name}"))
            return await resp.read()
        answer = AnswerStream(RunawayDetector(self.cfg.runaway))
        try:
            read = resp.content.readany
            while answer.finish is None and (data := await read()):
                self.on_output(item.rid)
                verdict = answer.feed(data)
                if verdict is not None:
                    self._stop_runaway(w, item, verdict)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, StreamError) as exc:
            if answer.verdict is None:
                raise
            log.warning("%s: the stream of %s, stopped as a runaway, broke off (%s: %s): %d ids kept", w.name,
                        item.rid, type(exc).__name__, exc, len(answer.ids))
        return answer

    def _stop_runaway(self, w: DispatchTarget, item: WorkItem, verdict: Repetition) -> None:
        log.info("%s: %s is a runaway (%s): aborting it", w.name, item.rid, verdict.describe())
        self.abort_soon(w, item.rid, "runaway", on_failure=functools.partial(self._abort_failed, w, item.rid))

    def _abort_failed(self, w: DispatchTarget, rid: str, problem: str) -> None:
        if w.name not in self._abort_alerted:
            self._abort_alerted.add(w.name)
            self.emit(AlertEvent(
                severity=Severity.WARNING, text=f"{w.name}: /abort_request failed: runaway answers run to max_new_tokens",
                evidence=f"{rid}: {problem}", key=f"abort-failed:{w.name}"))

    def abort_soon(self, w: DispatchTarget, rid: str, why: str, on_failure: Callable[[str], None]) -> None:
        """abort() in a task of its own (kept referenced until done); on_failure(problem) if the server refused it."""
        task = asyncio.create_task(self._abort_one(w, rid, why, on_failure),
                                   name=f"{'move' if why == 'moving' else 'abort'}-{rid}")
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort_one(self, w: DispatchTarget, rid: str, why: str, on_failure: Callable[[str], None]) -> None:
        """POST /abort_request {"rid"}: SGLang ends the request at its next step and streams the final chunk. The
        scheduler matches rids by prefix; no other request in flight starts with this one (a later turn of the same
        conversation, the only rid it prefixes, waits for this answer)."""
        problem = None
        try:
            async with self.session.post(w.url + "/abort_request", json={"rid": rid}, headers=w.headers,
                                         timeout=aiohttp.ClientTimeout(total=10)) as resp:
                text = await resp.text()
                if resp.status != 200:
                    problem = f"HTTP {resp.status}: {text[:200]}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem is None:
            return
        log.warning("%s: /abort_request for %s %s failed: %s", w.name, why, rid, problem)
        on_failure(problem)

    async def abort_all(self, w: DispatchTarget) -> None:
        """POST /abort_request abort_all: every request in flight on `w` comes back as an abort."""
        try:
            async with self.session.post(w.url + "/abort_request", json={"rid": "", "abort_all": True},
                                         headers=w.headers, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                text = await resp.text()
                if resp.status != 200:
                    log.warning("abort on %s: HTTP %d %s", w.name, resp.status, text[:200])
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("abort on %s failed: %s", w.name, exc)


async def _read_body(resp: aiohttp.ClientResponse) -> bytes:
    return await resp.read()


def no_servers(body: bytes) -> bool:
    """A router's 503 that says it had no server to route to (sglang-router's `no_available_workers`)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return NO_SERVERS_TEXT in body[:500].decode("utf-8", errors="replace")
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict) and err.get("code") == NO_SERVERS_CODE:
        return True
    return NO_SERVERS_TEXT in error_message(body)


def error_message(body: bytes) -> str:
    """The message of an SGLang (or router) error body, else its first 500 bytes."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:500].decode("utf-8", errors="replace")
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "message" in data:
            return str(data["message"])
    return body[:500].decode("utf-8", errors="replace")
