"""Compacts each final shard into one file (ShardStore.compact), in its own thread, one shard at a time.

A shard is final when every sample is committed or rejected (no part can join it); commits of other shards go on
meanwhile. A failed compaction leaves the parts committed as they were, is retried after RETRY_S, and raises an alert.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Callable, Mapping, Protocol

from engine.run.counts import ShardCounts
from engine.store.compaction import Compaction
from engine.store.shard_store import ShardStore
from engine.api.events import AlertEvent, Event
from engine.api.wire import Severity

log = logging.getLogger("regen.compactor")

CHECK_S = 1.0  # how often final shards are looked for (a shard becomes final once per run)
RETRY_S = 60.0  # a failed compaction is tried again after this


class CompactLedger(Protocol):
    @property
    def shards(self) -> Mapping[str, ShardCounts]: ...


class Compactor:
    def __init__(self, store: ShardStore, ledger: CompactLedger, emit: Callable[[Event], None], *,
                 disk_ok: Callable[[], bool] = lambda: True):
        self.store = store
        self.ledger = ledger
        self.emit = emit
        self.disk_ok = disk_ok  # a rewrite needs the shard's size again until the parts are removed
        self._done: set[str] = store.compacted_shards()
        self._retry_at: dict[str, float] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="regen-compact")
        self._lock = asyncio.Lock()  # one compaction at a time (run_forever, drain)
        self.compactions: list[Compaction] = []  # this start's, in order

    def due(self) -> list[str]:
        now = time.monotonic()
        return [sid for sid, c in sorted(self.ledger.shards.items())
                if c.final and c.done and sid not in self._done and self._retry_at.get(sid, 0.0) <= now]

    async def run_forever(self) -> None:
        while True:
            await self.compact_due()
            await asyncio.sleep(CHECK_S)

    async def compact_due(self) -> None:
        for shard_id in self.due():
            if not self.disk_ok():
                log.warning("not compacting %s: disk below alerts.disk_free_min_gb", shard_id)
                return
            await self._compact(shard_id)

    async def drain(self) -> None:
        await self.compact_due()

    def close(self) -> None:
        """Wait for the compaction in flight (it finishes or fails whole: never half a swap) and stop the thread."""
        self._executor.shutdown(wait=True)

    async def _compact(self, shard_id: str) -> None:
        async with self._lock:
            if shard_id in self._done:
                return
            future = asyncio.get_running_loop().run_in_executor(self._executor, self.store.compact, shard_id)
            try:
                # shielded: a cancelled caller (the run's end) leaves it to finish; drain() and close() wait for it
                done = await asyncio.shield(future)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  # StoreError, CompactionConflict, a bug: the parts stay
                self._retry_at[shard_id] = time.monotonic() + RETRY_S
                log.error("compaction of %s failed: %s (its parts stay committed; retried in %.0f s)",
                          shard_id, exc, RETRY_S)
                self.emit(AlertEvent(severity=Severity.WARNING, text=f"compaction of {shard_id} failed: {exc}",
                                     evidence=f"its parts stay committed; retried in {RETRY_S:.0f} s",
                                     key=f"compact:{shard_id}"))
                return
            self._done.add(shard_id)
            self._retry_at.pop(shard_id, None)
            if done is not None:
                self.compactions.append(done)
                log.info("compacted %s: %d parts -> %s (%d rows, %.1f MB, %.2f s)", shard_id, done.parts_removed,
                         done.path, done.rows, done.bytes / 1e6, done.seconds)
