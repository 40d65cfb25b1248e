"""The work plan: which samples remain, in which order they become ready, and when a shard is done.

Prompts are streamed, never materialized: one counting pass at startup gives per-shard totals,
then a feed pass turns conversations into ready work items with a bounded look-ahead. A sample
is identified by its sample id (`<conversation_id>#turn<k>`); resume skips committed ids.

Counting once: the counting pass's result is cached in the run dir (engine.count_cache), keyed by
the prompt files and the config fields that change it; with it the pass is a file read, and the
feed starts reading at the first incomplete shard's first conversation instead of re-parsing
every committed conversation before it.

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

from pathlib import Path

from engine import count_cache
from engine.config import RunConfig
from engine.run.counts import CommitRate, ShardCounts
from engine.ingest import Conversation, Reject, StreamStart, iter_prompts, resolve_prompt_files
from engine.render import Renderer, sample_id
from engine.rejects import RejectLog
from engine.shard_store import PartInfo, ShardStore, shard_id_for

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
        self.rate = CommitRate()  # output tokens committed per second in this start (started with dispatch)
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
        self._files: list[Path] | None = None  # the resolved prompt files (set by the count)
        self._starts: dict[str, tuple[StreamStart, str]] = {}  # shard -> its first conversation (pos, id)
        self._skip: dict[int, set[int]] = {}  # file number -> positions the full stream rejects
        self._seekable = False
        self._count_from_cache = False
        self._cache_to_save: tuple[list[dict], count_cache.CountResult] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="regen-render")
        self._wake_feed = asyncio.Event()
        self._item_ready = asyncio.Event()
        self.changed: Callable[[str], None] = lambda shard_id: None  # progress listener (telemetry)

    # -- startup ----------------------------------------------------------------------------
    def count_stream(self) -> list[Reject]:
        """The counting pass (safe in a thread: touches no sqlite): per-shard totals and bad input
        rows, from the run dir's count cache when the prompt files and config are unchanged."""
        started = time.monotonic()
        self._files = files = resolve_prompt_files(self.cfg.prompts)
        facts = None
        try:
            facts = count_cache.file_facts(files)
        except OSError as exc:
            log.warning("count cache: cannot fingerprint the prompt files (%s): not used", exc)
        if facts is not None and self._use_cache(facts, started):
            return []
        bad: list[Reject] = []
        file_no_of = {str(p): i for i, p in enumerate(files)}
        skip: dict[int, set[int]] = {}
        seekable = True
        for entry in iter_prompts(self.cfg.prompts, self.cfg.prompt_format, files=files):
            if isinstance(entry, Reject):
                bad.append(entry)
                fno = file_no_of.get(entry.file)
                pos = entry.line if entry.line is not None else entry.row
                if fno is None or pos is None:
                    seekable = False  # a reject without a position: partial streams could shift indices
                else:
                    skip.setdefault(fno, set()).add(pos)
                continue
            sid = shard_id_for(entry.index, self.cfg.shard_size)
            counts = self.shards.get(sid)
            if counts is None:
                counts = self.shards[sid] = ShardCounts(first_index=entry.index)
                pos = entry.offset if entry.line is not None else entry.row
                if pos is None:
                    seekable = False
                else:
                    self._starts[sid] = (StreamStart(file_no_of[entry.file], pos, entry.line, entry.index),
                                         entry.conversation_id)
            counts.conversations += 1
            counts.total += len(self.renderer.user_turns(entry, self.cfg.turns))
            counts.end_index = entry.index + 1
        self.input_rejects = len(bad)
        self._skip = skip
        self._seekable = seekable
        self._count_s = time.monotonic() - started
        if facts is not None:
            result = count_cache.CountResult(
                [count_cache.ShardStart(sid, c.conversations, c.total, c.first_index, c.end_index,
                                        self._starts[sid][0] if sid in self._starts else None,
                                        self._starts[sid][1] if sid in self._starts else "")
                 for sid, c in self.shards.items()], skip, len(bad), self._count_s, seekable)
            self._cache_to_save = (facts, result)  # saved by finish_count, once the rejects are logged
        return bad

    def _use_cache(self, facts: list[dict], started: float) -> bool:
        run_dir = Path(self.cfg.run_dir)
        try:
            cached = count_cache.load(run_dir, self.cfg, facts)
            if cached.input_rejects > self.rejects.count:
                raise count_cache.CacheUnusable(
                    f"{self.rejects.path} holds {self.rejects.count} rejects, fewer than the {cached.input_rejects}"
                    " bad input rows of the cached count", stale=True)
        except count_cache.CacheUnusable as exc:
            if exc.stale:
                log.info("count cache: not used: %s; counting the prompt files", exc)
            else:
                log.warning("count cache: IGNORED: %s; counting the prompt files again", exc)
            return False
        for sh in cached.shards:
            self.shards[sh.shard_id] = ShardCounts(total=sh.total, conversations=sh.conversations,
                                                   first_index=sh.first_index, end_index=sh.end_index)
            if sh.start is not None:
                self._starts[sh.shard_id] = (sh.start, sh.first_id)
        self._skip = cached.skip
        self._seekable = cached.seekable
        self.input_rejects = cached.input_rejects
        self._count_from_cache = True
        self._count_s = time.monotonic() - started
        log.info("count cache: %d shards, %d bad input rows from %s (prompt files unchanged; the full count "
                 "took %.1f s)", len(cached.shards), cached.input_rejects, run_dir / count_cache.CACHE_FILE,
                 cached.count_s)
        return True

    def finish_count(self, bad: list[Reject]) -> None:
        """Store side of the counting pass (on the loop thread): shards, committed counts, paused set."""
        self.rejects.add_many(bad)  # one fsync for the lot
        if self._cache_to_save is not None:
            facts, result = self._cache_to_save
            self._cache_to_save = None
            try:
                path = count_cache.save(Path(self.cfg.run_dir), self.cfg, facts, result)
                log.info("count cache: saved %s (%d shards)", path, len(result.shards))
            except OSError as exc:
                log.warning("count cache: cannot save it in %s (%s): the next start counts again", self.cfg.run_dir, exc)
        self.store.ensure_shards({sid: c.conversations for sid, c in self.shards.items()},
                                 {sid: c.total for sid, c in self.shards.items()})
        try:
            forgotten = self.store.forget_failed()
        except OSError as exc:
            forgotten = 0
            log.error("%s: they stay failed in this run", exc)
        if forgotten:
            log.info("plan: %d samples that failed in an earlier run are generated again", forgotten)
        for progress in self.store.progress():
            if progress.shard_id in self.shards:
                self.shards[progress.shard_id].load(progress)
        self.paused = set(self.store.paused()) & set(self.shards)
        log.info("plan: %d samples in %d shards (%d already committed), %d bad input rows, counted in %.1f s%s",
                 self.total, len(self.shards), self.done, self.input_rejects, getattr(self, "_count_s", 0.0),
                 " (count cache)" if self._count_from_cache else "")

    # -- streams ----------------------------------------------------------------------------
    def _stream_from(self, first_index: int) -> Iterator[Conversation]:
        """Good conversations from index `first_index` on (earlier ones may come too: callers skip
        them), starting at the saved position of the shard holding it when there is one."""
        full = lambda: _good(iter_prompts(self.cfg.prompts, self.cfg.prompt_format, files=self._files))  # noqa: E731
        sid = shard_id_for(first_index, self.cfg.shard_size)
        entry = self._starts.get(sid) if self._seekable else None
        if entry is None or entry[0].index == 0:
            return full()
        start, first_id = entry
        stream = iter_prompts(self.cfg.prompts, self.cfg.prompt_format, files=self._files, start=start,
                              skip=self._skip)
        return self._checked(stream, sid, start, first_id, full)

    @staticmethod
    def _checked(stream, sid: str, start: StreamStart, first_id: str, full) -> Iterator[Conversation]:
        first = True
        for entry in stream:
            if not isinstance(entry, Conversation):
                continue
            if first:
                first = False
                if entry.conversation_id != first_id or entry.index != start.index:
                    log.error("count cache: shard %s should start with conversation %r (index %d) at file %d"
                              " position %d, found %r (index %d): reading the prompt files from the start instead",
                              sid, first_id, start.index, start.file_no, start.position, entry.conversation_id,
                              entry.index)
                    yield from full()
                    return
            yield entry

    @property
    def total(self) -> int:
        return sum(c.total for c in self.shards.values())

    @property
    def done(self) -> int:
        return sum(c.done for c in self.shards.values())

    @property
    def to_generate(self) -> int:
        """Samples the run will hold: planned less those settled without a row (rejected, failed)."""
        return sum(c.to_generate for c in self.shards.values())

    @property
    def output_tokens(self) -> int:
        return sum(c.output_tokens for c in self.shards.values())

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
                    self._rescans.append(_Rescan(self._stream_from(start), start, end))
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
        order = self._ordered_shards()
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
            first = next((self.shards[sid].first_index for sid in self._ordered_shards()
                          if not self.shards[sid].complete), 0)
            self._main_iter = self._stream_from(first)
            if first:
                log.info("plan: feed starts at conversation %d (shard %s): every shard before it is complete",
                         first, shard_id_for(first, self.cfg.shard_size))
        return self._main_iter

    def _ordered_shards(self) -> list[str]:
        if self._shard_order is None:
            self._shard_order = sorted(self.shards, key=lambda sid: self.shards[sid].first_index)
        return self._shard_order

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
            if self.shards[sid].settled:
                remaining = [t for t in turns if not self.store.is_settled(sample_id(conv.conversation_id, t))]
            else:
                remaining = turns  # nothing of this shard is settled yet: no sqlite lookup per sample
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
        """The first items of each conversation, rendered with ONE batched tokenizer call (the
        per-call overhead of transformers' tokenizer is ~2/3 of rendering a short prompt); a batch
        that fails is rendered again one by one, so only the rows that fail are rejected."""
        wanted = [(state, t) for state in states
                  for t in (state.turns[:1] if self.cfg.turns == "all" else state.turns)]
        try:
            messages = [self.renderer.build_messages(state.conv, t, state.answers, self.cfg.turns)
                        for state, t in wanted]
            all_ids = self.renderer.prompt_ids_many(messages)
        except Exception:  # noqa: BLE001  # some row cannot render: _build names it, one by one
            all_ids = None
        built = iter([self._build(state, t) for state, t in wanted] if all_ids is None else
                     [self._item(state, t, ids) for (state, t), ids in zip(wanted, all_ids)])
        return [[next(built) for _ in (state.turns[:1] if self.cfg.turns == "all" else state.turns)]
                for state in states]

    def _build(self, state: _ConvState, turn: int) -> WorkItem | _Unfit:
        conv = state.conv
        try:
            messages = self.renderer.build_messages(conv, turn, state.answers, self.cfg.turns)
            prompt_ids = self.renderer.prompt_ids(messages)
        except Exception as exc:  # a template that cannot render this row: the row is rejected, loudly
            return _Unfit(turn, reject_for(conv, f"turn {turn}: chat template failed: {type(exc).__name__}: {exc}",
                                           kind="template_error"))
        return self._item(state, turn, prompt_ids)

    def _item(self, state: _ConvState, turn: int, prompt_ids: list[int]) -> WorkItem | _Unfit:
        conv = state.conv
        sid = sample_id(conv.conversation_id, turn)
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
    def chains_on(self, item: WorkItem) -> bool:
        """A later turn of the conversation waits for this item's commit (turns = "all")."""
        return self.cfg.turns == "all" and not item.is_last_turn

    def unsettled(self, shard_id: str) -> int | None:
        """Samples of the shard not settled yet (None: not a shard of this plan)."""
        counts = self.shards.get(shard_id)
        return None if counts is None else counts.total - counts.settled

    def on_part_committed(self, part: PartInfo, committed: list[tuple[WorkItem, str | None]]) -> None:
        """A part is committed (ShardStore.commit returned): its sums move the shard's counts in the same step."""
        self.shards[part.shard_id].add_part(part)
        self.rate.add(part.output_tokens)
        self.changed(part.shard_id)
        for item, answer in committed:
            self._committed(item, answer)

    def _committed(self, item: WorkItem, answer: str | None) -> None:
        state = self.active.get(item.conv.conversation_id)
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
            self._count(item.shard_id, kind, item.sample_id, reject.kind)
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
        self._count(state.shard_id, kind, sample_id(state.conv.conversation_id, turn), reject.kind)
        self._reject(reject)

    def _count(self, shard_id: str, kind: str, sample: str, reason: str) -> None:
        try:
            self.store.settle(shard_id, sample, "rejected" if kind == "rejected" else "failed", reason)
        except OSError as exc:
            # a full disk: the run goes on with the outcome counted here (and in rejects.jsonl when it can be
            # written); only a status read from the run dir alone, or the next start, does not see it
            log.error("%s; it counts as %s in this run", exc, kind)
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

    def __init__(self, stream: Iterator[Conversation], start: int, end: int):
        self.start, self.end = start, end
        self._iter = stream
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
