"""The ledger's figures: per-shard counts of settled samples and the committed output, and the commit rate.

Committed state (state.sqlite) is the truth: counts are loaded from the store at a start and moved only when a part is
committed or a sample settled without a row, so every figure is the same after a restart as before it. A planned
sample ends committed, rejected (never generated; stays settled) or failed (generated again at the next start).
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from engine.store.shard_store import ShardProgress

from engine.store.state_db import PartInfo

RATE_WINDOW_S = 60.0
# a rate exists from the first commits: the span runs from this start's dispatch (never less), so an early rate is
# every token committed since then over all that time, warm-up included: low at worst, never a spike; a rate needs
# two commits (one commit of many rows over a short span says more of the part size than of the pace) and 2 s
RATE_MIN_SPAN_S = 2.0
RATE_MIN_COMMITS = 2


@dataclass
class ShardCounts:
    total: int = 0  # samples planned (generated turns of the shard's good conversations)
    conversations: int = 0
    done: int = 0  # committed
    failed: int = 0
    rejected: int = 0
    output_tokens: int = 0  # over the committed samples
    empty: int = 0
    truncated: int = 0
    repetition: int = 0  # stopped by the runaway guard (finish_reason "repetition")
    after_cut: int = 0  # of the rejected: not generated because an earlier turn was cut (turns_after_cut = "stop")
    unclosed_reasoning: int = 0  # committed answers whose reasoning was opened and never closed (not a runaway)
    first_index: int = 0
    end_index: int = 0  # one past the last conversation index

    @property
    def settled(self) -> int:
        return self.done + self.failed + self.rejected

    @property
    def complete(self) -> bool:
        return self.settled >= self.total

    @property
    def final(self) -> bool:
        """Every planned sample committed or rejected, none failed: no part can join the shard any more (a failed
        sample is generated again at the next start), so it can be compacted into one file."""
        return self.failed == 0 and self.done + self.rejected >= self.total

    @property
    def to_generate(self) -> int:
        """The samples this shard will hold: planned less those settled without a row."""
        return max(0, self.total - self.failed - self.rejected)

    def add_part(self, part: PartInfo) -> None:
        self.done += part.rows
        self.output_tokens += part.output_tokens
        self.empty += part.empty
        self.truncated += part.truncated
        self.repetition += part.repetition
        self.unclosed_reasoning += sum(1 for s in part.shapes if s.reasoning_unclosed)

    def load(self, p: ShardProgress) -> None:
        self.done, self.output_tokens, self.empty, self.truncated = p.done_samples, p.output_tokens, p.empty, p.truncated
        self.repetition = p.repetition
        self.rejected, self.failed = p.rejected, p.failed
        self.after_cut = p.after_cut
        self.unclosed_reasoning = p.unclosed_reasoning


@dataclass
class ServedTokens:
    """One worker's committed samples (this start): their prompt tokens, and how many its prefix cache served
    (`meta_info.cached_tokens`, the rows' cached_tokens)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0


def counts_from_store(progress: list[ShardProgress]) -> dict[str, ShardCounts]:
    """The ledger's counts of a run whose supervisor is gone, from the store alone (engine.ctl last-status)."""
    out = {}
    for p in progress:
        c = out[p.shard_id] = ShardCounts(total=p.total_samples if p.total_samples is not None else p.done_samples,
                                          conversations=p.total_conversations)
        c.load(p)
    return out


@dataclass
class CommitRate:
    """Output tokens committed per second over the last RATE_WINDOW_S, never before `since` (this start's
    dispatch): None until it is measurable (RATE_MIN_COMMITS commits and RATE_MIN_SPAN_S of window)."""
    since: float | None = None  # time.monotonic() when dispatch began; None: not yet
    commits: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)

    def start(self, now: float | None = None) -> None:
        if self.since is None:
            self.since = time.monotonic() if now is None else now

    def add(self, tokens: int, now: float | None = None) -> None:
        self.commits.append((time.monotonic() if now is None else now, tokens))

    def tokens_per_s(self, now: float | None = None) -> float | None:
        if self.since is None:
            return None
        now = time.monotonic() if now is None else now
        start = max(self.since, now - RATE_WINDOW_S)
        while self.commits and self.commits[0][0] < start:
            self.commits.popleft()
        span = now - start
        if span < RATE_MIN_SPAN_S or len(self.commits) < RATE_MIN_COMMITS:
            return None
        return sum(n for _, n in self.commits) / span


def eta_s(left: int, done: int, output_tokens: int, tokens_per_s: float | None) -> float | None:
    """Seconds until `left` more samples are committed: left x committed tokens per sample / committed tok/s."""
    if left <= 0:
        return 0.0
    if tokens_per_s is None or tokens_per_s <= 0 or done <= 0 or output_tokens <= 0:
        return None
    return left * (output_tokens / done) / tokens_per_s
