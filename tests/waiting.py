"""Waiting in tests: on a polled condition with a deadline, never on a bare sleep.

A test that sleeps "long enough" for something to happen races on a loaded machine (too short) or
wastes time on an idle one (too long). Instead it names what it waits for and how long it is willing
to wait:

    st = wait_until(lambda: status(run_dir).get("state") == "done", 60, "the run to finish")
    await await_until(lambda: sim.server.scheduler.num_running, 10, "a request running")

The predicate is polled every `interval` seconds until it returns a truthy value, which is returned.
At the deadline an AssertionError names what was awaited, the timeout and the last value observed
(or `describe()`'s text, when given). `stop` lets a wait give up early with a reason (e.g. the
process it waits on has exited). `poll_until` is the soft form: it returns the last value instead of
raising, for callers that report the outcome themselves.

These are the only sleeps a test needs in order to wait; the sleeps left elsewhere in tests/ are part of
what is simulated (a slow store, a stuck runner, a random kill moment) and say so where they are.
"""
from __future__ import annotations

import asyncio
import inspect
import os
import time
from typing import Any, Awaitable, Callable

POLL_S = 0.05


def _message(what: str, timeout: float, last: Any, describe: Callable[[], str] | None, reason: str | None) -> str:
    head = f"gave up waiting for {what}: {reason}" if reason else f"timed out after {timeout:g} s waiting for {what}"
    try:
        seen = describe() if describe is not None else f"last observed: {last!r}"
    except Exception as exc:  # noqa: BLE001 - the description must not hide the timeout
        seen = f"(describe() failed: {exc!r}; last observed: {last!r})"
    return f"{head}; {seen}"


def poll_until(predicate: Callable[[], Any], timeout: float, *, interval: float = POLL_S,
               stop: Callable[[], Any] | None = None) -> Any:
    """Poll `predicate` until truthy (returned), `stop()` is truthy, or the deadline; returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline or (stop is not None and stop()):
            return value
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, *, interval: float = POLL_S,
               stop: Callable[[], str | None] | None = None, describe: Callable[[], str] | None = None) -> Any:
    """Poll `predicate` until it returns a truthy value (returned); AssertionError at the deadline.

    `stop()` returning a reason (a non-empty string) ends the wait at once with that reason."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        reason = stop() if stop is not None else None
        if reason:
            raise AssertionError(_message(what, timeout, value, describe, str(reason)))
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(_message(what, timeout, value, describe, None))
        time.sleep(min(interval, left))


async def await_until(predicate: Callable[[], Any | Awaitable[Any]], timeout: float, what: str, *,
                      interval: float = POLL_S, stop: Callable[[], str | None] | None = None,
                      describe: Callable[[], str] | None = None) -> Any:
    """The asyncio form of `wait_until`: the loop runs between polls; the predicate may be a coroutine function."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        reason = stop() if stop is not None else None
        if reason:
            raise AssertionError(_message(what, timeout, value, describe, str(reason)))
        left = deadline - loop.time()
        if left <= 0:
            raise AssertionError(_message(what, timeout, value, describe, None))
        await asyncio.sleep(min(interval, left))


async def apoll_until(predicate: Callable[[], Any], timeout: float, *, interval: float = POLL_S) -> Any:
    """The asyncio form of `poll_until` (no stop): returns the truthy value, or the last one at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if value or loop.time() >= deadline:
            return value
        await asyncio.sleep(min(interval, max(0.0, deadline - loop.time())))


def loaded_bound(seconds: float) -> float:
    """A latency the product promises on an idle box (e.g. "dead in the header within 2 s"), as a test's bound on this
    machine now: stretched by how many runnable tasks share each core (the 1-minute load average), never shortened.
    The promise is what the product aims at; a loaded runner (xdist workers, other jobs) delays every process alike."""
    per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    return seconds * max(1.0, per_core)
