"""A dispatch target's batch size corrected by its server's own gauges, whatever size was reported.

The in-flight cap is the batch size plus a small margin, so a freed slot is refilled from the server's
own queue at once. Read every metrics tick from `sglang:num_running_reqs` / `sglang:num_queue_reqs` /
`sglang:token_usage`:

* the queue is empty, the cap is full (work is waiting here), the server runs more than the size we
  believe and its KV pool has room: it can take more, so the size grows (doubles while the pool is under
  half full, a quarter more above; never past a size the server itself reported: it runs no more);
* the queue grew past twice the margin: the server runs no more than `running`, so that is its size
  (an overshoot from growing, a reported size that is too big, or a KV pool that is full);
* otherwise the size holds: a queue of about the margin is the steady state.

The size starts from the smaller of the reported batch and what the KV pool holds (engine.capacity.kv_fit),
never from the reported batch alone: SGLang's default is derived from the pool for its shortest requests,
and a client that sends that many piles them in the server's own queue, where no other server can take them.
"""
from __future__ import annotations

from engine.capacity import BatchSize, BatchSource

FAST_GROWTH = 2.0  # the pool under half full
SLOW_GROWTH = 1.25  # above: a doubling would overshoot into the server's queue
HALF_FULL = 0.5
POOL_FULL = 0.9  # token_usage above which a server is not grown (SGLang retracts when its pool runs out)


def margin_for(size: int) -> int:
    """Requests kept queued on a server beyond its batch: an eighth of it, at least 2."""
    return max(2, size // 8)


def corrected(current: BatchSize, *, margin: int, in_flight: int, running: float | None,
              queued: float | None, token_usage: float | None = None, ceiling: int | None = None) -> BatchSize:
    """The batch size after one metrics reading (unchanged while the server's gauges are unknown)."""
    if running is None or queued is None:
        return current
    if queued > 2 * margin and running >= 1:
        size = int(running)
        return current if size == current.size else BatchSize(size, BatchSource.FEEDBACK)
    if queued < 1 and running > current.size and in_flight >= current.size + margin:
        if token_usage is not None and token_usage >= POOL_FULL:
            return current
        growth = FAST_GROWTH if token_usage is None or token_usage < HALF_FULL else SLOW_GROWTH
        size = int(max(running, current.size) * growth)
        if ceiling:
            size = min(size, ceiling)
        return current if size <= current.size else BatchSize(size, BatchSource.FEEDBACK)
    return current
