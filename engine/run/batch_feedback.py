"""A dispatch target's batch size corrected by its server's own gauges, whatever size was reported.

The in-flight cap is the batch size plus a small margin, so a freed slot is refilled from the server's
own queue at once. Read every metrics tick from `sglang:num_running_reqs` / `sglang:num_queue_reqs` /
`sglang:token_usage`:

* the queue is under the margin (SGLang's admission grows its batch between two readings: at half the margin its
  queue ran dry before the next one), the cap is full (work is waiting here; or nearly, while regen's own queue
  holds work: a reading can fall between an answer and its slot's refill), the server runs at least the size we
  believe and its KV pool has room: it can take more, so the size grows as far as the pool's free share says
  (running x POOL_FULL / token_usage, at most MAX_GROWTH a reading: SGLang's own admission grows its batch step by
  step, and a doubling piles the difference in its queue; never past a size the server reported);
* the queue grew past twice the margin: the server runs no more than `running`, so that is its size
  (an overshoot from growing, a reported size that is too big, or a KV pool that is full);
* otherwise the size holds: a queue of about the margin is the steady state.

The size starts from the smaller of the reported batch and what the KV pool holds (engine.servers.capacity.kv_fit),
never from the reported batch alone: SGLang's default is derived from the pool for its shortest requests,
and a client that sends that many piles them in the server's own queue, where no other server can take them.
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
