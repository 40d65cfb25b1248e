"""How many requests each target may have open: its batch (discovered, cut to its KV pool, corrected from its gauges)
plus a short queue margin, and its fair share of scarce work (engine.run.spread).

`dispatch.max_in_flight_per_worker` overrides the size; the gauges keep each server's own queue short but non-empty.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from engine.api.wire import WorkerState
from engine.config.load import RunConfig
from engine.run.batch_feedback import corrected, margin_for
from engine.run.dispatch.work_queue import WorkQueue
from engine.run.items import WorkItem
from engine.run.request_size import RequestSize
from engine.run.spread import ServerLoad, within_share
from engine.servers.capacity import BatchSize, BatchSource, kv_fit
from engine.servers.target import DispatchTarget

log = logging.getLogger("regen.dispatch")

START_GRACE_S = 10.0  # a server still starting counts in the fair share this long after the first one was ready


class Sizing:
    """Each target's in-flight cap and fair share. `inflight` is the dispatcher's own map (read only here)."""

    def __init__(self, cfg: RunConfig, queue: WorkQueue, workers: Sequence[DispatchTarget],
                 inflight: dict[str, dict[asyncio.Task[None], WorkItem]], request_size: RequestSize):
        self.cfg = cfg
        self.queue = queue
        self.workers = workers
        self.inflight = inflight
        self.request_size = request_size
        self._batch: dict[str, BatchSize] = {}  # per worker: the size in use, corrected by feedback
        self._discovered: dict[str, BatchSize] = {}  # per worker: what discovery said when _batch began
        self._read: dict[str, object] = {}  # per worker: the gauges reading feedback last used (each is used once)
        self._first_ready: float | None = None  # when the first worker was ready (START_GRACE_S counts from it)

    def worker_ready(self) -> None:
        if self._first_ready is None:
            self._first_ready = time.monotonic()

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

    def adjust(self) -> None:
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

    def loads(self) -> list[ServerLoad]:
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

    def within_share(self, w: DispatchTarget) -> bool:
        """May `w` take one more item (engine.run.spread.within_share)? Servers still starting count for
        START_GRACE_S after the first one was ready."""
        loads = self.loads()
        me = next((x for x in loads if x.name == w.name), None)
        if me is None:
            return False
        starting = 0
        if self._first_ready is not None and time.monotonic() - self._first_ready < START_GRACE_S:
            starting = sum(1 for x in self.workers if x.state in (WorkerState.STARTING, WorkerState.LOADING))
        return within_share(me, loads, self.queue.queued, starting)


def _margin(w: DispatchTarget, size: int) -> int:
    """Requests kept queued beyond the server's running batch, so a finished slot is refilled at once.
    A router target says its own (it spreads requests without seeing the slots: each server needs its own
    queue); a server gets a quarter of its batch (engine.run.batch_feedback.margin_for)."""
    own = w.queue_margin
    return own if own else margin_for(size)
