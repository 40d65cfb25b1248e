"""The ready queue (the ledger's): work items in dispatch order, with a lane per worker for prefix affinity.

With dispatch.affinity a later turn is held for the worker that served the turn before (up to affinity_hold_s) and
a long prompt prefers the worker its first PREFIX_TOKENS hash to (rendezvous hashing); a worker with nothing of its
own takes from the longest lane. With affinity off it is the plain FIFO (retries and later turns first).
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import time
from array import array
from dataclasses import dataclass, field
from typing import Callable, TypeAlias

from engine.run.items import WorkItem

PREFIX_TOKENS = 256  # the prefix that groups prompts (a system prompt, a document's start); shorter: no lane
_MASK = (1 << 64) - 1
Soft: TypeAlias = "collections.deque[tuple[int, WorkItem]]"  # (seq, item), seqs rising
Held: TypeAlias = "collections.deque[tuple[float, int, WorkItem]]"  # (deadline, seq, item), deadlines rising


def _mix(x: int) -> int:
    """splitmix64's finalizer: a well-spread 64-bit score for rendezvous hashing."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prefix_key(prompt_ids: list[int]) -> int | None:
    """The grouping key of a prompt: a hash of its first PREFIX_TOKENS ids (None: too short to be worth it)."""
    if len(prompt_ids) <= PREFIX_TOKENS:
        return None
    return _digest(array("i", prompt_ids[:PREFIX_TOKENS]).tobytes())


@dataclass
class _Lane:
    held: Held = field(default_factory=collections.deque)  # (deadline, seq, item), deadlines rising
    soft: Soft = field(default_factory=collections.deque)  # (seq, item)

    def __len__(self) -> int:
        return len(self.held) + len(self.soft)


class ReadyQueue:
    def __init__(self, affinity: bool, hold_s: float, clock: Callable[[], float] = time.monotonic):
        self.affinity = affinity
        self.hold_s = hold_s
        self._clock = clock
        self._general: Soft = collections.deque()
        self._lanes: dict[str, _Lane] = {}
        self._ready: dict[str, int] = {}  # ready worker -> its rendezvous salt
        self._back = itertools.count()  # sequence numbers: pushed to the back count up,
        self._front = itertools.count(-1, -1)  # to the front down (so "older" is the smaller number)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def held_for(self, worker: str) -> int:
        """Items in `worker`'s lane (held for its cache, or preferred for it by their prefix)."""
        lane = self._lanes.get(worker)
        return len(lane) if lane is not None else 0

    # -- workers -------------------------------------------------------------------------------
    def worker_ready(self, name: str, ready: bool) -> None:
        if ready:
            if name not in self._ready:
                self._ready[name] = _digest(name.encode())
                self._join(name)
            return
        if self._ready.pop(name, None) is None:
            return
        lane = self._lanes.pop(name, None)
        if lane is None:
            return
        # its cache is gone with it: every item placed again as if new, merged into its new queue by age
        self._replace([(seq, item) for _, seq, item in lane.held] + list(lane.soft))

    def _join(self, name: str) -> None:
        """A worker that joins takes its share of the keys now, not only of prompts queued from now on: queued
        at a start when one server was ready before the others, every long prompt sat in the first one's lane,
        and a fast first server could drain it before the late one ever pulled (seen on a loaded machine)."""
        if not self.affinity:
            return
        moving: list[tuple[int, WorkItem]] = []
        for other, lane in self._lanes.items():
            if other == name or not lane.soft:
                continue
            keep: Soft = collections.deque()
            for entry in lane.soft:
                (moving if self.owner(entry[1].prompt_ids) == name else keep).append(entry)
            lane.soft = keep
        self._replace(moving)

    def _replace(self, entries: list[tuple[int, WorkItem]]) -> None:
        """Place (seq, item) entries again by their prefix, each merged into its new queue by age."""
        moved: dict[int, tuple[Soft, list[tuple[int, WorkItem]]]] = {}
        for seq, item in entries:
            queue = self._soft_queue(item)
            moved.setdefault(id(queue), (queue, []))[1].append((seq, item))
        for queue, batch in moved.values():
            merged = sorted([*queue, *batch], key=lambda e: e[0])
            queue.clear()
            queue.extend(merged)

    # -- in ----------------------------------------------------------------------------------
    def push(self, items: list[WorkItem], front: bool = False, prefer: str | None = None) -> None:
        """Queue items at the back (or the front: retries, resumed and later turns). `prefer`: the worker that
        served the turn before (its cache holds this prompt's prefix)."""
        if front:  # placed last first, each before the one placed before it: the first item ends up first
            for item in reversed(items):
                self._place(item, next(self._front), prefer)
        else:
            for item in items:
                self._place(item, next(self._back), prefer)

    def _place(self, item: WorkItem, seq: int, prefer: str | None) -> None:
        self._len += 1
        if self.affinity and prefer is not None and prefer in self._ready:
            self._lane(prefer).held.append((self._clock() + self.hold_s, seq, item))
            return
        self._add(self._soft_queue(item), seq, item)

    def _soft_queue(self, item: WorkItem) -> Soft:
        """Where an item no worker holds the cache for goes: the lane its prefix hashes to, or the unassigned."""
        owner = self.owner(item.prompt_ids) if self.affinity else None
        return self._lane(owner).soft if owner is not None else self._general

    def owner(self, prompt_ids: list[int]) -> str | None:
        """The ready worker a prompt's prefix hashes to (rendezvous: the highest score of key and worker), or
        None (no worker ready, or too short a prompt)."""
        key = prefix_key(prompt_ids) if self._ready else None
        if key is None:
            return None
        return max(self._ready, key=lambda w: _mix(key ^ self._ready[w]))

    @staticmethod
    def _add(queue: Soft, seq: int, item: WorkItem) -> None:
        if seq < 0:
            queue.appendleft((seq, item))
        else:
            queue.append((seq, item))

    def _lane(self, name: str) -> _Lane:
        lane = self._lanes.get(name)
        if lane is None:
            lane = self._lanes[name] = _Lane()
        return lane

    # -- out ---------------------------------------------------------------------------------
    def pop_for(self, worker: str | None = None) -> WorkItem | None:
        """The next item for `worker` (None: no preference of its own is looked at), or None."""
        lane = self._lanes.get(worker) if worker is not None else None
        if lane is not None and lane.held:
            return self._take(lane.held.popleft()[2])
        general = self._general
        if lane is not None and lane.soft and (not general or lane.soft[0][0] < general[0][0]):
            return self._take(lane.soft.popleft()[1])
        if general:
            return self._take(general.popleft()[1])
        if not self._lanes:
            return None
        now = self._clock()
        expired = [(ln.held[0][0], name) for name, ln in self._lanes.items() if name != worker and ln.held
                   and ln.held[0][0] <= now]
        if expired:
            return self._take(self._lanes[min(expired)[1]].held.popleft()[2])
        longest = max((ln for name, ln in self._lanes.items() if name != worker and ln.soft),
                      key=lambda ln: len(ln.soft), default=None)
        if longest is not None:
            return self._take(longest.soft.popleft()[1])
        return None

    def _take(self, item: WorkItem) -> WorkItem:
        self._len -= 1
        return item
