"""The ledger: the one owner of sample state in a run (per-shard counts, pauses, the ready queue, the items held back
by a pause, the conversations in progress) and the one place an outcome arrives: a generated answer goes on to the
committer (its AnswerSink), every other outcome is settled here, and a committed part settles its samples.
Committed state is the truth: counts move only with a committed part or a sample settled without a row.
"""
from __future__ import annotations

import asyncio
import collections
import logging

from engine.api.wire import FinishReason
from engine.config.load import RunConfig
from engine.text.row_errors import Reject
from engine.store.rejects import RejectLog
from engine.text.render import sample_id
from engine.run.brake import REFUSED_SHAPE
from engine.run.conversations import ConvProgress, Unfit, reject_for
from engine.run.counts import CommitRate, ShardCounts
from engine.run.dispatch_guard import DispatchGuard
from engine.run.items import Committed, Failed, Generated, Outcome, Rejected, Retry, WorkItem
from engine.run.ledger_ports import AnswerSink, FeedHooks, LedgerEvents
from engine.run.ready_queue import ReadyQueue
from engine.run.refusals import RefusalTrip
from engine.run.shard_tally import ShardTally
from engine.store.names import AFTER_CUT, SettleKind
from engine.store.shard_store import ShardStore

log = logging.getLogger("regen.ledger")

MIN_LOOKAHEAD = 32  # ready items kept queued, at least
# the reject kinds of samples the servers refused or failed (and the later turns that chained on them)
SERVER_REFUSALS = ("sglang_rejected", "generation_failed", "earlier_turn_rejected", "earlier_turn_failed")
MIN_ACTIVE = 256  # conversations in progress, at least


class Ledger(ShardTally):
    def __init__(self, cfg: RunConfig, shards: dict[str, ShardCounts], store: ShardStore, rejects: RejectLog, *,
                 feed: FeedHooks, events: LedgerEvents):
        super().__init__(shards, store, rejects, events)
        self.turns = cfg.turns
        self.stop_after_cut_turns = cfg.turns == "all" and cfg.turns_after_cut == "stop"
        self.feed = feed  # builds later turns, streams resumed shards again, is woken when the queue runs low
        self.answers: AnswerSink | None = None  # the committer (answers_to): it writes each generated answer
        self.rate = CommitRate()  # output tokens committed per second in this start (started with dispatch)
        self._ready = ReadyQueue(cfg.dispatch.affinity, cfg.dispatch.affinity_hold_s)
        self._held: dict[str, collections.deque[WorkItem]] = collections.defaultdict(collections.deque)
        self._active: dict[str, ConvProgress] = {}
        # conversations whose every outstanding item is answered and waits only for its commit: they hold no
        # slot and no queued work, so they do not count against _max_active (a.k.a. the look-ahead)
        self._parked: set[str] = set()
        self._low_water = MIN_LOOKAHEAD
        self._max_active = MIN_ACTIVE
        self._item_ready = asyncio.Event()
        self.guard = DispatchGuard(cfg, store, events)  # the brake and the refusals: what holds dispatch run-wide
        self.brake, self.refusals = self.guard.brake, self.guard.refusals

    def answers_to(self, sink: AnswerSink) -> None:
        """Where generated answers go (the committer, made on this ledger: it settles their parts here)."""
        self.answers = sink

    def open(self) -> None:
        """The store's side of a start (ShardTally.load), then the recorded brake judged again."""
        self.load()
        self.guard.load()

    # -- figures (read by the status, the watch, the feed; the per-shard ones: ShardTally) ---------------
    @property
    def work_waiting(self) -> bool:
        """Items are queued for dispatch."""
        return bool(self._ready)

    @property
    def queued(self) -> int:
        """Items in the ready queue (what no server holds yet)."""
        return len(self._ready)

    def queued_for(self, worker: str) -> int:
        """Items of the ready queue held or preferred for `worker` (prefix affinity)."""
        return self._ready.held_for(worker)

    @property
    def braked(self) -> bool:
        """The data-quality brake, or the servers' refusals, hold dispatch run-wide."""
        return self.guard.holds

    @property
    def all_paused(self) -> bool:
        """Nothing dispatchable: braked, or every shard with work left is paused (or nothing is left but paused
        work)."""
        if self.finished:
            return False
        if self.braked:
            return True
        if self._paused and self._paused >= {s for s, c in self._shards.items() if not c.complete}:
            return True
        return (not self._ready and not self._active
                and all(c.complete or sid in self._paused for sid, c in self._shards.items()))

    def chains_on(self, item: WorkItem) -> bool:
        """A later turn of the conversation waits for this item's commit (turns = "all")."""
        return self.turns == "all" and not item.is_last_turn

    # -- sizing and the feed's questions ------------------------------------------------------------
    def size_for(self, capacity: int) -> None:
        """Look-ahead sized to the ready dispatch capacity (requests the servers take at once)."""
        self._low_water = max(MIN_LOOKAHEAD, 2 * capacity)
        self._max_active = max(MIN_ACTIVE, 4 * capacity)

    def needs_work(self) -> bool:
        """The feed should admit more: the queue is below its low water and fewer conversations than _max_active
        still need a server (one whose answers only wait for their commit is parked, not counted: issue 25)."""
        return len(self._ready) < self._low_water and len(self._active) - len(self._parked) < self._max_active

    def is_active(self, conversation_id: str) -> bool:
        return conversation_id in self._active

    def dispatch_began(self) -> None:
        self.rate.start()

    # -- the ready queue --------------------------------------------------------------------------
    def worker_ready(self, name: str, ready: bool) -> None:
        """A dispatch target became ready, or stopped being (its cache is gone: the items it was preferred for
        go to the others)."""
        self._ready.worker_ready(name, ready)

    def next_item(self, worker: str | None = None) -> WorkItem | None:
        """The next item for a free slot of `worker` (engine.run.ready_queue says which)."""
        if self.braked:  # items stay queued, in order, for the resume
            self._item_ready.clear()
            return None
        while self._ready:
            item = self._ready.pop_for(worker)
            if item is None:
                break  # only items held for other workers: the caller polls again
            if item.shard_id in self._paused:
                self._held[item.shard_id].append(item)
                continue
            if len(self._ready) < self._low_water:
                self.feed.wake()
            return item
        self._item_ready.clear()
        self.feed.wake()
        return None

    async def wait_item(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._item_ready.wait(), timeout)
        except asyncio.TimeoutError:
            return  # the caller polls again (pause state, stop flags)

    def _push(self, items: list[WorkItem], front: bool = False, prefer: str | None = None) -> None:
        self._ready.push(items, front=front, prefer=prefer)
        if items:
            self._item_ready.set()

    def _requeue(self, item: WorkItem) -> None:
        """Retries and crash re-queues go to the front: they are the oldest work."""
        self._push([item], front=True)

    # -- pause ------------------------------------------------------------------------------------
    def set_paused(self, shard_ids: list[str] | None, paused: bool) -> list[str]:
        """Pause or resume shards (None: all); the store records it. Returns the shards whose state changed (a resume
        of --all with 2 paused shards changed 2, not every shard of the run)."""
        targets = list(self._shards) if shard_ids is None else shard_ids
        unknown = [s for s in targets if s not in self._shards]
        if unknown:
            raise KeyError(f"unknown shard(s): {', '.join(unknown)}; known: {self._shard_range()}")
        changed = [sid for sid in dict.fromkeys(targets) if (sid in self._paused) != paused]
        self.store.set_paused(targets if shard_ids is not None else None, paused)
        if shard_ids is None and not paused:
            self._release_brake()
        for sid in targets:
            if paused:
                self._paused.add(sid)
            elif sid in self._paused:
                self._paused.discard(sid)
                held = self._held.pop(sid, None)
                if held:
                    self._push(list(held), front=True)
                self.feed.rescan(sid)
                self.feed.wake()
            self.events.shard_changed(sid)
        return changed

    def _release_brake(self) -> None:
        was = self.guard.release()
        if was is None:
            return
        if self._ready:
            self._item_ready.set()
        self.feed.wake()
        self.events.brake_changed(was, False)

    # -- admission (from the feed) ----------------------------------------------------------------
    def begin(self, progress: list[ConvProgress]) -> None:
        """Conversations the feed is rendering: in progress from now on (the feed will not admit them twice)."""
        for p in progress:
            self._active[p.conv.conversation_id] = p

    def admit(self, progress: ConvProgress, built: list[WorkItem | Unfit], front: bool = False) -> None:
        """The feed's rendered turns of a conversation: items queued, unfit turns settled as rejected."""
        items = []
        for entry in built:
            if isinstance(entry, Unfit):
                self._settle_turn(progress, entry.turn, SettleKind.REJECTED, entry.reject)
                if self.turns == "all":
                    for later in list(progress.turns):
                        self._settle_turn(progress, later, SettleKind.REJECTED, reject_for(
                            progress.conv, f"turn {later}: not generated: turn {entry.turn} rejected",
                            kind="earlier_turn_rejected"))
            else:
                progress.outstanding += 1
                items.append(entry)
        self._push(items, front=front, prefer=progress.worker)
        self._maybe_retire(progress)

    # -- delivery and settling ---------------------------------------------------------------------
    def take(self, outcome: Outcome) -> None:
        """The dispatcher's outcome of an item: an answer goes on to the committer (and frees its slot), every other
        outcome is settled."""
        if isinstance(outcome, Generated):
            if self.answers is None:
                raise RuntimeError("an answer arrived before the ledger was given its committer (Ledger.answers_to)")
            self.answers.add(outcome)
            self.generated(outcome.item)
        else:
            self.settle(outcome)

    def generated(self, item: WorkItem) -> None:
        """An answer was generated and handed to the committer: its slot is free; the sample is not settled until
        its part is committed (`settle(Committed)`), so a crash before that generates it again."""
        progress = self._active.get(item.conv.conversation_id)
        if progress is None:
            return
        progress.finished += 1
        self._park(progress)

    def _park(self, progress: ConvProgress) -> None:
        cid = progress.conv.conversation_id
        if 0 < progress.outstanding <= progress.finished and cid in self._active:
            if cid not in self._parked:
                self._parked.add(cid)
                self.feed.wake()
        else:
            self._parked.discard(cid)

    def settle(self, outcome: Outcome) -> None:
        """Every outcome but `Generated` (the committer's) ends here."""
        if isinstance(outcome, Committed):
            self._committed(outcome)
        elif isinstance(outcome, Retry):
            if outcome.delay_s > 0:
                asyncio.get_running_loop().call_later(outcome.delay_s, self._requeue, outcome.item)
            else:
                self._requeue(outcome.item)
        elif isinstance(outcome, Failed):
            self._not_generated(outcome.item, SettleKind.FAILED, outcome.reason, outcome.excerpt)
        elif isinstance(outcome, Rejected):
            self._not_generated(outcome.item, SettleKind.REJECTED, outcome.reason, outcome.excerpt)
        else:
            raise TypeError(f"the ledger does not settle {type(outcome).__name__}")

    def _committed(self, outcome: Committed) -> None:
        part = outcome.part
        self._shards[part.shard_id].add_part(part)
        self.rate.add(part.output_tokens)
        self.refusals.ok(len(outcome.samples))
        self.brake.window.add(part.shapes)
        self.guard.judge()
        self.events.shard_changed(part.shard_id)
        self.add_served(outcome.served)
        for item, answer in outcome.samples:
            progress = self._active.get(item.conv.conversation_id)
            if progress is None:
                continue
            progress.outstanding -= 1
            progress.finished = max(0, progress.finished - 1)
            progress.worker = item.served_by or None
            if item.turn in progress.turns:
                progress.turns.remove(item.turn)
            if self.stop_after_cut_turns and progress.turns and item.sample_id in outcome.cut:
                self.stop_after_cut(progress, item.turn, outcome.cut[item.sample_id])
                continue
            if self.turns == "all" and progress.turns:
                progress.answers[item.turn] = answer or ""
                self.admit(progress, [self.feed.build_turn(progress, progress.turns[0])], front=True)
                self._park(progress)
                continue
            self._maybe_retire(progress)
            self._park(progress)

    def stop_after_cut(self, progress: ConvProgress, cut_turn: int, finish_reason: str = "") -> None:
        """turns_after_cut = "stop": turn `cut_turn` was committed cut, so the conversation's turns left are not
        generated; each is settled as rejected (kind after_cut), with the reason in rejects.jsonl."""
        how = "was stopped as a runaway" if finish_reason == FinishReason.REPETITION else (
            "ended at max_new_tokens" if finish_reason == FinishReason.LENGTH
            else "was cut (max_new_tokens or runaway)")
        for later in list(progress.turns):
            self._settle_turn(progress, later, SettleKind.REJECTED, reject_for(
                progress.conv, f"turn {later}: not generated: turn {cut_turn} {how} (turns_after_cut = \"stop\")",
                kind=AFTER_CUT))
        self._maybe_retire(progress)
        self._park(progress)

    def _not_generated(self, item: WorkItem, kind: SettleKind, reason: str, excerpt: str) -> None:
        """A sample that will not be generated in this run: failed (retries spent) or rejected (HTTP 400)."""
        if self.refusals.tripped is not None:
            # a request in flight when the run was refused run-wide: not settled, so the next start generates it
            log.info("%s %s after the run-wide refusal: left unsettled (%s)", item.sample_id, kind, reason)
            return
        progress = self._active.get(item.conv.conversation_id)
        reject = reject_for(item.conv, f"turn {item.turn}: {reason}", excerpt=excerpt,
                            kind="generation_failed" if kind == SettleKind.FAILED else "sglang_rejected")
        trip = self.refusals.refused(item.sample_id, kind, reason)
        self.brake.window.add([REFUSED_SHAPE])
        if trip is None:
            self.guard.judge()
        if progress is None:
            self.count(item.shard_id, kind, item.sample_id, reject)
            if trip is not None:
                self._refused_run_wide(trip)
            return
        progress.outstanding -= 1
        self._settle_turn(progress, item.turn, kind, reject)
        if self.turns == "all":
            # later turns chain on this answer: they cannot be generated either
            for later in list(progress.turns):
                self._settle_turn(progress, later, kind, reject_for(
                    item.conv, f"turn {later}: not generated: turn {item.turn} {kind}", kind=f"earlier_turn_{kind}"))
        self._maybe_retire(progress)
        self._park(progress)
        if trip is not None:
            self._refused_run_wide(trip)

    def _refused_run_wide(self, trip: RefusalTrip) -> None:
        """Dispatch stops (nothing more is pulled) and the refusals are unsettled: they were the config's fault, so the
        next start generates them again; the counts move back with the store."""
        log.error("the servers refuse the run's requests (%s): %s; likely key %s", trip.rule, trip.reason, trip.key)
        self.unsettle(SERVER_REFUSALS)
        self.events.refused(trip)

    def _settle_turn(self, progress: ConvProgress, turn: int, kind: SettleKind, reject: Reject) -> None:
        if turn in progress.turns:
            progress.turns.remove(turn)
        self.count(progress.shard_id, kind, sample_id(progress.conv.conversation_id, turn), reject)

    def _maybe_retire(self, progress: ConvProgress) -> None:
        if progress.outstanding <= 0 and not progress.turns:
            self._active.pop(progress.conv.conversation_id, None)
            self._parked.discard(progress.conv.conversation_id)
            self.feed.wake()

