"""Which shards the Shards tab lists and in what order: filter, sort, counts by kind, selection (no Textual)."""
from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

from console.view.model_parts import ShardView
from engine.api.wire import AlertLevels

FILTERS = ("all", "running", "paused", "pending", "done", "problems")
SORTS = ("id", "progress", "empty", "truncated")
SORT_TEXT = {"id": "id", "progress": "progress (least first)", "empty": "empty share (most first)",
             "truncated": "truncated share (most first)"}
PROBLEM_MIN_SAMPLES = 10  # shares of a handful of samples say little; a shard smaller than this counts when complete

SortKey = tuple


def has_problem(s: ShardView, levels: AlertLevels) -> bool:
    """Empty or truncated share over the run's alert levels (the engine's [alerts], sent with the status; after some
    samples), or an answer the runaway guard stopped."""
    if s.repetition > 0:
        return True
    if s.done < min(PROBLEM_MIN_SAMPLES, max(1, s.total)):
        return False
    return s.empty / s.done > levels.empty_share or s.truncated / s.done > levels.truncated_share


def _share_key(share: float | None, sid: str) -> SortKey:
    return (share is None, -(share or 0.0), sid)  # most first, shards without samples last


def sort_key(s: ShardView, sort: str) -> SortKey:
    if sort == "progress":
        return (s.fraction, s.id)
    if sort == "empty":
        return _share_key(s.empty_share, s.id)
    if sort == "truncated":
        return _share_key(s.truncated_share, s.id)
    return (s.id,)


@dataclass(frozen=True)
class ShardSummary:
    total: int
    done: int
    running: int
    pending: int
    paused: int
    other: int  # draining, stopped: a run winding down
    problems: int
    listed: int
    selected: int


class ShardList:
    """The shards in view order, kept up to date per changed shard: update() costs O(log n) a shard (plus a list
    insert), never a pass over every shard; changing the filter or the sort rebuilds the order once."""

    def __init__(self, filter: str = "all", sort: str = "id"):
        self.filter = filter
        self.sort = sort
        self.selected: set[str] = set()
        self.version = 0  # bumped whenever the listed ids or their order change
        self._shards: dict[str, ShardView] = {}
        self._kind: dict[str, tuple[str, bool]] = {}  # (state, has a problem) as counted
        self._counts: Counter[str] = Counter()
        self._problems = 0
        self._keys: dict[str, SortKey] = {}  # the listed shards' keys, as placed in _order
        self._order: list[SortKey] = []
        self.levels = AlertLevels()  # the engine's, from the status (set_levels)

    def set_levels(self, levels: AlertLevels) -> bool:
        """The run's alert levels (a status reply): every shard judged again; True when anything changed."""
        if levels == self.levels:
            return False
        self.levels = levels
        shards, self._shards, self._kind, self._counts, self._problems = list(self._shards.values()), {}, {}, Counter(), 0
        self._keys, self._order = {}, []
        self.update(shards)
        self.version += 1
        return True

    # -- folding ----------------------------------------------------------------------------
    def update(self, shards: Iterable[ShardView]) -> bool:
        """Take new figures of these shards; True when the listed order or membership changed."""
        before = self.version
        for s in shards:
            self._upsert(s)
        return self.version != before

    def _upsert(self, s: ShardView) -> None:
        self._shards[s.id] = s
        kind = (s.state, has_problem(s, self.levels))
        old = self._kind.get(s.id)
        if old != kind:
            if old is not None:
                self._counts[old[0]] -= 1
                self._problems -= old[1]
            self._counts[kind[0]] += 1
            self._problems += kind[1]
            self._kind[s.id] = kind
        key = sort_key(s, self.sort) if self._matches(s, kind[1]) else None
        old_key = self._keys.get(s.id)
        if key == old_key:
            return
        if old_key is not None:
            del self._order[bisect_left(self._order, old_key)]
            del self._keys[s.id]
        if key is not None:
            insort(self._order, key)
            self._keys[s.id] = key
        self.version += 1

    def _matches(self, s: ShardView, problem: bool) -> bool:
        if self.filter == "all":
            return True
        if self.filter == "problems":
            return problem
        return s.state == self.filter

    def set_view(self, filter: str | None = None, sort: str | None = None) -> None:
        if filter is not None and filter not in FILTERS:
            raise ValueError(f"unknown shard filter {filter!r}; known: {', '.join(FILTERS)}")
        if sort is not None and sort not in SORTS:
            raise ValueError(f"unknown shard sort {sort!r}; known: {', '.join(SORTS)}")
        self.filter = filter or self.filter
        self.sort = sort or self.sort
        self._order = sorted(sort_key(s, self.sort) for s in self._shards.values()
                             if self._matches(s, self._kind[s.id][1]))
        self._keys = {k[-1]: k for k in self._order}
        self.version += 1

    def cycle_filter(self) -> str:
        self.set_view(filter=FILTERS[(FILTERS.index(self.filter) + 1) % len(FILTERS)])
        return self.filter

    def cycle_sort(self) -> str:
        self.set_view(sort=SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)])
        return self.sort

    # -- reading ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._order)

    def id_at(self, row: int) -> str:
        return self._order[row][-1]

    def ids(self, start: int = 0, stop: int | None = None) -> list[str]:
        return [k[-1] for k in self._order[start:stop]]

    def shard(self, sid: str) -> ShardView:
        return self._shards[sid]

    def row_of(self, sid: str) -> int | None:
        key = self._keys.get(sid)
        return None if key is None else bisect_left(self._order, key)

    def next_problem(self, after: int) -> int | None:
        """The row of the first listed shard with a problem after row `after` (wrapping around), or None."""
        n = len(self._order)
        for step in range(1, n + 1):
            row = (after + step) % n
            if self._kind[self._order[row][-1]][1]:
                return row
        return None

    def summary(self) -> ShardSummary:
        c = self._counts
        known = c["done"] + c["running"] + c["pending"] + c["paused"]
        return ShardSummary(total=len(self._shards), done=c["done"], running=c["running"], pending=c["pending"],
                            paused=c["paused"], other=len(self._shards) - known, problems=self._problems,
                            listed=len(self._order), selected=len(self.selected))

    # -- selection ---------------------------------------------------------------------------
    def toggle(self, sid: str) -> None:
        self.selected.symmetric_difference_update({sid})

    def select_listed(self) -> int:
        """Add every listed shard (the filter's) to the selection; returns how many are selected."""
        self.selected.update(k[-1] for k in self._order)
        return len(self.selected)

    def clear_selection(self) -> None:
        self.selected.clear()

    def targets(self, cursor: str | None) -> list[str]:
        """What p/r act on: the selection if any, else the shard under the cursor."""
        if self.selected:
            return sorted(self.selected)
        return [] if cursor is None else [cursor]
