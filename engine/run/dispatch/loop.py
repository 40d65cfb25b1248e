"""The Dispatcher: one pull loop per target takes an item from the ledger's ready queue only while it has a free slot.

Every item sent comes back as exactly one outcome, handed to `deliver` (Generated to the committer, the rest to the
ledger); it settles nothing itself. A target that stops being ready has its requests in flight re-queued at once.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Sequence
from typing import Callable

import aiohttp

from engine.api.events import AlertEvent, Event
from engine.api.wire import Severity, WorkerState
from engine.config.load import RunConfig
from engine.run.dispatch.answers import Answers
from engine.run.dispatch.client import SEND_ERRORS, SGLangClient
from engine.run.dispatch.pauses import PullPauses
from engine.run.dispatch.sizing import Sizing
from engine.run.dispatch.stranded import StrandedMover
from engine.run.dispatch.work_queue import WorkQueue
from engine.run.items import Outcome, WorkItem
from engine.run.request_size import RequestSize
from engine.servers.target import DispatchTarget
from engine.text.render import Renderer

log = logging.getLogger("regen.dispatch")

CAPACITY_TICK_S = 0.5  # each server's size is corrected from its gauges this often (a fresh reading each time)
SHARE_POLL_S = 0.05  # a worker at its fair share looks again this often


class Dispatcher:
    def __init__(self, cfg: RunConfig, queue: WorkQueue, workers: Sequence[DispatchTarget], deliver: Callable[[Outcome], None],
                 renderer: Renderer, session: aiohttp.ClientSession, emit: Callable[[Event], None]):
        self.queue = queue
        self.workers = workers
        self.emit = emit
        self._accepting = True  # False: held by the disk guard, draining, stopping
        self.inflight: dict[str, dict[asyncio.Task[None], WorkItem]] = {w.name: {} for w in workers}
        self.dispatched: collections.Counter[str] = collections.Counter()  # per shard, this run
        self.first_sent = asyncio.Event()  # set when the first request of this run is sent
        self._slot_freed = {w.name: asyncio.Event() for w in workers}
        self._loops: list[asyncio.Task[None]] = []
        self._cancelled_for_requeue: set[asyncio.Task[None]] = set()
        self.request_size = RequestSize()  # prompt + expected output of a request, from this run's requests
        self.pauses = PullPauses()
        self.sizing = Sizing(cfg, queue, workers, self.inflight, self.request_size)
        self.stranded = StrandedMover(queue, workers, self.sizing, self.inflight, self.pauses, emit)
        self.client = SGLangClient(cfg, session, emit, on_output=self.stranded.running.add)
        self.answers = Answers(cfg, renderer, deliver, emit, self.request_size, self.stranded, self.pauses)
        for w in workers:
            w.listeners.append(self._on_worker_state)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        for w in self.workers:
            self.queue.worker_ready(w.name, w.state == WorkerState.READY)
            if w.state == WorkerState.READY:
                self.sizing.worker_ready()
            self._loops.append(asyncio.create_task(self._worker_loop(w), name=f"dispatch-{w.name}"))
        self._loops.append(asyncio.create_task(self._capacity_loop(), name="dispatch-capacity"))

    async def _capacity_loop(self) -> None:
        while True:
            await asyncio.sleep(CAPACITY_TICK_S)
            try:
                self.adjust_capacity()
                self.stranded.move(self.client, self._accepting)
                self.client.close_unended(time.monotonic())
            except Exception:  # one bad tick must not end the feedback; the traceback goes to supervisor.log
                log.exception("capacity tick failed")

    async def close(self) -> None:
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        await self.client.close()

    def hold(self, held: bool) -> None:
        """Stop (or start again) sending new requests; those in flight go on."""
        self._accepting = not held

    @property
    def in_flight(self) -> int:
        return sum(len(m) for m in self.inflight.values())

    @property
    def retried(self) -> int:
        """Attempts re-queued in this run (no outcome of a sample: the ledger never sees them)."""
        return self.answers.retried

    async def wait_idle(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.in_flight:
            if deadline is not None and time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def abort_all(self) -> None:
        """POST /abort_request abort_all on every live worker; their in-flight requests come back as aborts."""
        self.answers.stopping = True
        self._accepting = False
        for w in self.workers:
            if w.state != WorkerState.READY or not self.inflight[w.name]:
                continue
            await self.client.abort_all(w)

    def stop_retrying(self) -> None:
        """From now on nothing comes back as a retry: the run ends (a failed run, or its workers stopping)."""
        self._accepting = False
        self.answers.stopping = True

    def cancel_all(self) -> None:
        for tasks in self.inflight.values():
            for task in list(tasks):
                task.cancel()

    # -- capacity (engine.run.dispatch.sizing) ---------------------------------------------
    def capacity_for(self, w: DispatchTarget) -> int:
        return self.sizing.capacity_for(w)

    def adjust_capacity(self) -> None:
        """Called every metrics tick: each target's size from its gauges; the stranded-queue alert."""
        self.sizing.adjust()
        if self._accepting:
            self.stranded.check()

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
            cap = self.sizing.capacity_for(w)
            w.capacity = cap
            if len(self.inflight[w.name]) >= cap or self.pauses.paused(w.name, time.monotonic()):
                slot.clear()
                try:
                    await asyncio.wait_for(slot.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass  # re-check capacity and state
                continue
            if not self.sizing.within_share(w):
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

    async def _send(self, w: DispatchTarget, item: WorkItem) -> None:
        started = time.monotonic()
        try:
            status, body = await self.client.generate(w, item)
        except SEND_ERRORS as exc:
            self.answers.unsent(w, item, exc)
            return
        self.answers.settle(w, item, status, body, time.monotonic() - started)

    def _finished(self, w: DispatchTarget, task: asyncio.Task[None]) -> None:
        item = self.inflight[w.name].pop(task, None)
        if item is not None:
            self.stranded.finished(item.rid)
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
            self.sizing.worker_ready()
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
            if self.answers.stopping:
                continue  # stopping: uncommitted samples are regenerated by the next run
            item.last_error = f"worker {w.name} {state}"
            self.answers.retry_or_fail(item, immediate=True)
            requeued += 1
        if requeued:
            log.warning("worker %s %s: re-queued %d in-flight requests", w.name, state, requeued)
