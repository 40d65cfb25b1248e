"""Telemetry event types (one JSON object per line of `telemetry.jsonl`, with `type` and `ts`).

These dataclasses are the published schema the console imports; the engine emits them
through `to_json()`, the console parses lines back with `parse_event()`.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import orjson

from engine.api.wire import AlertKind, InFlightSource, Severity, ShardFigures, decode


@dataclass
class Event:
    type: ClassVar[str] = "event"
    ts: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["type"] = self.type
        return d

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict())


@dataclass
class GpuEvent(Event):
    type: ClassVar[str] = "gpu"
    index: int = 0
    name: str | None = None
    mem_used_mb: float | None = None  # None = N/A (NVML failed; `error` says why)
    mem_total_mb: float | None = None
    util_pct: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    error: str | None = None
    host: str = ""  # the [[hosts]] name whose agent sampled it; "" = the supervisor's own host


@dataclass
class WorkerEvent(Event):
    type: ClassVar[str] = "worker"
    name: str = ""
    # engine.api.wire.WorkerState: starting | loading | ready | crashed | failed | stopped | refused | unreachable | lost
    state: str = "starting"
    url: str = ""
    gpus: list[int] = field(default_factory=list)
    pid: int | None = None
    restarts: int = 0
    running_reqs: float | None = None
    queued_reqs: float | None = None
    gen_throughput: float | None = None  # tokens/s from sglang:gen_throughput
    token_usage: float | None = None  # KV pool fraction
    # requests open on it: regen's own count when it is a dispatch target; behind the router, the router's count of
    # it, or None where the router keeps none (in_flight_source says which: engine.api.wire.InFlightSource), or where
    # the server has no live figure (its host lost)
    in_flight: int | None = 0
    in_flight_source: str = InFlightSource.DISPATCH
    held: int = 0  # items regen's own queue holds for it (prefix affinity), not sent yet: any server may still take them
    capacity: int = 0  # in-flight target: the batch size plus a queue margin
    # the server's running batch size dispatch works with and where it came from (engine/servers/capacity.py:
    # internal_states | log | server_info | flag | default, or feedback once its queue corrected it);
    # None / "" until it is known
    batch_size: int | None = None
    batch_source: str = ""
    # what discovery found before any feedback (shown when feedback changed it)
    discovered_batch: int | None = None
    discovered_source: str = ""
    error: str | None = None
    host: str = ""  # the [[hosts]] name in a multi-host run; "" on one host
    remote: bool = False  # on another host than the supervisor's: its GPUs are not in this host's readings
    node: str = ""  # a [slurm] group's server: the node its job runs it on (its pid is that node's)
    job_id: str = ""  # a [slurm] group's server: the job that runs it
    # prompt tokens of the samples committed from it in this start, and how many its prefix cache served
    # (meta_info.cached_tokens); None: not a dispatch target (a server behind the router: the router's row has them)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    # requests the server retracted since its launch (its sglang:num_retracted_requests_total); None: N/A, the server
    # exports no such counter (SGLang before 0.5.10) or has no reading yet
    retracted: float | None = None
    # the --schedule-conservativeness it runs with and where that came from (engine.api.tuning.TuningSource); a remote
    # server's as its host agent's identity record says; None / "": not known (an agent from before these fields)
    conservativeness: float | None = None
    conservativeness_source: str = ""


@dataclass
class DispatchEvent(Event):
    type: ClassVar[str] = "dispatch"
    in_flight: int = 0
    done: int = 0
    failed: int = 0
    retried: int = 0
    rejected: int = 0
    total: int = 0  # samples to generate: planned less rejected and failed (field meanings: engine.api.status.RunStatus)
    output_tokens: int = 0  # over the committed samples
    # output tokens committed per second over the last minute of this start; None while not measurable yet
    # (a few commits over ~10 s) and whenever the run is not running: shown as "-", never as a false 0
    tokens_per_s: float | None = None
    state: str = "running"  # running | paused | draining | done | stopped | disk_full
    planned: int = 0
    eta_s: float | None = None  # None until measurable and whenever the run is not running
    repetition: int = 0  # committed samples the runaway guard stopped
    after_cut: int = 0  # of the rejected: later turns not generated after a cut turn (turns_after_cut = "stop")


@dataclass
class DiskEvent(Event):
    type: ClassVar[str] = "disk"
    path: str = ""
    free_bytes: int = 0
    total_bytes: int = 0
    host: str = ""  # as GpuEvent.host
    error: str | None = None  # set: no reading (free/total are not figures), e.g. the host's link is lost


@dataclass
class ShardEvent(Event, ShardFigures):
    """A shard's figures (engine.api.wire.ShardFigures: the status's shard too) as of `ts`."""
    type: ClassVar[str] = "shard"

    @classmethod
    def of(cls, figures: ShardFigures, ts: float | None = None) -> ShardEvent:
        ts_given: dict[str, Any] = {} if ts is None else {"ts": ts}  # Any: spread among fields of every type
        return cls(**asdict(figures), **ts_given)


@dataclass
class AlertEvent(Event):
    type: ClassVar[str] = "alert"
    severity: str = Severity.WARNING  # info | warning | error | critical (engine.api.wire.Severity)
    text: str = ""
    evidence: str = ""
    key: str = ""  # stable key so the console can de-duplicate repeats
    # engine.api.wire.AlertKind: event (said once), or raised / cleared (a condition keyed by `key`, recorded with the run
    # while it holds: engine.store.alert_record); an older engine's lines have no kind: events
    kind: str = AlertKind.EVENT


@dataclass
class FatalEvent(Event):
    """The supervisor cannot go on: why, where and what to do. Also kept in the run dir (last state)."""
    type: ClassVar[str] = "fatal"
    exc_type: str = ""  # e.g. PromptFileError, RenderError, OSError
    message: str = ""  # the exception's text, with the path it names
    path: str | None = None  # the file or dir involved, when there is one
    remedy: str = ""  # what the operator does about it
    phase: str = ""  # start | run | shutdown


@dataclass
class RunEndEvent(Event):
    """The supervisor's last word: how the run ended (emitted once, just before exit)."""
    type: ClassVar[str] = "run_end"
    state: str = "done"  # done | drained | stopped | failed
    exit_code: int = 0
    cause: str = ""  # for failed: the fatal message or the critical alert that ended it
    done: int = 0
    total: int = 0


EVENT_TYPES: dict[str, type[Event]] = {
    cls.type: cls for cls in (GpuEvent, WorkerEvent, DispatchEvent, DiskEvent, ShardEvent, AlertEvent,
                              FatalEvent, RunEndEvent)
}


class UnknownEventType(ValueError):
    """A line whose `type` this version does not know (a newer engine's event): skipped by readers, not an error."""


def parse_event(line: bytes | str) -> Event:
    """One telemetry line as its event (event_from_dict); a line that is not JSON raises orjson's JSONDecodeError (a
    ValueError too)."""
    return event_from_dict(orjson.loads(line))


def event_from_dict(data: Any) -> Event:
    """A decoded telemetry line as its event, checked field by field (engine.api.wire.decode): a field of the wrong type
    raises WireError naming it, an unknown field is dropped, a missing one takes its default; an unknown type raises
    UnknownEventType (both are ValueErrors)."""
    kind = data.get("type") if isinstance(data, dict) else None
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise UnknownEventType(f"unknown telemetry event type {kind!r}")
    return decode(cls, data, f"{kind} event")
