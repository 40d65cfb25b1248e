"""The feed: turns the prompt files into work items for the ledger, streamed, never materialized, with a bounded
look-ahead (the ledger says when it needs more); resume skips settled sample ids. A paused shard's conversations are
remembered as index ranges and streamed again when it resumes; first turns are rendered in batches off the loop, a
later turn (turns = "all") when the ledger asks (`build_turn`). The counting pass: engine.run.prompt_count.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

from engine.config.load import RunConfig
from engine.text.ingest import Conversation
from engine.text.render import Renderer, sample_id
from engine.run.conversations import ConvProgress, Unfit, reject_for
from engine.run.items import WorkItem
from engine.run import prompt_limit
from engine.run.ledger import Ledger
from engine.run.prompt_count import PromptCount
from engine.run.prompt_limit import PromptLimit
from engine.store.names import shard_id_for

log = logging.getLogger("regen.feed")

FEED_BATCH = 64


class Feed:
    def __init__(self, cfg: RunConfig, renderer: Renderer, prompts: PromptCount):
        self.cfg = cfg
        self.renderer = renderer
        self.prompts = prompts  # the counting pass: where each shard's conversations start
        where = "run.toml" if cfg.context_length else "the model's config / tokenizer"
        self.limit = prompt_limit.from_context(renderer.context_length, where)  # tightened by the servers' reports
        self.ledger: Ledger | None = None  # the ledger fed (attach), opened on the counted shards
        self._deferred: dict[str, list[list[int]]] = collections.defaultdict(list)  # shard -> [[start, end)]
        self._rescans: collections.deque[_Rescan] = collections.deque()
        self._main_done = False
        self._main_iter: Iterator[Conversation] | None = None
        self._shard_order: list[str] | None = None  # shards in index order (set after the count)
        self._incomplete_from = 0  # every shard before this position in _shard_order is complete
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="regen-render")
        self._wake = asyncio.Event()

    # -- feeding the ledger -------------------------------------------------------------------
    def use_limit(self, limit: PromptLimit) -> None:
        """The servers refuse shorter prompts than the tokenizer's context allows: items made from now on fit them."""
        self.limit = limit

    def wake(self) -> None:
        self._wake.set()

    def rescan(self, shard_id: str) -> None:
        """A resumed shard: its conversations the feed passed while it was paused are streamed again."""
        for start, end in self._deferred.pop(shard_id, []):
            self._rescans.append(_Rescan(self.prompts.stream_from(start), start, end))
        self._wake.set()

    def attach(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def _attached(self) -> Ledger:
        if self.ledger is None:
            raise RuntimeError("the feed is asked for work before a ledger is attached (Feed.attach)")
        return self.ledger

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
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                continue  # periodic re-check

    def _needs_more(self) -> bool:
        if not self._attached().needs_work():
            return False
        if not self._rescans and self._main_done:
            return False
        if not self._rescans and self._only_paused_left():
            return False  # everything left is paused: do not walk the file
        return True

    def _only_paused_left(self) -> bool:
        # called once per feed batch: scanning every shard each time is quadratic on a resumed run
        # with many complete shards; completion is final within a run, so skip those for good
        ledger = self._attached()
        shards = ledger.shards
        order = self._ordered_shards()
        i = self._incomplete_from
        while i < len(order) and shards[order[i]].complete:
            i += 1
        self._incomplete_from = i
        return all(ledger.is_paused(order[k]) for k in range(i, len(order)) if not shards[order[k]].complete)

    def _next_source(self) -> _Rescan | Iterator[Conversation] | None:
        if self._rescans:
            return self._rescans[0]
        if self._main_done:
            return None
        if self._main_iter is None:
            shards = self._attached().shards
            first = next((shards[sid].first_index for sid in self._ordered_shards() if not shards[sid].complete), 0)
            self._main_iter = self.prompts.stream_from(first)
            if first:
                log.info("feed starts at conversation %d (shard %s): every shard before it is complete",
                         first, shard_id_for(first, self.cfg.shard_size))
        return self._main_iter

    def _ordered_shards(self) -> list[str]:
        if self._shard_order is None:
            shards = self._attached().shards
            self._shard_order = sorted(shards, key=lambda sid: shards[sid].first_index)
        return self._shard_order

    def _source_exhausted(self, source: _Rescan | Iterator[Conversation]) -> None:
        if source is self._main_iter:
            self._main_done = True
            self._main_iter = None
            log.info("prompt stream fully read")
        else:
            self._rescans.popleft()

    async def _admit(self, batch: list[Conversation]) -> None:
        loop = asyncio.get_running_loop()
        ledger = self._attached()
        store = ledger.store
        pending: list[ConvProgress] = []
        after_cut: list[tuple[ConvProgress, tuple[int, str]]] = []  # resumed conversations that ended at a cut turn
        for conv in batch:
            sid = shard_id_for(conv.index, self.cfg.shard_size)
            counts = ledger.shards.get(sid)
            if counts is None or ledger.is_active(conv.conversation_id):
                continue
            if counts.complete:
                continue  # every sample settled (on resume: committed): no per-sample lookups
            if ledger.is_paused(sid):
                self._defer(sid, conv.index)
                continue
            turns = self.renderer.user_turns(conv, self.cfg.turns)
            if counts.settled:
                remaining = [t for t in turns if not store.is_settled(sample_id(conv.conversation_id, t))]
            else:
                remaining = turns  # nothing of this shard is settled yet: no sqlite lookup per sample
            if not remaining:
                continue
            progress = ConvProgress(conv=conv, shard_id=sid, turns=remaining)
            if self.cfg.turns == "all" and remaining[0] != turns[0]:
                cut = store.cut_turn(conv.conversation_id) if ledger.stop_after_cut_turns else None
                if cut is not None and cut[0] < remaining[0]:
                    after_cut.append((progress, cut))  # settled at once: a restart keeps the decision
                    continue
                progress.answers = dict(store.history(conv.conversation_id))
            pending.append(progress)
        if after_cut:
            ledger.begin([p for p, _ in after_cut])
            for progress, (turn, finish) in after_cut:
                ledger.stop_after_cut(progress, turn, finish)
        if not pending:
            return
        ledger.begin(pending)
        built = await loop.run_in_executor(self._executor, self._build_first, pending)
        for progress, items in zip(pending, built):
            ledger.admit(progress, items)

    def _defer(self, sid: str, index: int) -> None:
        ranges = self._deferred[sid]
        if ranges and ranges[-1][1] == index:
            ranges[-1][1] = index + 1
        else:
            ranges.append([index, index + 1])

    # -- rendering ------------------------------------------------------------------------------
    def _build_first(self, pending: list[ConvProgress]) -> list[list[WorkItem | Unfit]]:
        """The first items of each conversation, rendered with ONE batched tokenizer call (the
        per-call overhead of transformers' tokenizer is ~2/3 of rendering a short prompt); a batch
        that fails is rendered again one by one, so only the rows that fail are rejected."""
        first_turns: Callable[[ConvProgress], list[int]] = (
            (lambda p: p.turns[:1]) if self.cfg.turns == "all" else (lambda p: p.turns))
        wanted = [(p, t) for p in pending for t in first_turns(p)]
        try:
            messages = [self.renderer.build_messages(p.conv, t, p.answers, self.cfg.turns) for p, t in wanted]
            all_ids = self.renderer.prompt_ids_many(messages)
        except Exception:  # noqa: BLE001  # some row cannot render: build_turn names it, one by one
            all_ids = None
        built = iter([self.build_turn(p, t) for p, t in wanted] if all_ids is None else
                     [self._item(p, t, ids) for (p, t), ids in zip(wanted, all_ids)])
        return [[next(built) for _ in first_turns(p)] for p in pending]

    def build_turn(self, progress: ConvProgress, turn: int) -> WorkItem | Unfit:
        """One turn of a conversation as a work item (its history: the committed answers of earlier turns)."""
        conv = progress.conv
        try:
            messages = self.renderer.build_messages(conv, turn, progress.answers, self.cfg.turns)
            prompt_ids = self.renderer.prompt_ids(messages)
        except Exception as exc:  # a template that cannot render this row: the row is rejected, loudly
            return Unfit(turn, reject_for(conv, f"turn {turn}: chat template failed: {type(exc).__name__}: {exc}",
                                          kind="template_error"))
        return self._item(progress, turn, prompt_ids)

    def _item(self, progress: ConvProgress, turn: int, prompt_ids: list[int]) -> WorkItem | Unfit:
        conv = progress.conv
        sid = sample_id(conv.conversation_id, turn)
        if not self.limit.fits(len(prompt_ids)):
            return Unfit(turn, reject_for(conv, f"turn {turn}: {self.limit.reason(len(prompt_ids))}", excerpt=sid,
                                          kind="context_overflow"))
        return WorkItem(sample_id=sid, conv=conv, turn=turn, shard_id=progress.shard_id, prompt_ids=prompt_ids,
                        max_new_tokens=min(self.cfg.sampling.max_new_tokens, self.limit.room(len(prompt_ids))),
                        is_last_turn=turn == progress.turns[-1],
                        prompt_opened=self.renderer.opens_think(prompt_ids))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


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


def _take(source: _Rescan | Iterator[Conversation], n: int) -> list[Conversation]:
    if isinstance(source, _Rescan):
        return source.take(n)
    out: list[Conversation] = []
    for conv in source:
        out.append(conv)
        if len(out) >= n:
            break
    return out
