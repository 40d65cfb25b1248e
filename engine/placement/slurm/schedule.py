"""When a [slurm] run's groups hand over: each group's first time limit (staggered, so no two groups drain together),
how early a group's next job is submitted (this run's measured queue wait and load time), and the trim of a job whose
limit would fall in another group's hand-over window (`scontrol update TimeLimit`, which a user may only lower).

Slurm's time limits have a resolution of one minute (sbatch --time, scontrol TimeLimit): every limit here is whole
minutes. The reasoning behind the choice of options is in docs/slurm.md (Staggered limits).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.api.reports import SlurmHandover
from engine.config.schema import Slurm

# before this run measured a job's queue wait or its servers' load: what a hand-over counts on (a busy cluster's
# queue, a large model's load); the first jobs of a run measure both before any hand-over is due
DEFAULT_QUEUE_WAIT_S = 120.0
DEFAULT_LOAD_S = 300.0
# Slurm ends a job past its limit at its next time-limit check (about every 30 s) plus KillWait (measured: a 1-minute
# job killed 73-83 s after its start on the tests' cluster)
DEFAULT_KILL_LAG_S = 30.0
LEAD_MARGIN_S = 10.0  # the next job's servers proven this long before the drain is due (two squeue polls and slack)
RECENT = 5  # the measurements a lead counts on: the last few of this run's jobs


def minutes(seconds: float) -> int:
    """A duration as the whole minutes Slurm takes (down: a limit never later than asked)."""
    return max(1, int(seconds // 60))


def limit_text(mins: int) -> str:
    """Minutes as sbatch's --time / scontrol's TimeLimit read them: "90", "12:00:00", "1-00:00:00"."""
    d, rem = divmod(mins, 1440)
    h, m = divmod(rem, 60)
    if d:
        return f"{d}-{h:02d}:{m:02d}:00"
    return f"{h}:{m:02d}:00" if h else str(m)


def spacing_s(s: Slurm, groups: int) -> float:
    """How far apart the groups' first limits are set: a group hands over about every time_limit - handover_s -
    LEAD_MARGIN_S (its next job starts that long before the last one's drain, plus the load), and the groups' hand-overs
    are spread evenly over that cycle."""
    return (s.time_limit_s - s.handover_s - LEAD_MARGIN_S) / max(1, groups)


def first_limit_min(s: Slurm, groups: int, group: int) -> int:
    """Group g's first job's --time, in minutes: time_limit - g x spacing, to the nearest minute, never so short that
    its drain (handover_s before it) comes before it serves. Its later jobs get time_limit and keep the offset."""
    full = minutes(s.time_limit_s)
    if group == 0:
        return full
    floor_min = max(1, math.ceil((s.handover_s + LEAD_MARGIN_S) / 60))
    return min(full, max(floor_min, round((s.time_limit_s - group * spacing_s(s, groups)) / 60)))


def window_s(s: Slurm) -> float:
    """A group's hand-over window: from the switch (its next job's servers proven, LEAD_MARGIN_S ahead) to the drain
    handover_s before the limit. Two groups whose limits are closer than this could drain together."""
    return s.handover_s + LEAD_MARGIN_S


def trimmed_limit_min(started: float, end: float, others: list[float], window: float, min_serving_s: float
                      ) -> int | None:
    """A job that started at `started` (any clock) and ends at `end`: its new time limit in minutes if its end falls
    within `window` of another group's end (`others`), else None. The end moves before the other one (a user may only
    lower a limit); None too when that would leave it less than min_serving_s."""
    target = end
    for other in sorted(others, reverse=True):
        if abs(target - other) < window:
            target = min(target, other - window)
    if target >= end:
        return None
    new_min = int((target - started) // 60)
    if new_min * 60 < min_serving_s:
        return None
    return new_min


@dataclass
class Schedule:
    """One run's hand-over figures, shared by its groups' links: measured queue waits (submit to RUNNING), load times
    (RUNNING to every server proven) and kill lags (limit to the job's end), and each group's current job's end (the
    links' monotonic clock), from which staggering is kept."""
    queue_waits: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    kill_lags: list[float] = field(default_factory=list)
    ends: dict[int, float] = field(default_factory=dict)

    @staticmethod
    def _recent(values: list[float], default: float) -> float:
        return max(values[-RECENT:]) if values else default

    def queue_wait_s(self) -> float:
        return self._recent(self.queue_waits, DEFAULT_QUEUE_WAIT_S)

    def load_s(self) -> float:
        return self._recent(self.loads, DEFAULT_LOAD_S)

    def kill_lag_s(self) -> float:
        return self._recent(self.kill_lags, DEFAULT_KILL_LAG_S)

    def lead_s(self) -> float:
        """How long before the drain a group's next job is submitted: the longest recent queue wait and load, and a
        margin (the longest, not the mean: submitting early costs an overlap, late a gap)."""
        return self.queue_wait_s() + self.load_s() + LEAD_MARGIN_S

    def lead_words(self) -> str:
        def said(values: list[float], value: float) -> str:
            return f"{value:.0f} s" + (" measured" if values else " assumed, none measured yet")
        return (f"queue wait {said(self.queue_waits, self.queue_wait_s())}, load {said(self.loads, self.load_s())}, "
                f"margin {LEAD_MARGIN_S:.0f} s")

    def kill_lag_words(self) -> str:
        """How long past its limit Slurm ends a job, as the operator reads it."""
        if self.kill_lags:
            return f"{self.kill_lag_s():.0f} s after it (measured)"
        return f"up to ~{DEFAULT_KILL_LAG_S:.0f} s after it (its limit check) plus KillWait (none measured yet)"

    def others(self, group: int) -> list[float]:
        return [end for g, end in self.ends.items() if g != group]


def handover_times(s: Slurm, groups: int, horizon_s: float | None, per_group: int = 3,
                   queue_wait_s: float = DEFAULT_QUEUE_WAIT_S, load_s: float = DEFAULT_LOAD_S) -> list[SlurmHandover]:
    """When each group's hand-overs fall, from the first submission, on the plan's assumptions (every job waits
    queue_wait_s, its servers load in load_s, the next job is submitted so they are proven LEAD_MARGIN_S before the
    drain): at most per_group of them, and none past horizon_s (the projected run)."""
    out = []
    for g in range(groups):
        start = queue_wait_s
        limit = first_limit_min(s, groups, g) * 60
        for k in range(per_group):
            drain = start + limit - s.handover_s
            if horizon_s is not None and drain - LEAD_MARGIN_S >= horizon_s:
                break
            switch = drain - LEAD_MARGIN_S
            out.append(SlurmHandover(group=g, job=k, time_limit_s=limit, submit_s=max(start, switch - load_s - queue_wait_s),
                                     switch_s=switch, drain_s=drain, limit_s=start + limit))
            start, limit = switch - load_s, minutes(s.time_limit_s) * 60
    return out
