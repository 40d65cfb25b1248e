"""What the ledger tells the parts beside it, declared once and given to it at construction: the feed (FeedHooks),
the run's observers (LedgerEvents) and where a generated answer goes to be written (AnswerSink: the committer)."""
from __future__ import annotations

from typing import Protocol

from engine.api.brake import BrakeStatus
from engine.run.conversations import ConvProgress, Unfit
from engine.run.items import Generated, WorkItem
from engine.run.refusals import RefusalTrip


class FeedHooks(Protocol):
    """The feed, as the ledger asks it (engine.run.feed.Feed implements it)."""

    def build_turn(self, progress: ConvProgress, turn: int) -> WorkItem | Unfit:
        """A later turn of a conversation (turns = "all"), built from its committed history."""

    def rescan(self, shard_id: str) -> None:
        """A resumed shard: stream again the conversations passed while it was paused."""

    def wake(self) -> None:
        """The ready queue runs low: admit more."""


class LedgerEvents(Protocol):
    """The run's observers (the supervisor's run wing): which figures moved, and what holds dispatch run-wide."""

    def shard_changed(self, shard_id: str) -> None: ...

    def brake_changed(self, status: BrakeStatus, engaged: bool) -> None: ...

    def refused(self, trip: RefusalTrip) -> None:
        """The servers refuse the run's requests run-wide: the run fails with it."""


class AnswerSink(Protocol):
    """Where the ledger hands a generated answer to be written (engine.run.committer.Committer)."""

    def add(self, generated: Generated) -> None: ...
