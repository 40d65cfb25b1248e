"""Chart history bounded over days: recent points at full resolution, older ones averaged into coarser buckets."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

Point = tuple[float, float]

HISTORY_POINTS = 1800  # full resolution: one point per supervisor tick (2 s), an hour
# then (bucket seconds, buckets kept): a minute each for a day, ten minutes each for a week; older is dropped
COARSE_TIERS = ((60.0, 1440), (600.0, 1008))


@dataclass
class _Bucket:
    key: int
    ts_sum: float = 0.0
    value_sum: float = 0.0
    n: int = 0

    def add(self, p: Point) -> None:
        self.ts_sum += p[0]
        self.value_sum += p[1]
        self.n += 1

    def point(self) -> Point:
        return self.ts_sum / self.n, self.value_sum / self.n


@dataclass
class _Tier:
    bucket_s: float
    points: deque[Point]
    open: _Bucket | None = None  # the bucket still filling

    def absorb(self, p: Point) -> Point | None:
        """Add an older point; returns the point this tier drops in turn (for the next, coarser tier)."""
        key = int(p[0] // self.bucket_s)
        if self.open is not None and self.open.key == key:
            self.open.add(p)
            return None
        dropped = None
        if self.open is not None:
            if len(self.points) == self.points.maxlen:
                dropped = self.points[0]
            self.points.append(self.open.point())
        self.open = _Bucket(key)
        self.open.add(p)
        return dropped

    def history(self) -> list[Point]:
        return list(self.points) + ([self.open.point()] if self.open is not None else [])

    def __len__(self) -> int:
        return len(self.points) + (self.open is not None)


@dataclass
class Series:
    """(ts, value) points; a replayed point (ts not after the newest) is ignored. `points` holds the recent ones at
    full resolution; history() every kept one, oldest first, the older averaged per minute, then per ten minutes."""

    maxlen: int = HISTORY_POINTS
    points: deque[Point] = field(init=False)
    _tiers: list[_Tier] = field(init=False)

    def __post_init__(self) -> None:
        self.points = deque(maxlen=self.maxlen)
        self._tiers = [_Tier(bucket_s, deque(maxlen=kept)) for bucket_s, kept in COARSE_TIERS]

    def add(self, ts: float, value: float | None) -> None:
        if value is None:
            return
        if self.points and ts <= self.points[-1][0]:
            return
        older = self.points[0] if len(self.points) == self.maxlen else None
        self.points.append((ts, float(value)))
        for tier in self._tiers:
            if older is None:
                break
            older = tier.absorb(older)

    def values(self) -> list[float]:
        return [v for _, v in self.points]

    def last(self) -> float | None:
        return self.points[-1][1] if self.points else None

    def last_ts(self) -> float | None:
        return self.points[-1][0] if self.points else None

    def first_ts(self) -> float | None:
        for tier in reversed(self._tiers):
            if len(tier):
                return tier.history()[0][0] if not tier.points else tier.points[0][0]
        return self.points[0][0] if self.points else None

    def history(self) -> list[Point]:
        out: list[Point] = []
        for tier in reversed(self._tiers):
            out += tier.history()
        out += self.points
        return out

    def __len__(self) -> int:
        return len(self.points) + sum(len(t) for t in self._tiers)


def downsample(points: list[Point], n: int) -> list[Point]:
    """At most n points: the points averaged over n equal stretches of time (a chart draws no more than its
    width shows); fewer points are returned as they are."""
    if len(points) <= n or n < 1:
        return points
    start, end = points[0][0], points[-1][0]
    width = (end - start) / n or 1.0
    buckets: dict[int, _Bucket] = {}
    for p in points:
        key = min(n - 1, int((p[0] - start) / width))
        buckets.setdefault(key, _Bucket(key)).add(p)
    return [buckets[k].point() for k in sorted(buckets)]
