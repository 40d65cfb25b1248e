"""The work plan: which samples remain, in which order they become ready, and when a shard is done.

Prompts are streamed, never materialized: one counting pass at startup gives per-shard totals,
then a feed pass turns conversations into ready work items with a bounded look-ahead. A sample
is identified by its sample id (`<conversation_id>#turn<k>`); resume skips committed ids.

Paused shards: items already queued are held back at pull time (so a pause stops dispatch at
once); conversations of a paused shard met by the feed are not kept in memory, the index range
is remembered and streamed again (a rescan) when the shard is resumed.

turns = "all": turn k+1 is built from the committed answer of turn k, so it becomes ready only
after turn k is committed (ShardStore.history gives the answers back after a restart).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator

from engine.config import RunConfig
from engine.ingest import Conversation, Reject, iter_prompts
from engine.render import Renderer, sample_id
from engine.rejects import RejectLog
from engine.shard_store import ShardStore, shard_id_for

log = logging.getLogger("regen.work")

FEED_BATCH = 64


@dataclass
class WorkItem:
    sample_id: str
    conv: Conversation
    turn: int
    shard_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    is_last_turn: bool
    attempt: int = 0
    last_error: str = ""

    @property
    def rid(self) -> str:
        return self.sample_id if self.attempt == 0 else f"{self.sample_id}@{self.attempt}"


@dataclass
class ShardCounts:
    total: int = 0  # samples planned (generated turns)
    conversations: int = 0
    done: int = 0  # committed
    failed: int = 0
    rejected: int = 0
    first_index: int = 0
    end_index: int = 0  # one past the last conversation index

    @property
    def settled(self) -> int:
        return self.done + self.failed + self.rejected

    @property
    def complete(self) -> bool:
        return self.settled >= self.total


@dataclass
class _ConvState:
    conv: Conversation
    shard_id: str
    turns: list[int]  # remaining turns to generate, in order
    answers: dict[int, str] = field(default_factory=dict)
    outstanding: int = 0  # items made and not yet settled


@dataclass(frozen=True)
class _Unfit:
    turn: int
    reject: Reject


def reject_for(conv: Conversation, reason: str, excerpt: str = "", kind: str = "") -> Reject:
    """A sample-level reject located at the conversation's input row."""
    file, _, where = conv.origin.rpartition(":")
    line = row = None
    if where.startswith("row") and where[3:].isdigit():
        row = int(where[3:])
    elif where.isdigit():
        line = int(where)
    else:
        file = conv.origin
    if file and conv.source.endswith("/" + file):
        file = conv.source  # origin names the file by its base name; rejects.jsonl gives the full path as ingest does
    return Reject(file=file or conv.source, line=line, row=row, reason=reason, excerpt=excerpt[:300],
                  conversation_id=conv.conversation_id, kind=kind)


class WorkPlan:
    def __init__(self, cfg: RunConfig, renderer: Renderer, store: ShardStore, rejects: RejectLog,
                 on_reject: Callable[[Reject], None] | None = None):
        self.cfg = cfg
        self.renderer = renderer
        self.store = store
        self.rejects = rejects
        self.on_reject = on_reject
        self.context_length = renderer.context_length
        self.shards: dict[str, ShardCounts] = {}
        self.paused: set[str] = set()
        self.ready: collections.deque[WorkItem] = collections.deque()
        self.held: dict[str, collections.deque[WorkItem]] = collections.defaultdict(collections.deque)
        self.active: dict[str, _ConvState] = {}
        self.input_rejects = 0
        self.low_water = 32
        self.max_active = 256
        self._deferred: dict[str, list[list[int]]] = collections.defaultdict(list)  # shard -> [[start, end)]
        self._rescans: collections.deque[_Rescan] = collections.deque()
        self._main_done = False
        self._main_iter: Iterator | None = None
        self._shard_order: list[str] | None = None  # shards in index order (set after the count)
        self._incomplete_from = 0  # every shard before this position in _shard_order is complete
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="regen-render")
        self._wake_feed = asyncio.Event()
        self._item_ready = asyncio.Event()
        self.changed: Callable[[str], None] = lambda shard_id: None  # progress listener (telemetry)

    # -- startup ----------------------------------------------------------------------------
    def count_stream(self) -> list[Reject]:
        """One streaming pass (safe in a thread: touches no sqlite): per-shard totals and bad input rows."""
        started = time.monotonic()
        bad: list[Reject] = []
        for entry in iter_prompts(self.cfg.prompts, self.cfg.prompt_format):
            if isinstance(entry, Reject):
                bad.append(entry)
                continue
            sid = shard_id_for(entry.index, self.cfg.shard_size)
            counts = self.shards.get(sid)
            if counts is None:
                counts = self.shards[sid] = ShardCounts(first_index=entry.index)
            counts.conversations += 1
            counts.total += len(self.renderer.user_turns(entry, self.cfg.turns))
            counts.end_index = entry.index + 1
        self.input_rejects = len(bad)
        self._count_s = time.monotonic() - started
        return bad

    def finish_count(self, bad: list[Reject]) -> None:
        """Store side of the counting pass (on the loop thread): shards, committed counts, paused set."""
        self.rejects.add_many(bad)  # one fsync for the lot
        self.store.ensure_shards({sid: c.conversations for sid, c in self.shards.items()},
                                 {sid: c.total for sid, c in self.shards.items()})
        for progress in self.store.progress():
            if progress.shard_id in self.shards:
                self.shards[progress.shard_id].done = progress.done_samples
        self.paused = set(self.store.paused()) & set(self.shards)
        log.info("plan: %d samples in %d shards (%d already committed), %d bad input rows, counted in %.1f s",
                 self.total, len(self.shards), self.done, self.input_rejects, getattr(self, "_count_s", 0.0))

    @property
    def total(self) -> int:
        return sum(c.total for c in self.shards.values())

    @property
    def done(self) -> int:
        return sum(c.done for c in self.shards.values())

    @property
    def failed(self) -> int:
        return sum(c.failed for c in self.shards.values())

    @property
    def rejected(self) -> int:
        return sum(c.rejected for c in self.shards.values())

    @property
    def finished(self) -> bool:
        return all(c.complete for c in self.shards.values())

    @property
    def blocked_by_pause(self) -> bool:
        """Nothing dispatchable, and the only work left belongs to paused shards."""
        return (not self.finished and not self.ready and not self.active
                and all(c.complete or sid in self.paused for sid, c in self.shards.items()))

    # -- pull -------------------------------------------------------------------------------
    def next_item(self) -> WorkItem | None:
        while self.ready:
            item = self.ready.popleft()
            if item.shard_id in self.paused:
                self.held[item.shard_id].append(item)
                continue
            if len(self.ready) < self.low_water:
                self._wake_feed.set()
            return item
        self._item_ready.clear()
        self._wake_feed.set()
        return None

    async def wait_item(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._item_ready.wait(), timeout)
        except asyncio.TimeoutError:
            return  # the caller polls again (pause state, stop flags)

    def requeue(self, item: WorkItem) -> None:
        """Retries and crash re-queues go to the front: they are the oldest work."""
        self.ready.appendleft(item)
        self._item_ready.set()

    def _push(self, items: list[WorkItem], front: bool = False) -> None:
        if front:
            self.ready.extendleft(reversed(items))
        else:
            self.ready.extend(items)
        if items:
            self._item_ready.set()

    # -- pause ------------------------------------------------------------------------------
    def set_paused(self, shard_ids: list[str] | None, paused: bool) -> list[str]:
        targets = list(self.shards) if shard_ids is None else shard_ids
        unknown = [s for s in targets if s not in self.shards]
        if unknown:
            raise KeyError(f"unknown shard(s): {', '.join(unknown)}; known: {self._shard_range()}")
        changed = self.store.set_paused(targets if shard_ids is not None else None, paused)
        for sid in targets:
            if paused:
                self.paused.add(sid)
            elif sid in self.paused:
                self.paused.discard(sid)
                held = self.held.pop(sid, None)
                if held:
                    self._push(list(held), front=True)
                for start, end in self._deferred.pop(sid, []):
                    self._rescans.append(_Rescan(self.cfg, start, end))
                self._wake_feed.set()
            self.changed(sid)
        return changed if changed is not None else targets

    def _shard_range(self) -> str:
        ids = sorted(self.shards)
        return f"{ids[0]} .. {ids[-1]}" if ids else "(none)"

    # -- feed -------------------------------------------------------------------------------
    async def feed_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._needs_more():
                source = self._next_source()
                if source is not None:
                    batch = await loop.run_in_executor(self._executor, _take, source, FEED_BATCH)
                    if not batch:
                        self._source_exhausted(source)
                    else:
                        await self._admit(batch)
                    continue
            self._wake_feed.clear()
            try:
                await asyncio.wait_for(self._wake_feed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                continue  # periodic re-check

    def _needs_more(self) -> bool:
        if len(self.ready) >= self.low_water or len(self.active) >= self.max_active:
            return False
        if not self._rescans and self._main_done:
            return False
        if not self._rescans and self._only_paused_left():
            return False  # everything left is paused: do not walk the file
        return True

    def _only_paused_left(self) -> bool:
        # called once per feed batch: scanning every shard each time is quadratic on a resumed run
        # with many complete shards; completion is final within a run, so skip those for good
        order = self._shard_order
        if order is None:
            order = self._shard_order = list(self.shards)
        i = self._incomplete_from
        while i < len(order) and self.shards[order[i]].complete:
            i += 1
        self._incomplete_from = i
        return all(order[k] in self.paused for k in range(i, len(order)) if not self.shards[order[k]].complete)

    def _next_source(self):
        if self._rescans:
            return self._rescans[0]
        if self._main_done:
            return None
        if self._main_iter is None:
            self._main_iter = _good(iter_prompts(self.cfg.prompts, self.cfg.prompt_format))
        return self._main_iter

    def _source_exhausted(self, source) -> None:
        if source is self._main_iter:
            self._main_done = True
            self._main_iter = None
            log.info("plan: prompt stream fully read")
        else:
            self._rescans.popleft()

    async def _admit(self, batch: list[Conversation]) -> None:
        loop = asyncio.get_running_loop()
        pending: list[_ConvState] = []
        for conv in batch:
            sid = shard_id_for(conv.index, self.cfg.shard_size)
            if sid not in self.shards or conv.conversation_id in self.active:
                continue
            if self.shards[sid].complete:
                continue  # every sample settled (on resume: committed): no per-sample lookups
            if sid in self.paused:
                self._defer(sid, conv.index)
                continue
            turns = self.renderer.user_turns(conv, self.cfg.turns)
            remaining = [t for t in turns if not self.store.is_committed(sample_id(conv.conversation_id, t))]
            if not remaining:
                continue
            state = _ConvState(conv=conv, shard_id=sid, turns=remaining)
            if self.cfg.turns == "all" and remaining[0] != turns[0]:
                state.answers = dict(self.store.history(conv.conversation_id))
            pending.append(state)
        if not pending:
            return
        for state in pending:
            self.active[state.conv.conversation_id] = state
        built = await loop.run_in_executor(self._executor, self._build_first, pending)
        for state, items in zip(pending, built):
            self._accept(state, items)

    def _defer(self, sid: str, index: int) -> None:
        ranges = self._deferred[sid]
        if ranges and ranges[-1][1] == index:
            ranges[-1][1] = index + 1
        else:
            ranges.append([index, index + 1])

    def _build_first(self, states: list[_ConvState]) -> list[list[WorkItem | _Unfit]]:
        out = []
        for state in states:
            if self.cfg.turns == "all":
                out.append([self._build(state, state.turns[0])])
            else:
                out.append([self._build(state, t) for t in state.turns])
        return out

    def _build(self, state: _ConvState, turn: int) -> WorkItem | _Unfit:
        conv = state.conv
        sid = sample_id(conv.conversation_id, turn)
        try:
            messages = self.renderer.build_messages(conv, turn, state.answers, self.cfg.turns)
            prompt_ids = self.renderer.prompt_ids(messages)
        except Exception as exc:  # a template that cannot render this row: the row is rejected, loudly
            return _Unfit(turn, reject_for(conv, f"turn {turn}: chat template failed: {type(exc).__name__}: {exc}",
                                           kind="template_error"))
        room = self.context_length - len(prompt_ids) - 1
        if room < 1:
            return _Unfit(turn, reject_for(
                conv, f"turn {turn}: prompt does not fit the context: {len(prompt_ids)} tokens,"
                      f" context_length {self.context_length}", excerpt=sid, kind="context_overflow"))
        return WorkItem(sample_id=sid, conv=conv, turn=turn, shard_id=state.shard_id, prompt_ids=prompt_ids,
                        max_new_tokens=min(self.cfg.sampling.max_new_tokens, room),
                        is_last_turn=turn == state.turns[-1])

    def _accept(self, state: _ConvState, built: list[WorkItem | _Unfit], front: bool = False) -> None:
        items = []
        for entry in built:
            if isinstance(entry, _Unfit):
                self._settle(state, entry.turn, "rejected", entry.reject)
                if self.cfg.turns == "all":
                    for later in list(state.turns):
                        self._settle(state, later, "rejected", reject_for(
                            state.conv, f"turn {later}: not generated: turn {entry.turn} rejected",
                            kind="earlier_turn_rejected"))
            else:
                state.outstanding += 1
                items.append(entry)
        self._push(items, front=front)
        self._maybe_retire(state)

    # -- settle -----------------------------------------------------------------------------
    def on_committed(self, item: WorkItem, answer: str | None) -> None:
        state = self.active.get(item.conv.conversation_id)
        counts = self.shards[item.shard_id]
        counts.done += 1
        self.changed(item.shard_id)
        if state is None:
            return
        state.outstanding -= 1
        if item.turn in state.turns:
            state.turns.remove(item.turn)
        if self.cfg.turns == "all" and state.turns:
            state.answers[item.turn] = answer or ""
            next_turn = state.turns[0]
            self._accept(state, [self._build(state, next_turn)], front=True)
            return
        self._maybe_retire(state)

    def on_failed(self, item: WorkItem, reason: str, kind: str = "failed", excerpt: str = "",
                  category: str = "") -> None:
        """A sample that will not be generated in this run: failed (retries spent) or rejected (400)."""
        state = self.active.get(item.conv.conversation_id)
        reject = reject_for(item.conv, f"turn {item.turn}: {reason}", excerpt=excerpt,
                            kind=category or ("generation_failed" if kind == "failed" else "sglang_rejected"))
        if state is None:
            self._count(item.shard_id, kind)
            self._reject(reject)
            return
        state.outstanding -= 1
        self._settle(state, item.turn, kind, reject)
        if self.cfg.turns == "all":
            # later turns chain on this answer: they cannot be generated either
            for later in list(state.turns):
                self._settle(state, later, kind, reject_for(
                    item.conv, f"turn {later}: not generated: turn {item.turn} {kind}", kind=f"earlier_turn_{kind}"))
        self._maybe_retire(state)

    def _settle(self, state: _ConvState, turn: int, kind: str, reject: Reject) -> None:
        if turn in state.turns:
            state.turns.remove(turn)
        self._count(state.shard_id, kind)
        self._reject(reject)

    def _count(self, shard_id: str, kind: str) -> None:
        counts = self.shards[shard_id]
        if kind == "rejected":
            counts.rejected += 1
        else:
            counts.failed += 1
        self.changed(shard_id)

    def _maybe_retire(self, state: _ConvState) -> None:
        if state.outstanding <= 0 and not state.turns:
            self.active.pop(state.conv.conversation_id, None)
            self._wake_feed.set()

    def _reject(self, reject: Reject) -> None:
        self.rejects.add(reject)
        if self.on_reject is not None:
            self.on_reject(reject)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _good(entries) -> Iterator[Conversation]:
    for entry in entries:
        if isinstance(entry, Conversation):
            yield entry


class _Rescan:
    """Conversations with index in [start, end), streamed again (a shard resumed after the feed passed it)."""

    def __init__(self, cfg: RunConfig, start: int, end: int):
        self.start, self.end = start, end
        self._iter = _good(iter_prompts(cfg.prompts, cfg.prompt_format))
        self.exhausted = False

    def take(self, n: int) -> list[Conversation]:
        out: list[Conversation] = []
        if self.exhausted:
            return out
        for conv in self._iter:
            if conv.index < self.start:
                continue
            if conv.index >= self.end:
                self.exhausted = True
                break
            out.append(conv)
            if len(out) >= n:
                return out
        else:
            self.exhausted = True
        return out


def _take(source, n: int) -> list[Conversation]:
    if isinstance(source, _Rescan):
        return source.take(n)
    out = []
    for conv in source:
        out.append(conv)
        if len(out) >= n:
            break
    return out
