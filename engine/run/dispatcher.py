"""Sends work items to the SGLang workers: native POST /generate, pull model; streamed under the runaway guard.

Each ready worker runs its own loop that pulls an item from the ledger's ready queue only when it
has a free slot, so a slow worker never holds the others back. Every item sent comes back as one
outcome (engine.run.items), handed to `deliver`: the run routes `Generated` to the committer and
the rest to the ledger; the dispatcher settles nothing itself. A worker's slot count is
`dispatch.max_in_flight_per_worker` (the operator's fixed override), or what the server can run now plus a
small queue margin: its batch size (discovered: engine/servers/capacity.py) cut to what its KV pool holds (prompt plus
expected output: engine/run/request_size.py), then corrected from the server's own running / queued / token
usage gauges (engine/run/batch_feedback.py) so its queue stays short but non-empty. Work waits in regen's queue,
where any server can take it.

Work is spread (engine/run/spread.py): while regen's queue holds fewer items than the ready servers have free slots
(a run's start, its tail), a worker takes an item only while it holds less than its fair share of the work left,
counting servers still starting for START_GRACE_S after the first was ready, so a server that is ready a few
seconds late still gets its share and the last samples end together.

Work already sent can be moved: when regen's queue is empty, a server has run under its batch with an empty
queue of its own for MOVE_AFTER_S while another server's own queue holds requests, the latest requests sent to
that one which have produced no output yet are stopped with POST /abort_request {"rid"}. A request still waiting
comes back unrun ("Abort in waiting queue") and is re-queued at the front, once, by its rid, without counting an
attempt (logged "moved"); one that had started meanwhile comes back with what it generated and is retried as any
aborted answer; one that finished first is committed as usual. Each request sent has exactly one outcome either way.

A server that fails a request (an HTTP error other than a refusal, a broken connection) takes no new work for a
moment, doubling while it goes on failing (FAULT_PAUSE_S, up to dispatch.retry_backoff_s): a server whose scheduler
has died answers every request at once, and its loop would otherwise pass regen's whole queue through it into retry
backoff before the supervisor sees the crash, leaving the other servers without work (bench_spread restart: 785 items
in 60 ms).

With the runaway guard on ([runaway] enabled, the default) each answer is streamed (`stream: true`, a chunk every
runaway.stream_interval tokens) and followed by engine.run.answer_stream, which keeps the ids exact and feeds the
detector (engine.run.runaway), up to its final chunk: the stream's end (`data: [DONE]`) is left to aiohttp, which
pools the connection when it comes, without waking the request's task. Once the detector fires, the request is
stopped with POST /abort_request {"rid"}. The server then ends the stream with a final chunk (finish_reason abort)
carrying the ids it generated meanwhile: the sample is committed with every id the stream delivered, finish_reason
"repetition" (never retried, never a worker fault).
"""
from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from array import array
from collections.abc import Sequence
from typing import Any, Awaitable, Callable, Protocol, cast

import aiohttp
import orjson
from multidict import CIMultiDict
from yarl import URL

from engine.servers.capacity import BatchSize, BatchSource, kv_fit
from engine.config.load import RunConfig
from engine.http_client import ConnectionMark, dropped_idle, fresh_session, marking
from engine.text.render import Renderer
from engine.run.answer_stream import AnswerStream, StreamError, int32_array
from engine.run import reply_json
from engine.run.batch_feedback import corrected, margin_for
from engine.run.items import Failed, Generated, Outcome, Rejected, Retry, SampleRow, WorkItem
from engine.run.request_size import RequestSize
from engine.run.runaway import Repetition, RunawayDetector
from engine.run.spread import ServerLoad, StrandedWatch, room, within_share
from engine.store.names import REPETITION
from engine.api.events import AlertEvent, Event
from engine.servers.target import DispatchTarget
from engine.servers.workers import WorkerState
from engine.api.wire import Severity

log = logging.getLogger("regen.dispatch")

DUPLICATE_RID = "Duplicate request ID"  # SGLang 0.5.10+ refuses a rid that is already running
CAPACITY_TICK_S = 0.5  # each server's size is corrected from its gauges this often (a fresh reading each time)
SHARE_POLL_S = 0.05  # a worker at its fair share looks again this often
START_GRACE_S = 10.0  # a server still starting counts in the fair share this long after the first one was ready
MOVE_AFTER_S = 1.0  # a server under its batch with an empty queue this long takes work waiting in another's queue
FAULT_PAUSE_S = 0.25  # a server's first failed request stops its pulls this long; each further one in a row doubles it
STREAM_END_WAIT_S = 10.0  # a stream's end ([DONE]) not come this long after its final chunk: its connection closed
# sglang-router's 503 when it has no server to route to ({"error": {"code": "no_available_workers", "message": "No
# available workers (all circuits open or unhealthy)"}}): the request reached no server
NO_SERVERS_CODE = "no_available_workers"
NO_SERVERS_TEXT = "No available workers"
UNROUTED_PAUSE_S = 0.2  # such a router takes no new work this long, doubling while it answers so, at most 2 s
UNROUTED_MAX_PAUSE_S = 2.0
UNROUTED_ALERT_AFTER = 20  # answered so this many times in a row (tens of seconds): an alert, once per run of them
# what POST /generate's response is read into: its body, or (streamed) the answer followed chunk by chunk
Answer = bytes | AnswerStream


class WorkQueue(Protocol):
    """Where the dispatcher pulls work from (the ledger's ready queue: which item a free slot of a worker takes,
    prefix affinity included, is its choice; the dispatcher says which workers are ready)."""
    def next_item(self, worker: str | None = None) -> WorkItem | None: ...
    async def wait_item(self, timeout: float) -> None: ...
    def worker_ready(self, name: str, ready: bool) -> None: ...
    @property
    def queued(self) -> int: ...
    def queued_for(self, worker: str) -> int: ...


class Dispatcher:
    def __init__(self, cfg: RunConfig, queue: WorkQueue, workers: Sequence[DispatchTarget], deliver: Callable[[Outcome], None],
                 renderer: Renderer, session: aiohttp.ClientSession, emit: Callable[[Event], None]):
        self.cfg = cfg
        self.queue = queue
        self.workers = workers
        self.deliver = deliver
        self.renderer = renderer
        self.session = session
        self.emit = emit
        self._accepting = True  # False: held by the disk guard, draining, stopping
        self._aborting = False  # stopping: answers that come back aborted or failed are not retried
        self.inflight: dict[str, dict[asyncio.Task[None], WorkItem]] = {w.name: {} for w in workers}
        self.dispatched: collections.Counter[str] = collections.Counter()  # per shard, this run
        self.first_sent = asyncio.Event()  # set when the first request of this run is sent
        self.retried = 0  # attempts re-queued (no outcome of a sample: the ledger never sees it)
        self._slot_freed = {w.name: asyncio.Event() for w in workers}
        self._loops: list[asyncio.Task[None]] = []
        self._batch: dict[str, BatchSize] = {}  # per worker: the size in use, corrected by feedback
        self._discovered: dict[str, BatchSize] = {}  # per worker: what discovery said when _batch began
        self._read: dict[str, object] = {}  # per worker: the gauges reading feedback last used (each is used once)
        self._cancelled_for_requeue: set[asyncio.Task[None]] = set()
        self._mismatch_alerted: set[str] = set()
        self._text_alerted: set[str] = set()
        self._abort_alerted: set[str] = set()
        self._unstreamed_alerted: set[str] = set()
        self._cumulative_noted: set[str] = set()  # workers seen streaming every id so far in each chunk
        self.stopped_runaways = 0  # answers the guard stopped in this run (their outcome is their committed row)
        self._aborts: set[asyncio.Task[None]] = set()  # /abort_request calls in flight (kept referenced until done)
        # per worker, (its url, the /generate URL, the request headers), built once in aiohttp's own types
        # (yarl's URL, multidict's CIMultiDict, both aiohttp's dependencies): handed a str and a dict,
        # aiohttp parses the URL and copies the headers again on every request
        self._generate_target: dict[str, tuple[str, URL, CIMultiDict[str]]] = {}
        self._request_timeout = aiohttp.ClientTimeout(total=cfg.dispatch.request_timeout_s)
        self._fresh: aiohttp.ClientSession | None = None  # one-connection-per-request, for a resend after an idle drop
        # streams answered at their final chunk whose end is still on its way: (when to give up on it, response)
        self._unended: collections.deque[tuple[float, aiohttp.ClientResponse]] = collections.deque()
        self.unended_closed = 0  # of those, closed because their end did not come
        self.request_size = RequestSize()  # prompt + expected output of a request, from this run's requests
        self._first_ready: float | None = None  # when the first worker was ready (START_GRACE_S counts from it)
        self._stranded = StrandedWatch()
        self._underused_since: dict[str, float] = {}  # per ready worker running under its batch with no queue
        self._moving: dict[str, str] = {}  # rid -> the worker it is being moved off (its abort sent)
        self._output_seen: set[str] = set()  # rids of requests in flight that have streamed output (they run)
        self.moved = 0  # requests moved off a server's queue in this run
        self._no_pull_until: dict[str, float] = {}  # a worker work was just moved off takes none for MOVE_AFTER_S
        self._faults: dict[str, int] = {}  # per worker: requests failed in a row by the server (reset by an answer)
        self.unrouted = 0  # requests a router answered 503 "No available workers" (re-queued, not attempts)
        self._unrouted_run: dict[str, int] = {}  # per router target: such answers in a row (reset by an answer)
        for w in workers:
            w.listeners.append(self._on_worker_state)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        for w in self.workers:
            self.queue.worker_ready(w.name, w.state == WorkerState.READY)
            if w.state == WorkerState.READY and self._first_ready is None:
                self._first_ready = time.monotonic()
            self._loops.append(asyncio.create_task(self._worker_loop(w), name=f"dispatch-{w.name}"))
        self._loops.append(asyncio.create_task(self._capacity_loop(), name="dispatch-capacity"))

    async def _capacity_loop(self) -> None:
        while True:
            await asyncio.sleep(CAPACITY_TICK_S)
            try:
                self.adjust_capacity()
                self._move_stranded()
                self._close_unended(time.monotonic())
            except Exception:  # one bad tick must not end the feedback; the traceback goes to supervisor.log
                log.exception("capacity tick failed")

    def _move_stranded(self) -> None:
        """Move requests waiting in a server's own queue to servers that have had room for MOVE_AFTER_S (see the
        module doc): at most as many as those can start now and the queue holds."""
        now = time.monotonic()
        loads = self._loads()
        space = 0
        for x in loads:
            if room(x):
                since = self._underused_since.setdefault(x.name, now)
                space += room(x) if now - since >= MOVE_AFTER_S else 0
            else:
                self._underused_since.pop(x.name, None)
        # work in regen's queue that a server with room can take is taken that way (items a lane holds for another
        # server's cache are not: they wait for it, up to dispatch.affinity_hold_s)
        if space <= 0 or not self._accepting or self.queue.queued > sum(self.queue.queued_for(x.name) for x in loads):
            return
        by_name = {w.name: w for w in self.workers}
        for x in sorted(loads, key=lambda x: -(x.queued or 0)):
            waiting = int(x.queued or 0) - sum(1 for name in self._moving.values() if name == x.name)
            if waiting <= 0 or space <= 0:
                break
            # the latest sent without output yet: the likeliest still in its waiting queue
            candidates = [item for item in reversed(list(self.inflight[x.name].values()))
                          if item.rid not in self._output_seen and item.rid not in self._moving]
            for item in candidates[:min(waiting, space)]:
                self._moving[item.rid] = x.name
                self._no_pull_until[x.name] = now + MOVE_AFTER_S  # or its own freed slot pulls it straight back
                space -= 1
                log.info("%s: moving %s off its queue (%d waiting there; another server has room)", x.name, item.rid,
                         waiting)
                task = asyncio.create_task(self._abort_one(by_name[x.name], item.rid, why="moving"),
                                           name=f"move-{item.rid}")
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)

    async def close(self) -> None:
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        self._close_unended()
        if self._fresh is not None:
            await self._fresh.close()

    def hold(self, held: bool) -> None:
        """Stop (or start again) sending new requests; those in flight go on."""
        self._accepting = not held

    @property
    def in_flight(self) -> int:
        return sum(len(m) for m in self.inflight.values())

    async def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.in_flight:
            if deadline is not None and time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def abort_all(self) -> None:
        """POST /abort_request abort_all on every live worker; their in-flight requests come back as aborts."""
        self._aborting = True
        self._accepting = False
        for w in self.workers:
            if w.state != WorkerState.READY or not self.inflight[w.name]:
                continue
            try:
                async with self.session.post(w.url + "/abort_request", json={"rid": "", "abort_all": True},
                                             headers=w.headers, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        log.warning("abort on %s: HTTP %d %s", w.name, resp.status, text[:200])
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                log.warning("abort on %s failed: %s", w.name, exc)

    def stop_retrying(self) -> None:
        """From now on nothing comes back as a retry: the run ends (a failed run, or its workers stopping)."""
        self._accepting = False
        self._aborting = True

    def cancel_all(self) -> None:
        for tasks in self.inflight.values():
            for task in list(tasks):
                task.cancel()

    # -- capacity ---------------------------------------------------------------------------
    def capacity_for(self, w: DispatchTarget) -> int:
        fixed = self.cfg.dispatch.max_in_flight_per_worker
        if fixed:
            return fixed
        batch = self._batch.get(w.name) or self._starting_size(w, w.capacity_info.batch())
        return batch.size + _margin(w, batch.size)

    def _starting_size(self, w: DispatchTarget, discovered: BatchSize) -> BatchSize:
        """The reported batch cut to what the server's KV pool holds of this run's requests (engine.servers.capacity.kv_fit);
        the pool is per server, so a router target (its discovered size is its servers' sum) is not cut."""
        if w.queue_margin:
            return discovered
        fits = kv_fit(w.capacity_info.max_total_num_tokens, self.request_size.tokens(self.cfg.sampling.max_new_tokens))
        if fits is not None and fits < discovered.size:
            return BatchSize(fits, BatchSource.KV_POOL)
        return discovered

    def adjust_capacity(self) -> None:
        """Called every metrics tick: keep each server full, its queue short but never empty while work is left."""
        fixed = self.cfg.dispatch.max_in_flight_per_worker
        for w in self.workers:
            w.in_flight = len(self.inflight[w.name])
            w.held = self.queue.queued_for(w.name) if self.queue is not None else 0
            discovered = w.capacity_info.batch()
            if w.state != WorkerState.READY:
                # its size is read again when it becomes ready: a size kept from before (or the default)
                # would over-fill a smaller server for a whole metrics tick
                self._batch.pop(w.name, None)
                self._discovered.pop(w.name, None)
                w.batch = None
                continue
            if self._discovered.get(w.name) != discovered:
                # a relaunched server, or a router whose servers joined or left: start from its new size
                self._discovered[w.name] = discovered
                self._batch[w.name] = discovered if fixed else self._starting_size(w, discovered)
            elif not fixed and self._batch[w.name].source != BatchSource.FEEDBACK:
                # until its own gauges have corrected it, the KV estimate follows the answers so far, downwards only
                # (long answers): growing is the gauges' business (batch_feedback)
                estimate = self._starting_size(w, discovered)
                if estimate.size < self._batch[w.name].size:
                    self._batch[w.name] = estimate
            batch = self._batch[w.name]
            if not fixed and self._read.get(w.name) is not w.metrics:
                self._read[w.name] = w.metrics
                ceiling = discovered.size if discovered.source in BatchSource.REPORTED else None
                batch = corrected(batch, margin=_margin(w, batch.size), in_flight=len(self.inflight[w.name]),
                                  running=w.metrics.running_reqs, queued=w.metrics.queued_reqs,
                                  token_usage=w.metrics.token_usage, ceiling=ceiling,
                                  work_waiting=self.queue is not None and self.queue.queued > 0)
                if batch != self._batch[w.name]:
                    log.info("%s: batch size %d (%s) -> %d from its queue (running %s, queued %s, in flight %d)",
                             w.name, self._batch[w.name].size, self._batch[w.name].source, batch.size,
                             w.metrics.running_reqs, w.metrics.queued_reqs, w.in_flight)
                self._batch[w.name] = batch
            w.batch = batch
            w.capacity = self.capacity_for(w)
        alert = self._stranded.check(self._loads(), time.monotonic()) if self._accepting else None
        if alert is not None:
            self.emit(alert)

    def _loads(self) -> list[ServerLoad]:
        """What dispatch knows of each ready server now (engine.run.spread)."""
        out = []
        for w in self.workers:
            if w.state != WorkerState.READY:
                continue
            batch = self._batch.get(w.name)
            out.append(ServerLoad(name=w.name, capacity=self.capacity_for(w), in_flight=len(self.inflight[w.name]),
                                  batch=batch.size if batch is not None else None, running=w.metrics.running_reqs,
                                  queued=w.metrics.queued_reqs))
        return out

    def _within_share(self, w: DispatchTarget) -> bool:
        """May `w` take one more item (engine.run.spread.within_share)? Servers still starting count for
        START_GRACE_S after the first one was ready."""
        loads = self._loads()
        me = next((x for x in loads if x.name == w.name), None)
        if me is None:
            return False
        starting = 0
        if self._first_ready is not None and time.monotonic() - self._first_ready < START_GRACE_S:
            starting = sum(1 for x in self.workers if x.state in (WorkerState.STARTING, WorkerState.LOADING))
        return within_share(me, loads, self.queue.queued, starting)

    # -- per-worker pull loop ---------------------------------------------------------------
    async def _worker_loop(self, w: DispatchTarget) -> None:
        slot = self._slot_freed[w.name]
        while True:
            if not self._accepting or w.state != WorkerState.READY:
                slot.clear()  # set when a worker becomes ready (_on_worker_state): a restarted server pulls at once
                try:
                    await asyncio.wait_for(slot.wait(), timeout=0.1)
                except asyncio.TimeoutError:
                    pass
                continue
            cap = self.capacity_for(w)
            w.capacity = cap
            if len(self.inflight[w.name]) >= cap or time.monotonic() < self._no_pull_until.get(w.name, 0.0):
                slot.clear()
                try:
                    await asyncio.wait_for(slot.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass  # re-check capacity and state
                continue
            if not self._within_share(w):
                # its share grows as the feed queues more (a run's start) or others take theirs: looked at again soon
                await asyncio.sleep(SHARE_POLL_S)
                continue
            item = self.queue.next_item(w.name)
            if item is None:
                await self.queue.wait_item(0.25)
                continue
            self.request_size.sent(len(item.prompt_ids), item.max_new_tokens)
            task = asyncio.create_task(self._send(w, item), name=f"gen-{item.rid}")
            self.inflight[w.name][task] = item
            self.dispatched[item.shard_id] += 1
            self.first_sent.set()
            w.in_flight = len(self.inflight[w.name])
            task.add_done_callback(lambda t: self._finished(w, t))  # w: this loop's own, never rebound

    def _finished(self, w: DispatchTarget, task: asyncio.Task[None]) -> None:
        item = self.inflight[w.name].pop(task, None)
        if item is not None:
            self._output_seen.discard(item.rid)
            self._moving.pop(item.rid, None)
        self._cancelled_for_requeue.discard(task)
        w.in_flight = len(self.inflight[w.name])
        self._slot_freed[w.name].set()
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error("request task on %s failed unexpectedly: %r", w.name, exc, exc_info=exc)
            self.emit(AlertEvent(severity=Severity.ERROR, text=f"dispatcher error on {w.name}: {exc!r}",
                                 key=f"dispatch-bug:{w.name}"))

    def _on_worker_state(self, w: DispatchTarget, state: str) -> None:
        self.queue.worker_ready(w.name, state == WorkerState.READY)
        if state == WorkerState.READY:
            if self._first_ready is None:
                self._first_ready = time.monotonic()
            for other in self.workers:
                self._slot_freed[other.name].set()  # the shares changed: every loop looks again
            return
        # crashed / failed / stopped / relaunched after a restart: its in-flight requests will never
        # answer; re-queue them now rather than after their timeouts
        requeued = 0
        for task, item in list(self.inflight[w.name].items()):
            if task in self._cancelled_for_requeue:
                continue
            self._cancelled_for_requeue.add(task)
            # a task that already finished (its done-callback not yet run) has settled its item itself:
            # committed, failed or re-queued; re-queueing it again would send the same rid twice
            if task.done() or not task.cancel():
                continue
            if self._aborting:
                continue  # stopping: uncommitted samples are regenerated by the next run
            item.last_error = f"worker {w.name} {state}"
            self._retry_or_fail(item, immediate=True)
            requeued += 1
        if requeued:
            log.warning("worker %s %s: re-queued %d in-flight requests", w.name, state, requeued)

    # -- one request ------------------------------------------------------------------------
    def _target(self, w: DispatchTarget) -> tuple[str, URL, CIMultiDict[str]]:
        target = self._generate_target.get(w.name)
        if target is None or target[0] != w.url:
            target = (w.url, URL(w.url + "/generate"), CIMultiDict({**w.headers, "Content-Type": "application/json"}))
            self._generate_target[w.name] = target
        return target

    async def _send(self, w: DispatchTarget, item: WorkItem) -> None:
        params = self.cfg.sampling.as_sglang()
        params["max_new_tokens"] = item.max_new_tokens
        guard = self.cfg.runaway.enabled
        if guard:
            params["stream_interval"] = self.cfg.runaway.stream_interval
        payload = {"rid": item.rid, "input_ids": item.prompt_ids, "sampling_params": params, "stream": guard}
        _, url, headers = self._target(w)
        started = time.monotonic()
        read: Callable[[aiohttp.ClientResponse], Awaitable[Answer]] = (
            functools.partial(self._read_stream, w, item) if guard else _read_body)
        try:
            status, body = await self._post(w, item, url, orjson.dumps(payload), headers, read)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, StreamError) as exc:
            if self._aborting:
                return
            item.last_error = f"{w.name}: {type(exc).__name__}: {exc}" if str(exc) else f"{w.name}: {type(exc).__name__}"
            self._server_fault(w)
            self._retry_or_fail(item)
            return
        latency = time.monotonic() - started
        if isinstance(body, AnswerStream):  # only a 200 streams (_read_stream)
            self._handle_stream(w, item, body, latency)
        elif status == 200:
            self._handle_ok(w, item, body, latency)
        elif status == 400 and DUPLICATE_RID in (message := _error_message(body)):
            # SGLang refuses a rid it is still running: the sample itself is fine, so never reject it
            if self._aborting:
                return
            self.emit(AlertEvent(severity=Severity.ERROR, text=f"{w.name} refused a duplicate request id; re-queued",
                                 evidence=f"{item.rid}: {message}", key=f"duplicate-rid:{w.name}"))
            item.last_error = f"{w.name}: HTTP 400: {message}"
            self._retry_or_fail(item)
        elif status == 400:
            self.deliver(Rejected(item, f"rejected by SGLang (HTTP 400): {message}",
                                  excerpt=f"prompt_len={len(item.prompt_ids)} max_new_tokens={item.max_new_tokens}"))
        elif status == 503 and w.is_router and _no_servers(body):
            if self._aborting:
                return
            self._unrouted(w, item, _error_message(body))
        else:
            if self._aborting:
                return
            item.last_error = f"{w.name}: HTTP {status}: {_error_message(body)}"
            self._server_fault(w)
            self._retry_or_fail(item)

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

    def _close_unended(self, now: float | None = None) -> None:
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
                self._output_seen.add(item.rid)
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
        task = asyncio.create_task(self._abort_one(w, item.rid), name=f"abort-{item.rid}")
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort_one(self, w: DispatchTarget, rid: str, why: str = "runaway") -> None:
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
        if why == "moving":
            self._moving.pop(rid, None)  # it stays where it is and is answered there
            return
        if w.name not in self._abort_alerted:
            self._abort_alerted.add(w.name)
            self.emit(AlertEvent(
                severity=Severity.WARNING, text=f"{w.name}: /abort_request failed: runaway answers run to max_new_tokens",
                evidence=f"{rid}: {problem}", key=f"abort-failed:{w.name}"))

    def _handle_ok(self, w: DispatchTarget, item: WorkItem, body: bytes, latency: float) -> None:
        try:
            data = reply_json.loads(body)  # output_ids as array("i") when long (reply_json says why)
            if isinstance(data, list):
                data = data[0]
            output_ids = data["output_ids"]
            if type(output_ids) is array:
                ids32 = output_ids  # every id checked an int32 already
            elif isinstance(output_ids, list):
                ids32 = int32_array(output_ids)  # every id an int32, checked at C speed (TypeError / OverflowError)
            else:
                raise TypeError(f"output_ids is {type(output_ids).__name__}, not a list")
            meta = data.get("meta_info") or {}
            finish = meta.get("finish_reason") or {}
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
            item.last_error = f"{w.name}: unreadable /generate reply ({type(exc).__name__}: {exc}): {body[:200]!r}"
            self._retry_or_fail(item)
            return
        self._answered(w, item, ids32, meta, finish, data.get("text"), latency)

    def _handle_stream(self, w: DispatchTarget, item: WorkItem, answer: AnswerStream, latency: float) -> None:
        """A streamed answer: as a non-streamed one once it ended with its final chunk; an error event as the HTTP
        400 it stands for (a ValueError of SGLang's); a runaway the guard stopped, with every id delivered."""
        if answer.cumulative_ids and w.name not in self._cumulative_noted:
            self._cumulative_noted.add(w.name)
            self.emit(AlertEvent(
                severity=Severity.INFO, text=f"{w.name} streams every id so far in each chunk (no delta streaming): read "
                "exactly, at a client CPU cost growing with the square of an answer's length",
                evidence=f"{item.rid}: {answer.chunks} chunks, {len(answer.ids)} ids; SGLang 0.5.10+ streams deltas "
                "when launched with --incremental-streaming-output (0.5.5: --stream-output), which regen adds when "
                "it can read the server's version (workers/<name>/server.log shows the launch line)",
                key=f"cumulative-stream:{w.name}"))
        if answer.verdict is not None:
            self.stopped_runaways += 1
            self._answered(w, item, answer.ids, answer.meta, answer.finish or {}, answer.text, latency,
                           verdict=answer.verdict)
        elif answer.error is not None and not answer.ids:
            self._refused(w, item, answer.error)
        elif answer.error is not None:
            if self._aborting:
                return
            item.last_error = f"{w.name}: stream error after {len(answer.ids)} ids: {answer.error}"
            self._retry_or_fail(item)
        elif answer.finish is None:
            if self._aborting:
                return
            item.last_error = (f"{w.name}: the stream ended without a final chunk ({answer.chunks} chunks, "
                               f"{len(answer.ids)} ids, [DONE] {'seen' if answer.done else 'missing'})")
            self._retry_or_fail(item)
        else:
            self._answered(w, item, answer.ids, answer.meta, answer.finish, answer.text, latency)

    def _refused(self, w: DispatchTarget, item: WorkItem, message: str) -> None:
        """An error event before any id, in a 200 stream: SGLang's HTTP 400 of a non-streamed request (its
        validation's ValueError, contract 2.4)."""
        if DUPLICATE_RID in message:
            if self._aborting:
                return
            self.emit(AlertEvent(severity=Severity.ERROR, text=f"{w.name} refused a duplicate request id; re-queued",
                                 evidence=f"{item.rid}: {message}", key=f"duplicate-rid:{w.name}"))
            item.last_error = f"{w.name}: stream error: {message}"
            self._retry_or_fail(item)
            return
        self.deliver(Rejected(item, f"rejected by SGLang (stream error event): {message}",
                              excerpt=f"prompt_len={len(item.prompt_ids)} max_new_tokens={item.max_new_tokens}"))

    def _answered(self, w: DispatchTarget, item: WorkItem, ids32: array[int], meta: dict[str, Any], finish: object,
                  server_text: object, latency: float, verdict: Repetition | None = None) -> None:
        finish_type = finish.get("type") if isinstance(finish, dict) else str(finish)
        if finish_type == "abort" and verdict is None:
            if self._aborting:
                return
            moving = self._moving.pop(item.rid, None) is not None
            if moving and not len(ids32):
                # moved off this server's queue unrun: once, by its rid, not a fault (no attempt counted)
                self.moved += 1
                log.info("%s: %s moved off its queue (%s): re-queued for any server", w.name, item.rid,
                         finish.get("message", "") if isinstance(finish, dict) else finish)
                self.deliver(Retry(item, 0.0))
                return
            item.last_error = f"{w.name}: aborted: {finish.get('message', '') if isinstance(finish, dict) else finish}"
            self._retry_or_fail(item, immediate=moving)  # moving, it had started: retried at once
            return
        self._faults.pop(w.name, None)
        self._unrouted_run.pop(w.name, None)
        completion = meta.get("completion_tokens")
        n = len(ids32)
        self.request_size.answered(n)
        if verdict is not None and finish_type is None:
            completion = n  # the stream broke off after the stop: the ids delivered are the answer
        if completion != n and w.name not in self._mismatch_alerted:
            self._mismatch_alerted.add(w.name)
            self.emit(AlertEvent(
                severity=Severity.WARNING, text=f"{w.name}: meta_info.completion_tokens != len(output_ids)",
                evidence=f"{item.sample_id}: completion_tokens={completion}, len(output_ids)={n}",
                key=f"completion-mismatch:{w.name}"))
        matched = finish.get("matched") if isinstance(finish, dict) else None
        text, refused = self.renderer.answer_text(ids32, server_text, matched)
        if refused and w.name not in self._text_alerted:
            self._text_alerted.add(w.name)
            self.emit(AlertEvent(
                severity=Severity.WARNING, text=f"{w.name}: /generate text does not match output_ids; decoding them here",
                # refused: a server text was there (answer_text judges only a str)
                evidence=f"{item.sample_id}: {n} ids, server text {len(cast(str, server_text))} chars",
                key=f"text-mismatch:{w.name}"))
        row = SampleRow(
            sample_id=item.sample_id, conversation_id=item.conv.conversation_id, turn=item.turn,
            source=item.conv.source, origin=item.conv.origin, prompt_ids=item.prompt_ids, output_ids=ids32,
            reasoning_tokens=self.renderer.reasoning_tokens(ids32, item.prompt_opened),
            prompt_opened=item.prompt_opened,
            finish_reason=REPETITION if verdict is not None else (finish_type or "unknown"),
            completion_tokens=int(completion) if isinstance(completion, int) else n,
            cached_tokens=int(meta.get("cached_tokens") or 0), latency_s=float(latency), worker=w.name, text=text)
        item.served_by = w.name
        answer = None
        if self.cfg.turns == "all" and not item.is_last_turn:
            answer = self.renderer.history_answer(ids32, item.prompt_opened)
        self.deliver(Generated(item, row, answer))

    def _unrouted(self, w: DispatchTarget, item: WorkItem, message: str) -> None:
        """The router answered 503 "No available workers": the request reached no server, so it is no attempt of the
        sample (not in `retried`, no backoff of its own): it goes back to the front of regen's queue as it was. The
        router's list of servers is read again now (the endpoint is ready only while the router lists one), and the
        router takes no new work for a moment, doubling while it goes on answering so (each pull would be answered
        the same at once). Said in the log once per run of such answers, and alerted if it lasts."""
        self.unrouted += 1
        n = self._unrouted_run[w.name] = self._unrouted_run.get(w.name, 0) + 1
        until = time.monotonic() + min(UNROUTED_MAX_PAUSE_S, UNROUTED_PAUSE_S * 2 ** min(n - 1, 8))
        if until > self._no_pull_until.get(w.name, 0.0):
            self._no_pull_until[w.name] = until
        if n == 1:
            log.warning("%s had no server to route %s to (HTTP 503: %s): re-queued (not an attempt); the router's "
                        "list of servers is read again", w.name, item.sample_id, message)
        if n == UNROUTED_ALERT_AFTER:
            self.emit(AlertEvent(
                severity=Severity.ERROR, text=f"{w.name} has answered {n} requests in a row with 503 \"No available "
                "workers\" although it lists servers: nothing reaches them", evidence=f"{item.sample_id}: {message}; "
                f"see the router's own list (GET {w.url}/workers) and its log", key=f"router-no-servers:{w.name}"))
        w.no_servers()
        self.deliver(Retry(item, 0.0))

    def _server_fault(self, w: DispatchTarget) -> None:
        """The server failed a request: its loop pulls nothing for FAULT_PAUSE_S, doubled for each failure in a row,
        at most dispatch.retry_backoff_s (see the module doc)."""
        n = self._faults[w.name] = self._faults.get(w.name, 0) + 1
        pause = min(self.cfg.dispatch.retry_backoff_s, FAULT_PAUSE_S * 2 ** min(n - 1, 16))
        if pause > 0:
            until = time.monotonic() + pause
            if until > self._no_pull_until.get(w.name, 0.0):
                self._no_pull_until[w.name] = until

    def _retry_or_fail(self, item: WorkItem, immediate: bool = False) -> None:
        item.attempt += 1
        if item.attempt > self.cfg.dispatch.max_retries:
            log.warning("%s failed after %d attempts: %s", item.sample_id, item.attempt, item.last_error)
            self.deliver(Failed(item, f"generation failed after {item.attempt} attempts", excerpt=item.last_error))
            return
        self.retried += 1
        log.info("retry %d of %s: %s", item.attempt, item.sample_id, item.last_error)
        delay = 0.0 if immediate else min(60.0, self.cfg.dispatch.retry_backoff_s * 2 ** (item.attempt - 1))
        self.deliver(Retry(item, delay))


async def _read_body(resp: aiohttp.ClientResponse) -> bytes:
    return await resp.read()




def _margin(w: DispatchTarget, size: int) -> int:
    """Requests kept queued beyond the server's running batch, so a finished slot is refilled at once.
    A router target says its own (it spreads requests without seeing the slots: each server needs its own
    queue); a server gets a quarter of its batch (engine.run.batch_feedback.margin_for)."""
    own = w.queue_margin
    return own if own else margin_for(size)


def _no_servers(body: bytes) -> bool:
    """A router's 503 that says it had no server to route to (sglang-router's `no_available_workers`)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return NO_SERVERS_TEXT in body[:500].decode("utf-8", errors="replace")
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict) and err.get("code") == NO_SERVERS_CODE:
        return True
    return NO_SERVERS_TEXT in _error_message(body)


def _error_message(body: bytes) -> str:
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
