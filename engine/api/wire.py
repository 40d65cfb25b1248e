"""The words console and engine share: every state, severity and finish reason as a StrEnum (a member equals its string,
so a decoded reply compares equal; an unknown word from a newer engine stays a plain string), the state groups, the
alert levels, one shard's figures, the one duration format, and decode(): a reply or event read into these types."""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from pydantic import TypeAdapter

T = TypeVar("T")


class RunState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"  # every shard with work left is paused, the brake holds, or the disk guard waits
    DISK_FULL = "disk_full"  # (dispatch figures only) commits wait for space
    DRAINING = "draining"
    STOPPING = "stopping"
    FINISHING = "finishing"  # every sample settled: the servers are stopped, the last shards compacted; then done
    DONE = "done"
    DRAINED = "drained"
    STOPPED = "stopped"
    FAILED = "failed"
    DEAD = "dead"  # offline: the supervisor is gone and recorded no end


LIVE_RUN_STATES = frozenset({RunState.STARTING, RunState.RUNNING, RunState.PAUSED, RunState.DISK_FULL,
                             RunState.DRAINING, RunState.STOPPING, RunState.FINISHING})
ENDED_RUN_STATES = frozenset({RunState.DONE, RunState.DRAINED, RunState.STOPPED, RunState.FAILED, RunState.DEAD})
# a supervisor's own last word: the states a run's end is recorded with (run_end events, the last dispatch event)
FINAL_RUN_STATES = frozenset({RunState.DONE, RunState.STOPPED, RunState.FAILED})
DISPATCHING_RUN_STATES = frozenset({RunState.RUNNING, RunState.PAUSED, RunState.DISK_FULL})
# rejects.jsonl kinds of the samples (turns) a run settled without generating them; every other kind is an input row
# refused when the prompt files were read (malformed_json, unknown_role, duplicate_id, ...). The ledger writes these:
# a server's refusal or spent retries (and the later turns that chained on it), a turn after a cut one
# (turns_after_cut = "stop"), a turn that does not render or fit the context (the feed's Unfit)
SAMPLE_FAILED_KINDS = frozenset({"generation_failed", "earlier_turn_failed"})
SAMPLE_REJECTED_KINDS = frozenset({"sglang_rejected", "earlier_turn_rejected", "after_cut", "template_error",
                                   "context_overflow"})
# the run_end cause of a start that found every sample already settled (a finished run started again): it generated
# nothing and exited at once; `regen start` says the run is finished instead of "started"
ALREADY_SETTLED = "every sample was already settled"


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
    # a server on another host (a [[hosts]] entry, a [slurm] group's job): its host cannot be reached (a join that
    # failed, a job not running), or was reached and then lost (the link died, its job ended: NODE_FAIL, TIMEOUT ...).
    # Neither has live figures: its gauges, pid and in-flight count are dropped, not kept from the last reading
    UNREACHABLE = "unreachable"
    LOST = "lost"


LIVE_WORKER_STATES = frozenset({WorkerState.STARTING, WorkerState.LOADING, WorkerState.READY})


class InFlightSource(StrEnum):
    """Who counted a server's `in_flight` (WorkerEvent.in_flight_source)."""
    DISPATCH = "dispatch"  # regen's dispatcher: the requests it sent to this server and has not had answered
    ROUTER = "router"  # behind sglang-router: the router's own count of requests open on it (GET /workers `load`)
    # behind a router that does not count per server (its policy keeps no load): `in_flight` is None, not 0; the
    # router's row (RouterStatus.in_flight) has what regen has open through it
    UNKNOWN = "unknown"


class HostState(StrEnum):
    CONNECTING = "connecting"
    UP = "up"
    DRAINED = "drained"  # up, but out of the router by the operator's choice
    LOST = "lost"
    FAILED = "failed"  # reached, but every server of it failed (crashed past workers.max_restarts): no work
    STOPPED = "stopped"
    ENDED = "ended"  # a [slurm] group whose allocation ended for good (the run is over): its job's last state says how


class JobSource(StrEnum):
    """Which of Slurm's commands said a [slurm] group's job state (SlurmJobStatus.source)."""
    SQUEUE = "squeue"  # the queue: pending and running jobs, and ended ones for MinJobAge
    SCONTROL = "scontrol"  # slurmctld's memory of a job that left the queue
    SACCT = "sacct"  # the accounting record, once slurmctld forgot the job
    NONE = "none"  # none of them knows the job (state GONE; its reason says what each said)


class Severity(StrEnum):
    """AlertEvent.severity, least to most severe (the order is the notifier's threshold)."""
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


SEVERITY_ORDER: tuple[Severity, ...] = tuple(Severity)


class AlertKind(StrEnum):
    """AlertEvent.kind: a one-shot event, or a condition's start and end. A raised condition is recorded with the run
    (state.sqlite) until it is cleared: the status lists it while it holds, and a restarted supervisor neither raises it
    again nor forgets to clear it (engine.store.alert_record)."""
    EVENT = "event"  # said once (a worker crashed, a slurm job was submitted): history, never `raised now`
    RAISED = "raised"  # a condition began (one per key until cleared)
    CLEARED = "cleared"  # that condition ended


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


@dataclass
class ShardFigures:
    """One shard's figures: a status's shard (RunStatus.shards) and the telemetry's shard event alike, each field with
    the one meaning engine.api.status.RunStatus's docstring gives it (`total`: to generate, `planned`: what the input plans)."""
    id: str = ""
    state: str = ShardState.PENDING  # engine.observe.status.shard_state: pending | running | paused | draining | ...
    done: int = 0
    total: int = 0
    planned: int = 0
    output_tokens: int = 0
    empty: int = 0
    truncated: int = 0
    failed: int = 0
    rejected: int = 0
    repetition: int = 0  # stopped by the runaway guard (finish_reason "repetition")
    after_cut: int = 0  # of the rejected: later turns not generated after a cut turn (turns_after_cut = "stop")
    unclosed_reasoning: int = 0  # committed answers whose reasoning was never closed (not by the runaway guard)
    dispatched: int = 0  # requests sent for it by this supervisor (offline: 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class WireError(ValueError):
    """A reply or event that does not have the wire's shape; the text names the field (`shards.3.done: ...`)."""


def decode(cls: type[T], data: Any, what: str) -> T:
    """`data` (decoded JSON) as a `cls`, checked field by field: a field of the wrong type raises WireError naming it
    (with `what`: whose reply); a field this version does not know is dropped; a field an older engine did not send
    takes its default (a required one missing is an error)."""
    from pydantic import ValidationError  # here: the supervisor and engine.ctl encode only, and start faster without

    # a class is hashable; mypy checks type[T] against Hashable by its instances' __hash__ (python/mypy#11470)
    adapter: TypeAdapter[T] = _adapter(cls)  # type: ignore[arg-type]
    try:
        return adapter.validate_python(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        said = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(the whole)'}: {e['msg']} (got {_clip(e['input'])})"
                         for e in errors[:3])
        more = f"; and {len(errors) - 3} more" if len(errors) > 3 else ""
        raise WireError(f"{what}: {said}{more}") from None


@functools.lru_cache(maxsize=None)
def _adapter(cls: type[Any]) -> TypeAdapter[Any]:  # one per type, whatever its type: decode gives it back typed
    from pydantic import TypeAdapter

    return TypeAdapter(cls)


def _clip(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


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


def in_flight_text(in_flight: int | None, capacity: int, source: str = InFlightSource.DISPATCH,
                   router_in_flight: int | None = None) -> str:
    """A server's in-flight cell, the CLI's and the TUI's alike: `12/40` (regen's own count against its target),
    `12 (router)` (the router's count of it), `N/A (router 96)` (behind a router that does not count per server:
    not known, with what the router has open in all), `N/A` (no live figure: its host is lost)."""
    if source == InFlightSource.ROUTER and in_flight is not None:
        return f"{in_flight} (router)"
    if in_flight is None:
        return "N/A" + (f" (router {router_in_flight})" if router_in_flight is not None and
                        source == InFlightSource.UNKNOWN else "")
    return f"{in_flight}/{capacity}"


def pid_text(pid: int | None, node: str = "", job_id: str = "") -> str:
    """A server's process: `4711`, on another machine `4711 on gpu-a17` or with its Slurm job `4711 on gpu-a17, job
    4127`; `N/A` while no process is known (not launched yet, its host lost)."""
    where = ", ".join(x for x in (f"on {node}" if node else "", f"job {job_id}" if job_id else "") if x)
    if pid is None:
        return f"N/A ({where})" if job_id else "N/A"
    return f"{pid} {where}" if where else str(pid)
