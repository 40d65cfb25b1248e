"""Buffers finished rows per shard and commits them as part files (ShardStore.commit).

A commit happens every `max_rows` rows or `max_age_s` seconds per shard, and on drain/stop.
A SIGKILL loses only the rows still in the buffer; they are not committed, so the restarted
supervisor regenerates them: never lost, never duplicated.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from engine.shard_store import DuplicateSample, ShardStore
from engine.telemetry_events import AlertEvent
from engine.work import WorkItem, WorkPlan

log = logging.getLogger("regen.committer")


@dataclass
class _Buffer:
    since: float = field(default_factory=time.monotonic)
    entries: list[tuple[WorkItem, dict, str | None]] = field(default_factory=list)


class Committer:
    def __init__(self, store: ShardStore, plan: WorkPlan, emit: Callable[[object], None], *,
                 max_rows: int = 256, max_age_s: float = 2.0, disk_ok: Callable[[], bool] = lambda: True):
        self.store = store
        self.plan = plan
        self.emit = emit
        self.max_rows = max_rows
        self.max_age_s = max_age_s
        self.disk_ok = disk_ok
        self.buffers: dict[str, _Buffer] = {}
        self.committed_rows = 0
        self.parts = 0
        self._wake = asyncio.Event()

    @property
    def pending(self) -> int:
        return sum(len(b.entries) for b in self.buffers.values())

    def add(self, item: WorkItem, row: dict, answer: str | None) -> None:
        buf = self.buffers.setdefault(item.shard_id, _Buffer())
        buf.entries.append((item, row, answer))
        if len(buf.entries) >= self.max_rows or (self.plan.cfg.turns == "all" and not item.is_last_turn):
            self._wake.set()  # a chained turn waits on this commit: do not sit on it for max_age_s

    async def run_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.25)
            except asyncio.TimeoutError:
                pass  # periodic check of buffer ages
            self._wake.clear()
            self.commit_due()

    def commit_due(self) -> None:
        now = time.monotonic()
        for shard_id, buf in list(self.buffers.items()):
            if not buf.entries:
                continue
            due = len(buf.entries) >= self.max_rows or now - buf.since >= self.max_age_s
            chain = any(self.plan.cfg.turns == "all" and not it.is_last_turn for it, _, _ in buf.entries)
            if due or (chain and now - buf.since >= 0.2):
                self._commit(shard_id)

    def flush_all(self) -> None:
        for shard_id in list(self.buffers):
            self._commit(shard_id)

    def _commit(self, shard_id: str) -> None:
        buf = self.buffers.get(shard_id)
        if buf is None or not buf.entries:
            return
        if not self.disk_ok():
            log.warning("not committing %d rows of %s: disk below alerts.disk_free_min_gb", len(buf.entries), shard_id)
            return
        entries = buf.entries
        self.buffers[shard_id] = _Buffer()
        rows = [row for _, row, _ in entries]
        history = {item.sample_id: answer for item, _, answer in entries if answer is not None}
        try:
            part = self.store.commit(shard_id, rows, history)
        except OSError as exc:
            # nothing was committed (tmp file, then rename, then the sqlite txn): keep the rows, retry later
            self.buffers[shard_id].entries[:0] = entries
            self.emit(AlertEvent(severity="critical", text=f"cannot write a part file of {shard_id}: {exc}",
                                 evidence=f"{len(entries)} rows kept in memory, retried", key=f"commit:{shard_id}"))
            log.error("commit of %s failed: %s", shard_id, exc)
            return
        except DuplicateSample as exc:
            # must not happen (ids are checked before dispatch); keep the store consistent and say so
            fresh, seen = [], set()
            for it, row, ans in entries:
                if it.sample_id not in seen and not self.store.is_committed(it.sample_id):
                    seen.add(it.sample_id)
                    fresh.append((it, row, ans))
            self.emit(AlertEvent(severity="error", text=f"duplicate sample ids in a commit of {shard_id}; dropped"
                                 f" {len(entries) - len(fresh)} duplicate rows", evidence=str(exc),
                                 key=f"duplicate:{shard_id}"))
            log.error("duplicate samples in %s: %s", shard_id, exc)
            entries = fresh
            rows = [row for _, row, _ in entries]
            history = {it.sample_id: ans for it, _, ans in entries if ans is not None}
            if not rows:
                return
            part = self.store.commit(shard_id, rows, history)
        self.committed_rows += len(rows)
        self.parts += 1
        log.debug("committed %s: %d rows", part.path, part.rows)
        for item, _, answer in entries:
            self.plan.on_committed(item, answer)
