"""A pilot server's throughput at its full batch: the window it ran full (its own /metrics, else the client's
reconstruction) and the tokens made in it. A request's tokens are spread over the time it ran, not the time it
waited in the server's queue (its start is reconstructed first come first served into the slot the earliest frees).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Completed:
    """One pilot request as the client saw it (monotonic seconds)."""
    sent: float
    done: float
    completion_tokens: int
    finish: str
    output_ids: list[int]


@dataclass(frozen=True)
class Reading:
    """One /metrics reading of a pilot server."""
    t: float
    running: float
    queued: float


@dataclass(frozen=True)
class FullBatch:
    """The throughput a server made while it ran `batch` requests."""
    batch: int  # the batch the window is measured at: the one asked for, or the most the server ran if fewer
    window_s: float
    tokens: int
    tokens_per_s: float
    basis: str  # "metrics" (the server's num_running_reqs) | "client" (reconstructed from the completions)


@dataclass(frozen=True)
class _Ran:
    start: float
    done: float
    tokens: int


def running_spans(reqs: Sequence[Completed], batch: int) -> list[_Ran]:
    """When each request ran on a server of `batch` slots that admits first come first served."""
    slots: list[float] = []  # done times of the requests holding a slot
    ran = []
    for r in sorted(reqs, key=lambda r: r.sent):
        start = r.sent
        if len(slots) >= batch:
            start = max(start, heapq.heappop(slots))
        heapq.heappush(slots, r.done)
        ran.append(_Ran(min(start, r.done), r.done, r.completion_tokens))
    return ran


def most_running(ran: Sequence[_Ran]) -> int:
    events = sorted([(r.start, 1) for r in ran] + [(r.done, -1) for r in ran], key=lambda e: (e[0], e[1]))
    now = most = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


def reached_batch(readings: Sequence[Reading], logged: Sequence[int]) -> int:
    """The most requests the server ran at once: from its batch log lines when there are some (each prefill line
    says the running count and the requests joining it), else its /metrics readings. The gauge alone under-reads a
    full server: SGLang also sets it at each prefill, to the count *before* the new requests join, and with a queue
    a prefill follows nearly every finished request."""
    return int(max(logged)) if logged else int(max(g.running for g in readings))


def window_from_readings(readings: Sequence[Reading], batch: int) -> tuple[float, float] | None:
    """From the first to the last reading where the server held `batch` requests, running or queued to join."""
    full = [g.t for g in readings if g.running + g.queued >= batch]
    return (full[0], full[-1]) if len(full) >= 2 else None


def window_from_client(ran: Sequence[_Ran], batch: int) -> tuple[float, float] | None:
    events = sorted([(r.start, 1) for r in ran] + [(r.done, -1) for r in ran], key=lambda e: (e[0], e[1]))
    now, first, last = 0, None, None
    for t, d in events:
        was = now
        now += d
        if now >= batch and first is None:
            first = t
        if was >= batch > now:
            last = t
    return (first, last) if first is not None and last is not None and last > first else None


def tokens_in(ran: Sequence[_Ran], a: float, b: float) -> float:
    tokens = 0.0
    for r in ran:
        life = r.done - r.start
        if life > 0:
            tokens += r.tokens * max(0.0, min(b, r.done) - max(a, r.start)) / life
    return tokens


def full_batch(reqs: Sequence[Completed], readings: Sequence[Reading], batch: int,
               logged: Sequence[int] = ()) -> FullBatch:
    """Tokens/s over the window where the server ran `batch` requests (or the most it ran, when fewer). `logged`:
    the running counts of its decode log lines."""
    if not reqs:
        return FullBatch(0, 0.0, 0, 0.0, "metrics" if readings else "client")
    if readings:
        # the server's own count also holds requests that are not the pilot's: SGLang's /health runs a 1-token
        # generation (contract 7.4), so with fewer prompts than the batch it may read one more than were sent
        reached = min(batch, reached_batch(readings, logged), len(reqs))
        ran = running_spans(reqs, max(1, reached))
        window, basis = window_from_readings(readings, max(1, reached)), "metrics"
        if window is None:  # held too briefly for two readings (no queue kept it there): the client's window
            window, basis = window_from_client(ran, max(1, reached)), "client"
    else:
        reached = min(batch, most_running(running_spans(reqs, batch)))
        ran = running_spans(reqs, max(1, reached))
        window, basis = window_from_client(ran, max(1, reached)), "client"
    if window is None:
        return FullBatch(reached, 0.0, 0, 0.0, basis)
    a, b = window
    tokens = tokens_in(ran, a, b)
    return FullBatch(reached, b - a, int(round(tokens)), tokens / (b - a), basis)
