"""The ledger's per-shard counts, paused set and per-worker served tokens, and their moves in the store: loaded at a
start, a sample settled without a row (its rejects.jsonl row first), refusals unsettled. Committed state is the truth
(engine.run.counts)."""
from __future__ import annotations

import logging
import time

from engine.run.counts import ServedTokens, ShardCounts
from engine.run.ledger_ports import LedgerEvents
from engine.store.rejects import RejectLog
from engine.store.shard_store import ShardStore
from engine.store.names import AFTER_CUT, SettleKind
from engine.text.row_errors import Reject

log = logging.getLogger("regen.ledger")


class ShardTally:
    def __init__(self, shards: dict[str, ShardCounts], store: ShardStore, rejects: RejectLog, events: LedgerEvents):
        self._shards = shards
        self._paused: set[str] = set()
        self.store = store
        self.rejects = rejects
        self.events = events  # hears which shard's figures moved
        self._opened_at = 0.0
        self._served: dict[str, ServedTokens] = {}  # per worker, over the samples committed in this start

    def load(self) -> None:
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

    def unsettled(self, shard_id: str) -> int | None:
        """Samples of the shard not settled yet (None: not a shard of this run)."""
        counts = self._shards.get(shard_id)
        return None if counts is None else counts.total - counts.settled

    def served_for(self, worker: str) -> ServedTokens:
        """The worker's prompt and cached tokens over the samples committed in this start (its servers' caches
        start cold at each start), to read: only the ledger moves them."""
        served = self._served.get(worker)
        if served is None:
            served = self._served[worker] = ServedTokens()
        return served

    def add_served(self, served: tuple[tuple[str, int, int], ...]) -> None:
        """A committed part's (worker, prompt tokens, cached tokens) sums."""
        for name, prompt_tokens, cached_tokens in served:
            book = self.served_for(name)
            book.prompt_tokens += prompt_tokens
            book.cached_tokens += cached_tokens

    def _shard_range(self) -> str:
        ids = sorted(self._shards)
        return f"{ids[0]} .. {ids[-1]}" if ids else "(none)"

    def count(self, shard_id: str, kind: SettleKind, sample: str, reject: Reject) -> None:
        """A sample settled without a row: rejected or failed."""
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
        if kind == SettleKind.REJECTED:
            counts.rejected += 1
            counts.after_cut += reject.kind == AFTER_CUT
        else:
            counts.failed += 1
        self.events.shard_changed(shard_id)

    def unsettle(self, reasons: tuple[str, ...]) -> None:
        """The samples settled in this start with one of these reject kinds are unsettled (the next start generates
        them); the counts move back with the store."""
        try:
            forgotten = self.store.forget_outcomes(reasons=reasons, since=self._opened_at)
        except OSError as exc:
            log.error("%s: the refused samples stay settled; a new run_dir generates them", exc)
            return
        log.info("%d samples refused or failed in this start are unsettled: the next start generates them", forgotten)
        for progress in self.store.progress():
            if progress.shard_id in self._shards:
                counts = self._shards[progress.shard_id]
                counts.rejected, counts.failed = progress.rejected, progress.failed
                self.events.shard_changed(progress.shard_id)
