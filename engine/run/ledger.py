"""The ledger: the one owner of sample state in a run — per-shard counts, pauses, the ready queue, the items
held back by a pause, the conversations in progress — and the one place an outcome is settled.

Committed state is the truth: the counts are loaded from state.sqlite at a start and move only when a
part is committed or a sample is settled without a row (recorded in the store's outcomes table), so
every figure derived from them holds across restarts (engine.run.counts).

Paused shards: items already queued are held back at pull time (a pause stops dispatch at once);
conversations of a paused shard that the feed meets are the feed's to remember and stream again
(`on_resume`) when the shard is resumed.

The data-quality brake (engine.run.brake) is a run-wide pause the ledger takes itself: each committed part's row
shapes go into its window, and a share over its level holds every item back at pull time (requests in flight finish
and are committed) and is recorded in the store, so a restart stays braked; `set_paused(None, False)` (`regen resume
--all`) releases it and starts the window over.

turns = "all": turn k+1 is built from the committed answer of turn k, so it is asked of the feed
(`build_turn`) when turn k's part is committed. With turns_after_cut = "stop", a turn committed cut (it ended at
max_new_tokens, or the runaway guard stopped it) ends its conversation: the turns left are settled as rejected, reject
kind `after_cut` (`stop_after_cut`; the feed asks the same at a restart for a conversation whose committed turns
end with a cut one, so a crash between the commit and the settling loses nothing).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from engine.config.load import RunConfig
from engine.text.ingest import Conversation, Reject
from engine.store.rejects import RejectLog
from engine.text.render import sample_id
from engine.run.brake import REFUSED_SHAPE, RunBrake
from engine.api.brake import BrakeStatus
from engine.run.counts import CommitRate, ServedTokens, ShardCounts
from engine.run.items import Committed, Failed, Outcome, Rejected, Retry, WorkItem
from engine.run.ready_queue import ReadyQueue
from engine.run.refusals import RefusalTrip, RefusalWatch
from engine.store.shard_store import AFTER_CUT, ShardStore

log = logging.getLogger("regen.ledger")

MIN_LOOKAHEAD = 32  # ready items kept queued, at least
# the reject kinds of samples the servers refused or failed (and the later turns that chained on them)
SERVER_REFUSALS = ("sglang_rejected", "generation_failed", "earlier_turn_rejected", "earlier_turn_failed")
MIN_ACTIVE = 256  # conversations in progress, at least


@dataclass
class ConvProgress:
    """A conversation with turns still to settle (made by the feed, owned by the ledger once admitted)."""
    conv: Conversation
    shard_id: str
    turns: list[int]  # turns still to settle, in order
    answers: dict[int, str] = field(default_factory=dict)  # committed answers (history of later turns)
    outstanding: int = 0  # items made and not yet settled
    finished: int = 0  # of those, answers generated and waiting in the committer's buffer (not settled yet)
    worker: str | None = None  # the worker that served the last committed turn (its cache holds the prefix)


@dataclass(frozen=True)
class Unfit:
    """A turn that cannot be made into a work item (it does not render, or does not fit the context)."""
    turn: int
    reject: Reject


class TurnBuilder(Protocol):
    def __call__(self, progress: ConvProgress, turn: int) -> WorkItem | Unfit: ...


def _no_turn_builder(progress: ConvProgress, turn: int) -> WorkItem | Unfit:
    """Ledger.build_turn until the run's composer wires the feed's (only a bug calls it)."""
    raise RuntimeError(f"the ledger was asked for turn {turn} of {progress.conv.conversation_id}, but no turn builder "
                       "is wired (Ledger.build_turn: the feed's)")


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


class Ledger:
    def __init__(self, cfg: RunConfig, shards: dict[str, ShardCounts], store: ShardStore, rejects: RejectLog):
        self.turns = cfg.turns
        self.stop_after_cut_turns = cfg.turns == "all" and cfg.turns_after_cut == "stop"
        self.store = store
        self.rejects = rejects
        self._shards = shards
        self.rate = CommitRate()  # output tokens committed per second in this start (started with dispatch)
        self._paused: set[str] = set()
        self._ready = ReadyQueue(cfg.dispatch.affinity, cfg.dispatch.affinity_hold_s)
        self._served: dict[str, ServedTokens] = {}  # per worker, over the samples committed in this start
        self._held: dict[str, collections.deque[WorkItem]] = collections.defaultdict(collections.deque)
        self._active: dict[str, ConvProgress] = {}
        # conversations whose every outstanding item is answered and waits only for its commit: they hold no
        # slot and no queued work, so they do not count against _max_active (a.k.a. the look-ahead)
        self._parked: set[str] = set()
        self._low_water = MIN_LOOKAHEAD
        self._max_active = MIN_ACTIVE
        self._item_ready = asyncio.Event()
        # wired by the run's composer (engine.supervisor): the feed builds later turns, streams resumed shards
        # again and is woken when the queue runs low; telemetry hears which shard's figures moved
        self.build_turn: TurnBuilder = _no_turn_builder
        self.on_resume: Callable[[str], None] = lambda shard_id: None
        self.want_more: Callable[[], None] = lambda: None
        self.changed: Callable[[str], None] = lambda shard_id: None
        self.on_reject: Callable[[Reject], None] | None = None
        self.on_brake: Callable[[BrakeStatus, bool], None] = lambda status, engaged: None  # braked / released
        self.brake = RunBrake(cfg, str(store.run_dir))
        self.brake_note = ""  # what open() found of a recorded brake (the supervisor logs and alerts it)
        self.refusals = RefusalWatch()
        self._opened_at = 0.0
        self.on_refused: Callable[[RefusalTrip], None] = lambda trip: None  # the run fails with it (supervisor)

    def open(self) -> None:
        """The store's side of a start: planned totals recorded, earlier failures forgotten (generated again),
        the committed counts and the paused set loaded."""
        self._opened_at = time.time()
        self.store.ensure_shards({sid: c.conversations for sid, c in self._shards.items()},
                                 {sid: c.total for sid, c in self._shards.items()})
        try:
            forgotten = self.store.forget_failed()
        except OSError as exc:
            forgotten = 0
            log.error("%s: they stay failed in this run", exc)
        if forgotten:
            log.info("ledger: %d samples that failed in an earlier run are generated again", forgotten)
        for progress in self.store.progress():
            if progress.shard_id in self._shards:
                self._shards[progress.shard_id].load(progress)
        self._paused = set(self.store.paused()) & set(self._shards)
        record, after = self.store.brake()
        self.brake_note = self.brake.load(record, self.store.recent_shapes(self.brake.settings.window, after))
        if record is not None and self.brake.engaged is None:
            self._record_brake()  # lifted by a changed [brake]
        self._judge()

    # -- figures (read by the status, the watch, the feed) ------------------------------------------
    @property
    def shards(self) -> dict[str, ShardCounts]:
        """Per-shard counts, to read (only the ledger moves them)."""
        return self._shards

    @property
    def paused(self) -> frozenset[str]:
        return frozenset(self._paused)

    def is_paused(self, shard_id: str) -> bool:
        return shard_id in self._paused

    @property
    def total(self) -> int:
        return sum(c.total for c in self._shards.values())

    @property
    def done(self) -> int:
        return sum(c.done for c in self._shards.values())

    @property
    def to_generate(self) -> int:
        """Samples the run will hold: planned less those settled without a row (rejected, failed)."""
        return sum(c.to_generate for c in self._shards.values())

    @property
    def finished(self) -> bool:
        return all(c.complete for c in self._shards.values())

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
        return self.brake.engaged is not None or self.refusals.tripped is not None

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

    def unsettled(self, shard_id: str) -> int | None:
        """Samples of the shard not settled yet (None: not a shard of this run)."""
        counts = self._shards.get(shard_id)
        return None if counts is None else counts.total - counts.settled

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
        still need a server. A conversation whose answers only wait for their commit (up to [store] part_max_age_s)
        is not counted: counted, 5 s of finished answers filled the cap and the servers' freed slots found nothing
        to take until the commit (issue 25: occupancy 98% -> 57%)."""
        return len(self._ready) < self._low_water and len(self._active) - len(self._parked) < self._max_active

    def is_active(self, conversation_id: str) -> bool:
        return conversation_id in self._active

    def dispatch_began(self) -> None:
        self.rate.start()

    def served_for(self, worker: str) -> ServedTokens:
        """The worker's prompt and cached tokens over the samples committed in this start (its servers' caches
        start cold at each start), to read: only the ledger moves them."""
        served = self._served.get(worker)
        if served is None:
            served = self._served[worker] = ServedTokens()
        return served

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
                self.want_more()
            return item
        self._item_ready.clear()
        self.want_more()
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
                self.on_resume(sid)
                self.want_more()
            self.changed(sid)
        return changed

    # -- the data-quality brake ---------------------------------------------------------------------
    def _judge(self) -> None:
        status = self.brake.judge()
        if status is None:
            return
        self._record_brake()
        log.error("data-quality brake: dispatch paused run-wide: %s", status.text)
        self.on_brake(status, True)

    def _release_brake(self) -> None:
        was = self.brake.release()
        if was is None:
            return
        self._record_brake(window_from=self.store.last_sample_rowid())
        log.info("data-quality brake released (it braked on: %s); its window starts over", was.text)
        if self._ready:
            self._item_ready.set()
        self.want_more()
        self.on_brake(was, False)

    def _record_brake(self, window_from: int | None = None) -> None:
        try:
            self.store.set_brake(self.brake.record(), window_from)
        except OSError as exc:
            # a full disk: the brake holds in this run; a restart judges the store's last samples again
            log.error("%s; the brake holds in this run only", exc)

    def _shard_range(self) -> str:
        ids = sorted(self._shards)
        return f"{ids[0]} .. {ids[-1]}" if ids else "(none)"

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
                self._settle_turn(progress, entry.turn, "rejected", entry.reject)
                if self.turns == "all":
                    for later in list(progress.turns):
                        self._settle_turn(progress, later, "rejected", reject_for(
                            progress.conv, f"turn {later}: not generated: turn {entry.turn} rejected",
                            kind="earlier_turn_rejected"))
            else:
                progress.outstanding += 1
                items.append(entry)
        self._push(items, front=front, prefer=progress.worker)
        self._maybe_retire(progress)

    # -- settling ---------------------------------------------------------------------------------
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
                self.want_more()
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
            self._not_generated(outcome.item, "failed", outcome.reason, outcome.excerpt)
        elif isinstance(outcome, Rejected):
            self._not_generated(outcome.item, "rejected", outcome.reason, outcome.excerpt)
        else:
            raise TypeError(f"the ledger does not settle {type(outcome).__name__}")

    def _committed(self, outcome: Committed) -> None:
        part = outcome.part
        self._shards[part.shard_id].add_part(part)
        self.rate.add(part.output_tokens)
        self.refusals.ok(len(outcome.samples))
        self.brake.window.add(part.shapes)
        self._judge()
        self.changed(part.shard_id)
        for name, prompt_tokens, cached_tokens in outcome.served:
            served = self.served_for(name)
            served.prompt_tokens += prompt_tokens
            served.cached_tokens += cached_tokens
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
                self.admit(progress, [self.build_turn(progress, progress.turns[0])], front=True)
                self._park(progress)
                continue
            self._maybe_retire(progress)
            self._park(progress)

    def stop_after_cut(self, progress: ConvProgress, cut_turn: int, finish_reason: str = "") -> None:
        """turns_after_cut = "stop": turn `cut_turn` was committed cut, so the conversation's turns left are not
        generated; each is settled as rejected (kind after_cut), with the reason in rejects.jsonl."""
        how = "was stopped as a runaway" if finish_reason == "repetition" else (
            "ended at max_new_tokens" if finish_reason == "length" else "was cut (max_new_tokens or runaway)")
        for later in list(progress.turns):
            self._settle_turn(progress, later, "rejected", reject_for(
                progress.conv, f"turn {later}: not generated: turn {cut_turn} {how} (turns_after_cut = \"stop\")",
                kind=AFTER_CUT))
        self._maybe_retire(progress)
        self._park(progress)

    def _not_generated(self, item: WorkItem, kind: str, reason: str, excerpt: str) -> None:
        """A sample that will not be generated in this run: failed (retries spent) or rejected (HTTP 400)."""
        if self.refusals.tripped is not None:
            # a request in flight when the run was refused run-wide: not settled, so the next start generates it
            log.info("%s %s after the run-wide refusal: left unsettled (%s)", item.sample_id, kind, reason)
            return
        progress = self._active.get(item.conv.conversation_id)
        reject = reject_for(item.conv, f"turn {item.turn}: {reason}", excerpt=excerpt,
                            kind="generation_failed" if kind == "failed" else "sglang_rejected")
        trip = self.refusals.refused(item.sample_id, kind, reason)
        self.brake.window.add([REFUSED_SHAPE])
        if trip is None:
            self._judge()
        if progress is None:
            self._count(item.shard_id, kind, item.sample_id, reject)
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
        try:
            forgotten = self.store.forget_outcomes(reasons=SERVER_REFUSALS, since=self._opened_at)
        except OSError as exc:
            log.error("%s: the refused samples stay settled; a new run_dir generates them", exc)
        else:
            log.info("%d samples refused or failed in this start are unsettled: the next start generates them", forgotten)
            for progress in self.store.progress():
                if progress.shard_id in self._shards:
                    counts = self._shards[progress.shard_id]
                    counts.rejected, counts.failed = progress.rejected, progress.failed
                    self.changed(progress.shard_id)
        self.on_refused(trip)

    def _settle_turn(self, progress: ConvProgress, turn: int, kind: str, reject: Reject) -> None:
        if turn in progress.turns:
            progress.turns.remove(turn)
        self._count(progress.shard_id, kind, sample_id(progress.conv.conversation_id, turn), reject)

    def _count(self, shard_id: str, kind: str, sample: str, reject: Reject) -> None:
        # the reject's row first (fsync'd; the log drops a row it already holds), then the settle in state.sqlite: a
        # kill between the two leaves the sample unsettled, settled again at the restart, never settled without its
        # row (a SIGKILL there lost an after_cut row: tests/test_runaway_run.py, the kill test)
        self.rejects.add(reject)
        try:
            self.store.settle(shard_id, sample, kind, reject.kind)
        except OSError as exc:
            # a full disk: the run goes on with the outcome counted here (and in rejects.jsonl when it can be
            # written); only a status read from the run dir alone, or the next start, does not see it
            log.error("%s; it counts as %s in this run", exc, kind)
        counts = self._shards[shard_id]
        if kind == "rejected":
            counts.rejected += 1
            counts.after_cut += reject.kind == AFTER_CUT
        else:
            counts.failed += 1
        self.changed(shard_id)
        if self.on_reject is not None:
            self.on_reject(reject)

    def _maybe_retire(self, progress: ConvProgress) -> None:
        if progress.outstanding <= 0 and not progress.turns:
            self._active.pop(progress.conv.conversation_id, None)
            self._parked.discard(progress.conv.conversation_id)
            self.want_more()

