"""Buffers finished rows per shard and commits them as part files (ShardStore.commit), in ONE dedicated thread.

A commit every part_max_rows rows or part_max_age_s per shard, and at drain; rows count as committed only once the
store's sqlite transaction returned (then the ledger settles them), so a SIGKILL loses nothing and doubles nothing.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from engine.config.load import Store
from engine.run.items import Committed, Generated, WorkItem
from engine.store.names import CUT_FINISHES
from engine.store.part_writer import DuplicateSample
from engine.store.shard_store import ShardStore
from engine.store.state_db import PartInfo
from engine.api.events import AlertEvent, Event
from engine.api.wire import Severity

log = logging.getLogger("regen.committer")

CHAIN_COMMIT_S = 0.2  # a buffer holding a turn a later turn waits on is committed at this age, not max_age_s


class CommitLedger(Protocol):
    """What the committer asks of the ledger, and what it tells it."""
    def unsettled(self, shard_id: str) -> int | None: ...
    def chains_on(self, item: WorkItem) -> bool: ...
    def settle(self, outcome: Committed) -> None: ...


@dataclass
class _Buffer:
    since: float = field(default_factory=time.monotonic)
    entries: list[Generated] = field(default_factory=list)


@dataclass
class _Job:
    """One commit handed to the commit thread; settled exactly once, on the loop thread."""
    shard_id: str
    entries: list[Generated]
    future: concurrent.futures.Future[PartInfo]
    settled: bool = False


class Committer:
    def __init__(self, store: ShardStore, ledger: CommitLedger, emit: Callable[[Event], None], *,
                 max_rows: int = Store.model_fields["part_max_rows"].default,
                 max_age_s: float = Store.model_fields["part_max_age_s"].default, disk_ok: Callable[[], bool] = lambda: True):
        self.store = store
        self.ledger = ledger
        self.emit = emit
        self.max_rows = max_rows
        self.max_age_s = max_age_s
        self.disk_ok = disk_ok
        self.buffers: dict[str, _Buffer] = {}
        self._wake = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="regen-commit")
        self._job: _Job | None = None  # the commit in the thread, until settled
        self._job_lock = asyncio.Lock()  # one async committer at a time (run_forever, drain)

    @property
    def pending(self) -> int:
        """Rows finished and not yet committed: buffered, or in the commit in flight."""
        inflight = len(self._job.entries) if self._job is not None and not self._job.settled else 0
        return inflight + sum(len(b.entries) for b in self.buffers.values())

    @property
    def committing(self) -> bool:
        return self._job is not None and not self._job.settled

    def add(self, generated: Generated) -> None:
        item = generated.item
        buf = self.buffers.get(item.shard_id)
        if buf is None:
            buf = self.buffers[item.shard_id] = _Buffer()
        buf.entries.append(generated)
        if len(buf.entries) >= self.max_rows or self.ledger.chains_on(item):
            self._wake.set()  # a chained turn waits on this commit: do not sit on it for max_age_s
        elif self._holds_the_rest(item.shard_id, buf):
            self._wake.set()  # the shard's last rows: nothing can join this part any more

    # -- async (the loop keeps running while the thread commits) --------------------------------
    async def run_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.25)
            except asyncio.TimeoutError:
                pass  # periodic check of buffer ages
            self._wake.clear()
            await self.commit_due_async()

    async def commit_due_async(self) -> None:
        for shard_id in self._due():
            await self._commit_async(shard_id)

    async def drain(self) -> None:
        """Commit every buffered row (and wait for the commit in flight), without blocking the loop.
        Rows that cannot be committed (disk) stay buffered: `pending` says how many."""
        async with self._job_lock:
            await self._settle_inflight()
        while True:  # again while it helps: rows a duplicate-id commit gave back go with the next part
            before = self.pending
            for shard_id in [sid for sid, b in self.buffers.items() if b.entries]:
                await self._commit_async(shard_id)
            if not self.pending or self.pending >= before:
                return

    async def _commit_async(self, shard_id: str) -> None:
        async with self._job_lock:
            await self._settle_inflight()
            job = self._start(shard_id)
            if job is None:
                return
            await self._settle_inflight()

    async def _settle_inflight(self) -> None:
        job = self._job
        if job is None or job.settled:
            return
        try:
            # shielded: a cancelled caller leaves the job to drain, which settles it
            await asyncio.shield(asyncio.wrap_future(job.future))
        except asyncio.CancelledError:
            raise
        except BaseException:  # noqa: BLE001  # the job's own exception: _settle reads and handles it
            pass
        self._settle(job)

    def close(self) -> None:
        """Wait for the commit in flight (it finishes: never cut a part in half) and stop the thread."""
        self._executor.shutdown(wait=True)

    # -- internals -------------------------------------------------------------------------------
    def _due(self) -> list[str]:
        now = time.monotonic()
        out = []
        for shard_id, buf in self.buffers.items():
            if not buf.entries:
                continue
            age = now - buf.since
            if len(buf.entries) >= self.max_rows or age >= self.max_age_s or self._holds_the_rest(shard_id, buf):
                out.append(shard_id)
            elif age >= CHAIN_COMMIT_S and any(self.ledger.chains_on(g.item) for g in buf.entries):
                out.append(shard_id)
        return out

    def _holds_the_rest(self, shard_id: str, buf: _Buffer) -> bool:
        """Every sample of the shard not settled yet is in its buffer (or in the commit in flight):
        no later row can join this part, so waiting for max_age_s would only delay the same part
        (the tail of a shard, and the end of a run, by up to max_age_s)."""
        unsettled = self.ledger.unsettled(shard_id)
        if unsettled is None:
            return False
        job = self._job
        inflight = len(job.entries) if job is not None and not job.settled and job.shard_id == shard_id else 0
        return len(buf.entries) + inflight >= unsettled

    def _start(self, shard_id: str) -> _Job | None:
        """Take the shard's buffer and hand it to the commit thread (None: nothing to commit, or disk low)."""
        buf = self.buffers.get(shard_id)
        if buf is None or not buf.entries:
            return None
        if not self.disk_ok():
            log.warning("not committing %d rows of %s: disk below alerts.disk_free_min_gb", len(buf.entries), shard_id)
            return None
        entries = buf.entries
        self.buffers[shard_id] = _Buffer()
        job = _Job(shard_id, entries, self._executor.submit(_commit, self.store, shard_id, entries))
        self._job = job
        return job

    def _settle(self, job: _Job) -> None:
        """On the loop thread, once per job: count the committed rows, or keep them for a retry."""
        if job.settled:
            return
        job.settled = True
        shard_id, entries = job.shard_id, job.entries
        exc = job.future.exception() if not job.future.cancelled() else concurrent.futures.CancelledError()
        if exc is None:
            self._committed(job.future.result(), entries)
            return
        if isinstance(exc, OSError):
            # nothing was committed (tmp file, then rename, then the sqlite txn): keep the rows, retry later
            self._requeue(shard_id, entries)
            self.emit(AlertEvent(severity=Severity.CRITICAL, text=f"cannot write a part file of {shard_id}: {exc}",
                                 evidence=f"{len(entries)} rows kept in memory, retried", key=f"commit:{shard_id}"))
            log.error("commit of %s failed: %s", shard_id, exc)
            return
        if isinstance(exc, DuplicateSample):
            # must not happen (ids are checked before dispatch); keep the store consistent and say so
            fresh, seen = [], set()
            for g in entries:
                if g.item.sample_id not in seen and not self.store.is_committed(g.item.sample_id):
                    seen.add(g.item.sample_id)
                    fresh.append(g)
            self.emit(AlertEvent(severity=Severity.ERROR, text=f"duplicate sample ids in a commit of {shard_id}; dropped"
                                 f" {len(entries) - len(fresh)} duplicate rows", evidence=str(exc),
                                 key=f"duplicate:{shard_id}"))
            log.error("duplicate samples in %s: %s", shard_id, exc)
            if fresh:
                self._requeue(shard_id, fresh)  # committed with the shard's next part
                self._wake.set()
            return
        if isinstance(exc, concurrent.futures.CancelledError):
            self._requeue(shard_id, entries)  # never ran (executor shut down): nothing was written
            return
        # a bug (e.g. a row that fails validation): the rows are not committed; say so loudly
        self._requeue(shard_id, entries)
        log.error("commit of %s failed unexpectedly: %r", shard_id, exc, exc_info=exc)
        self.emit(AlertEvent(severity=Severity.ERROR, text=f"commit of {shard_id} failed: {exc!r}",
                             evidence=f"{len(entries)} rows kept in memory", key=f"commit-bug:{shard_id}"))

    def _requeue(self, shard_id: str, entries: list[Generated]) -> None:
        buf = self.buffers.get(shard_id)
        if buf is None:
            buf = self.buffers[shard_id] = _Buffer()
        buf.entries[:0] = entries

    def _committed(self, part: PartInfo, entries: list[Generated]) -> None:
        log.info("committed %s: %d rows, %d output tokens, at %.3f", part.path, part.rows, part.output_tokens,
                 part.committed_at)
        served: dict[str, list[int]] = {}
        for g in entries:
            sums = served.setdefault(g.row.worker, [0, 0])
            sums[0] += len(g.row.prompt_ids)
            sums[1] += g.row.cached_tokens
        self.ledger.settle(Committed(part, tuple((g.item, g.answer) for g in entries),
                                     tuple((name, p, c) for name, (p, c) in served.items()),
                                     cut={g.item.sample_id: g.row.finish_reason for g in entries
                                          if g.row.finish_reason in CUT_FINISHES}))


def _commit(store: ShardStore, shard_id: str, entries: list[Generated]) -> PartInfo:
    """In the commit thread: the rows in the store's format, and the history answers later turns are built on."""
    rows = [g.row.store_row() for g in entries]
    history = {g.item.sample_id: g.answer for g in entries if g.answer is not None}
    return store.commit(shard_id, rows, history)
