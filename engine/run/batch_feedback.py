"""A dispatch target's batch size corrected by its server's own gauges (running, queue, token usage), whatever was reported.

The in-flight cap is the size plus a small margin; the size grows (at most MAX_GROWTH a reading, as far as the pool's
free share says) while the server's queue stays under the margin and its pool has room, drops to `running` when the
queue passes twice the margin, and starts from the smaller of the reported batch and what the KV pool holds.
"""
from __future__ import annotations

from engine.servers.capacity import BatchSize, BatchSource

MAX_GROWTH = 1.5  # per reading
POOL_FULL = 0.9  # token_usage a server is grown to, and above which it is not grown (SGLang retracts when full)


def margin_for(size: int) -> int:
    """Requests kept queued on a server beyond its batch: a quarter of it, at least 2. SGLang's admission grows its
    batch between two readings of its gauges (its new-token estimate decays step by step): with an eighth, its queue
    ran dry a third of the time while the batch grew (tests/bench/bench_spread.py, 86% full-batch share vs 97%)."""
    return max(2, size // 4)


def corrected(current: BatchSize, *, margin: int, in_flight: int, running: float | None,
              queued: float | None, token_usage: float | None = None, ceiling: int | None = None,
              work_waiting: bool = False) -> BatchSize:
    """The batch size after one metrics reading (unchanged while the server's gauges are unknown). `work_waiting`:
    regen's own queue holds work, so the cap is what limits this server even when a reading falls between an answer
    and its slot's refill (in flight one or two under the cap)."""
    if running is None or queued is None:
        return current
    if queued > 2 * margin and running >= 1:
        size = int(running)
        return current if size == current.size else BatchSize(size, BatchSource.FEEDBACK)
    capped = in_flight >= current.size + (margin // 2 if work_waiting else margin)
    if queued < margin and running >= current.size and capped:
        if token_usage is not None and token_usage >= POOL_FULL:
            return current
        growth = MAX_GROWTH if not token_usage else min(MAX_GROWTH, POOL_FULL / token_usage)
        size = int(max(running, current.size) * growth)
        if ceiling:
            size = min(size, ceiling)
        return current if size <= current.size else BatchSize(size, BatchSource.FEEDBACK)
    return current
