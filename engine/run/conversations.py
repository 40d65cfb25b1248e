"""A conversation in progress (made by the feed, owned by the ledger once admitted), a turn that cannot be made
into a work item, and the reject that locates a sample at its input row."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.text.ingest import Conversation
from engine.text.row_errors import Reject


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
