"""What passes between the parts of a run: a work item, the row of a generated sample, and an outcome.

    feed ──WorkItem──▶ ledger (ready queue) ──▶ dispatch ──Outcome──▶ ledger ──Generated──▶ committer

A dispatched item comes back as exactly one outcome; only `Committed`, `Failed` and `Rejected` settle a sample.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, Union

from engine.text.ingest import Conversation
from engine.store.part_table import STANDARD_MASK
from engine.store.state_db import PartInfo


@dataclass
class WorkItem:
    """One sample to generate: a rendered prompt. `attempt` moves with each retry, `served_by` names the worker
    whose answer came back (both the dispatcher's)."""
    sample_id: str
    conv: Conversation
    turn: int
    shard_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    is_last_turn: bool
    prompt_opened: bool = False  # the prompt ends inside an opened think block (Renderer.opens_think)
    attempt: int = 0
    last_error: str = ""
    served_by: str = ""

    @property
    def rid(self) -> str:
        """The request id sent to SGLang: a retry gets its own (a server refuses a rid it still runs)."""
        return self.sample_id if self.attempt == 0 else f"{self.sample_id}@{self.attempt}"


@dataclass(slots=True)
class SampleRow:
    """A generated sample as one row of its shard: the prompt ids and the answer ids, exact as the server gave them.

    The loss mask is never materialized here: it is `[0] * prompt_len + [1] * output_len` by definition, and
    `store_row` hands the store its marker for that mask (the store builds the column from the lengths)."""
    sample_id: str
    conversation_id: str
    turn: int
    source: str
    origin: str
    prompt_ids: list[int]
    output_ids: array[int]  # int32
    reasoning_tokens: int
    prompt_opened: bool
    finish_reason: str
    completion_tokens: int
    cached_tokens: int
    latency_s: float
    worker: str
    text: str

    @property
    def output_len(self) -> int:
        return len(self.output_ids)

    def store_row(self) -> dict[str, Any]:
        """The row in engine.store.shard_store's format (its schema: engine.store.shard_schema); Any: each column's
        own type."""
        return {
            "sample_id": self.sample_id,
            "conversation_id": self.conversation_id,
            "turn": self.turn,
            "source": self.source,
            "origin": self.origin,
            "input_ids": array("i", self.prompt_ids) + self.output_ids,  # int32 buffers: the store copies them
            "loss_mask": STANDARD_MASK,
            "prompt_len": len(self.prompt_ids),
            "output_len": len(self.output_ids),
            "reasoning_tokens": self.reasoning_tokens,
            "prompt_opened": self.prompt_opened,
            "finish_reason": self.finish_reason,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "latency_s": self.latency_s,
            "worker": self.worker,
            "text": self.text,
        }


@dataclass(frozen=True, slots=True)
class Generated:
    """An answer (HTTP 200): the committer commits its row; `answer` is the history text a later turn
    is built on (turns = "all"; None when no turn chains on it)."""
    item: WorkItem
    row: SampleRow
    answer: str | None = None


@dataclass(frozen=True, slots=True)
class Retry:
    """An attempt that failed and goes back to the queue after `delay_s` (0: at once, at the front)."""
    item: WorkItem
    delay_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Failed:
    """Retries spent: settled without a row in this run (the next start generates it again)."""
    item: WorkItem
    reason: str
    excerpt: str = ""


@dataclass(frozen=True, slots=True)
class Rejected:
    """The server refused the input itself (HTTP 400): settled without a row, for good."""
    item: WorkItem
    reason: str
    excerpt: str = ""


@dataclass(frozen=True, slots=True)
class Committed:
    """A part is committed (ShardStore.commit returned): its sums and each of its samples settle at once."""
    part: PartInfo
    samples: tuple[tuple[WorkItem, str | None], ...]  # each item with its history answer
    # per worker (the rows' `worker`): its name, the part's prompt tokens it was sent and how many it had cached
    served: tuple[tuple[str, int, int], ...] = ()
    # the part's samples that were cut (engine.store.names.CUT_FINISHES), with their finish reason: turns_after_cut
    cut: dict[str, str] = field(default_factory=dict)


Outcome = Union[Generated, Retry, Failed, Rejected, Committed]
