"""The words console and engine share: every state, severity and finish reason as a StrEnum, the state groups the rules
use, the alert levels the engine judges by, and the one duration format. Nothing else defines a state name.

StrEnum members are their strings (`RunState.DONE == "done"`, JSON as "done"), so a reply decoded from JSON and a
member compare equal; an unknown word from a newer engine stays a plain string and fails no lookup.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any


class RunState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"  # every shard with work left is paused, the brake holds, or the disk guard waits
    DISK_FULL = "disk_full"  # (dispatch figures only) commits wait for space
    DRAINING = "draining"
    STOPPING = "stopping"
    DONE = "done"
    DRAINED = "drained"
    STOPPED = "stopped"
    FAILED = "failed"
    DEAD = "dead"  # offline: the supervisor is gone and recorded no end


LIVE_RUN_STATES = frozenset({RunState.STARTING, RunState.RUNNING, RunState.PAUSED, RunState.DISK_FULL,
                             RunState.DRAINING, RunState.STOPPING})
ENDED_RUN_STATES = frozenset({RunState.DONE, RunState.DRAINED, RunState.STOPPED, RunState.FAILED, RunState.DEAD})
# a supervisor's own last word: the states a run's end is recorded with (run_end events, the last dispatch event)
FINAL_RUN_STATES = frozenset({RunState.DONE, RunState.STOPPED, RunState.FAILED})
DISPATCHING_RUN_STATES = frozenset({RunState.RUNNING, RunState.PAUSED, RunState.DISK_FULL})


class ShardState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    PAUSED = "paused"
    DONE = "done"
    STOPPED = "stopped"


class WorkerState(StrEnum):
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    CRASHED = "crashed"
    FAILED = "failed"
    STOPPED = "stopped"
    # the port is held by a process regen did not launch, or the server that answers cannot prove it is
    # the one launched: nothing is sent to it; `error` names the holder and the remedy
    REFUSED = "refused"


LIVE_WORKER_STATES = frozenset({WorkerState.STARTING, WorkerState.LOADING, WorkerState.READY})


class HostState(StrEnum):
    CONNECTING = "connecting"
    UP = "up"
    DRAINED = "drained"  # up, but out of the router by the operator's choice
    LOST = "lost"
    FAILED = "failed"  # reached, but every server of it failed (crashed past workers.max_restarts): no work
    STOPPED = "stopped"


class Severity(StrEnum):
    """AlertEvent.severity, least to most severe (the order is the notifier's threshold)."""
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


SEVERITY_ORDER: tuple[Severity, ...] = tuple(Severity)


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"  # cut at max_new_tokens
    ABORT = "abort"
    REPETITION = "repetition"  # stopped by regen's runaway guard


@dataclass(frozen=True)
class AlertLevels:
    """The shares a shard is alerted (and marked a problem) above: [alerts] and [runaway] of the run, judged in the
    engine and sent with the status so the console marks shards by the same numbers."""
    empty_share: float = 0.05
    truncated_share: float = 0.10
    repetition_share: float = 0.05

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> AlertLevels:
        data = data or {}
        return cls(**{k: float(data[k]) for k in ("empty_share", "truncated_share", "repetition_share") if k in data})


def duration_text(seconds: float | None) -> str:
    """`42m07s`, `3h05m`, `1d06h00m`: every ETA and age the operator reads, in the CLI and the TUI alike."""
    if seconds is None:
        return "N/A"
    seconds = max(0, int(seconds))
    d, rem = divmod(seconds, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    if d:
        return f"{d}d{h:02d}h{m:02d}m"
    if h:
        return f"{h}h{m:02d}m"
    return f"{m}m{s:02d}s"
