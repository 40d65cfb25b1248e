"""A dispatch target's batch size corrected by its server's own queue, whatever size was reported.

The in-flight cap is the batch size plus a small margin, so a freed slot is refilled from the server's
own queue at once. Read every metrics tick from `sglang:num_running_reqs` / `sglang:num_queue_reqs`:

* the queue is empty, the cap is full (work is waiting here) and the server runs more than the size we
  believe: it can take more, so the size doubles (a few ticks reach thousands from the 64 default);
* the queue grew past twice the margin: the server runs no more than `running`, so that is its size
  (an overshoot from doubling, a reported size that is too big, or a KV pool that is full);
* otherwise the size holds: a queue of about the margin is the steady state.

There is no ceiling: a server whose size is unknown or wrong is still kept full with a short queue.
"""
from __future__ import annotations

from engine.capacity import BatchSize, BatchSource

GROWTH = 2


def margin_for(size: int) -> int:
    """Requests kept queued on a server beyond its batch: an eighth of it, at least 2."""
    return max(2, size // 8)


def corrected(current: BatchSize, *, margin: int, in_flight: int, running: float | None,
              queued: float | None) -> BatchSize:
    """The batch size after one metrics reading (unchanged while the server's gauges are unknown)."""
    if running is None or queued is None:
        return current
    if queued > 2 * margin and running >= 1:
        size = int(running)
        return current if size == current.size else BatchSize(size, BatchSource.FEEDBACK)
    if queued < 1 and running > current.size and in_flight >= current.size + margin:
        return BatchSize(int(max(running, current.size)) * GROWTH, BatchSource.FEEDBACK)
    return current
