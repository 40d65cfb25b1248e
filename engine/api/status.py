"""The status shape: RunStatus and its parts (hosts, router, metrics, rejects, start checks, the fatal record), the
reply of the supervisor's `status` op and of engine.ctl last-status. Types only: engine.observe.status builds them;
the console reads them (its one way into a run's state)."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from engine.api.brake import BrakeStatus
from engine.api.events import AlertEvent, DiskEvent, DispatchEvent, FatalEvent, GpuEvent, RunEndEvent, WorkerEvent
from engine.api.wire import (AlertLevels, SAMPLE_FAILED_KINDS, SAMPLE_REJECTED_KINDS, ShardFigures, decode,
                             duration_text)

class CheckState(StrEnum):
    """A start check's state (StartCheck.state)."""
    PENDING = "pending"
    OK = "ok"
    FAILED = "failed"


@dataclass
class StartCheck:
    check: str
    title: str
    state: str = CheckState.PENDING  # a CheckState; a word from a newer engine stays a string
    detail: str = ""
    ts: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FatalRecord:
    exc_type: str
    message: str
    path: str | None = None
    remedy: str = ""
    phase: str = ""  # start | run | shutdown
    exit_code: int = 1
    pid: int = 0
    log: str = ""  # the supervisor's log, where a traceback (if any) is
    ts: float = dataclasses.field(default_factory=time.time)

    @property
    def headline(self) -> str:
        return f"{self.exc_type}: {self.message}"

    def event(self) -> FatalEvent:
        return FatalEvent(ts=self.ts, exc_type=self.exc_type, message=self.message, path=self.path,
                          remedy=self.remedy, phase=self.phase)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FatalRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {"exc_type", "message"} - set(data)
        if missing:
            raise ValueError(f"not a fatal record (no {', '.join(sorted(missing))})")
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Rejects:
    """rejects.jsonl: every row, by reason (its kind), and the parts they sum to: input rows refused when read, and the
    samples settled without being generated, rejected or failed (engine.api.wire's SAMPLE_*_KINDS). The parts are derived
    from by_reason when not given (the engine's status, an older engine's reply)."""
    total: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    input_rows: int | None = None
    samples_rejected: int | None = None
    samples_failed: int | None = None

    def __post_init__(self) -> None:
        if self.samples_rejected is None:
            self.samples_rejected = sum(n for k, n in self.by_reason.items() if k in SAMPLE_REJECTED_KINDS)
        if self.samples_failed is None:
            self.samples_failed = sum(n for k, n in self.by_reason.items() if k in SAMPLE_FAILED_KINDS)
        if self.input_rows is None:
            self.input_rows = max(0, self.total - self.samples_rejected - self.samples_failed)

    def text(self) -> str:
        """`7 (6 input rows, 1 sample rejected)`: the count and its parts, in the words `regen status` and the TUI's
        header both print (the progress line's `rejected samples N` / `failed N` are the samples' part)."""
        parts = [f"{n} {what}" for n, what in (
            (self.input_rows, "input row" if self.input_rows == 1 else "input rows"),
            (self.samples_rejected, "sample rejected" if self.samples_rejected == 1 else "samples rejected"),
            (self.samples_failed, "sample failed" if self.samples_failed == 1 else "samples failed")) if n]
        return f"{self.total} ({', '.join(parts)})" if parts else str(self.total)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SlurmJobStatus:
    """A [slurm] group's current job, in Slurm's words (squeue; once the job left the queue scontrol, then sacct)."""
    job_id: str
    state: str  # PENDING, RUNNING, TIMEOUT, CANCELLED, NODE_FAIL, ... (Slurm's); GONE: no command knows it any more
    reason: str = ""  # Resources, Priority, ... (pending), or why it ended
    nodes: str = ""
    # squeue's time left as the operator reads it (engine.placement.slurm.jobs.time_left_text): `47:48`, `past its
    # limit` (squeue's INVALID: over its limit, not killed yet), `no limit`; "" where not known
    time_left: str = ""
    next_job: str | None = None  # queued at a hand-over before the time limit
    waiting_since: float | None = None  # not running yet (PENDING ...): since when regen saw it so (epoch s)
    ended: bool = False  # the job ended for good (not pending, running or requeued): `state` is its last state
    source: str = ""  # which command said the state (engine.api.wire.JobSource); "" from an engine before the field

    def state_text(self, as_of: float | None) -> str:
        """The state, with how long a job not started has waited as of `as_of` (`PENDING 12m34s`): the CLI's and
        the TUI's words alike."""
        if self.state == "RUNNING" or self.waiting_since is None or as_of is None:
            return self.state
        return f"{self.state} {duration_text(as_of - self.waiting_since)}"

    def left_text(self) -> str:
        """A running job's time left in a sentence: `47:48 left`, `past its limit`, `no limit`; "" otherwise."""
        if self.state != "RUNNING" or not self.time_left:
            return ""
        return self.time_left if not self.time_left[:1].isdigit() else f"{self.time_left} left"

    @property
    def reason_text(self) -> str:
        """Slurm's reason, or "" where squeue says none."""
        return self.reason if self.reason not in ("", "None") else ""


@dataclass
class HostStatus:
    """One [[hosts]] entry of a multi-host run, or one [slurm] group (its job in `job`)."""
    name: str
    address: str  # "local" for the dispatch host itself
    state: str  # up | connecting | lost | drained | ... (engine.placement.hosts.link); the local host is always up
    error: str | None = None
    workers: list[str] = field(default_factory=list)
    work_dir: str = ""
    joins: int | None = None  # remote hosts only: connections made, and connections lost
    lost: int | None = None
    job: SlurmJobStatus | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.joins is None and self.lost is None:  # the local host has no link to count
            del d["joins"], d["lost"]
        if self.job is None:
            del d["job"]
        return d


@dataclass
class SlurmGroups:
    """A [slurm] run's server groups at a glance (engine.placement.slurm.groups): of the `wanted` groups regen keeps
    submitted (max_groups), how many Slurm granted (the job runs) and how many of those serve (a server in the
    router), how many wait in the queue; `counted`: the min_groups the plan counts on. A group between two jobs is
    neither granted nor pending."""
    wanted: int
    counted: int
    granted: int = 0
    serving: int = 0
    pending: int = 0
    below_since: float | None = None  # live: granted below counted since then (epoch s); else None

    def text(self, live: bool = True) -> str:
        """`slurm groups: 1 granted (1 serving), 1 pending, 2 wanted; the plan counts on 2` (79 columns; the CLI and
        the TUI colour it while fewer are granted than the plan counts on)."""
        serving = f" ({self.serving} serving)" if live else ""
        return (f"slurm groups: {self.granted} granted{serving}, {self.pending} pending, {self.wanted} wanted; "
                f"the plan counts on {self.counted}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RouterStatus:
    """The router in front of a multi-host run's servers."""
    url: str
    up: bool
    policy: str
    members: list[str] = field(default_factory=list)  # server URLs given to it
    restarts: int = 0
    error: str | None = None
    # the servers it routes to: of the members, those it lists itself, healthy (GET /workers: a server given to it
    # is listed about a second later); dispatch waits for one
    routed: list[str] = field(default_factory=list)
    in_flight: int = 0  # requests regen has open through it (its servers' own figures: each worker's in_flight)
    capacity: int = 0  # the dispatcher's target for it: the routed servers' batches plus a queue margin

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class MetricsStatus:
    """Where the supervisor serves the run's Prometheus metrics ([metrics]), or why it does not."""
    enabled: bool = True
    address: str = ""  # host:port from [metrics]
    url: str | None = None  # http://host:port/metrics while served
    error: str | None = None  # why not served although enabled (the port is busy: who holds it)

    def text(self) -> str:
        """One line for the operator: `metrics: http://...` or why there are none."""
        if not self.enabled:
            return "metrics: not served ([metrics] enabled = false)"
        if self.url:
            return f"metrics: {self.url} (Prometheus)"
        return f"metrics: not served on {self.address}: {self.error or 'not started yet'}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunStatus:
    """The status reply. Its fields (the JSON keys of the reply):
      run_dir        the run dir (absolute, on the host)
      state          the run's: starting | running | paused | draining | stopping | done | stopped | failed;
                     offline also drained and dead (the supervisor is gone and recorded no cause: killed)
      running        a supervisor answers (false: read from the run dir alone; then `offline` is true)
      fatal          why the run failed (FatalRecord: type, message, path, remedy, log), or null
      phase          live: where a fatal error would be (start | run | shutdown); offline: null
      startup        live: the start checks (StartCheck) until they pass; offline: []
      write_errors   live: files the supervisor cannot write (logs, telemetry.jsonl); offline: []
      pid, started_at, config_hash, host   the supervisor's (offline: pid and config_hash null; started_at the first
                     telemetry event's time)
      dispatch       the run's figures (DispatchEvent, below), or null before the ledger is loaded and nothing recorded
      workers, gpus, disk   the latest telemetry snapshots (offline: no workers, GPUs or disk); gpus and disk are every
                     host's, each with its `host` ("" the supervisor's own, a [[hosts]] name: read by that host's agent)
      alerts         the alerts raised now, oldest first: each condition that still holds, once (its `ts`: when it was
                     raised, also by an earlier supervisor of the run), from the run's record (engine.store.alert_record,
                     in state.sqlite; live and offline alike); a cleared one is gone from it
      alert_events   history: the latest alert events said (live: the last 50 of this supervisor; offline: the last 20
                     telemetry.jsonl recorded), one-shot events and the conditions' raised / cleared lines alike (`kind`)
      shards         one ShardFigures (engine.api.wire) per shard (figures below; `state`: engine.observe.status's rule)
      rejects        Rejects: every row of rejects.jsonl (input rows refused when read, and samples rejected or failed),
                     total, by reason, and its parts: input_rows, samples_rejected, samples_failed (they sum to total)
      run_end        offline: the supervisor's last word (RunEndEvent: how it ended, why), or null
      last_state     offline: the state of the last dispatch event recorded (live: null)
      log            the supervisor's log (run_dir/supervisor.log)
      log_tail       offline, for a dead supervisor: the last lines of that log; otherwise []
      checked_at     when this status was taken
      read_errors    offline: run-dir files that could not be read (so figures may be missing); live: []
      hosts, router  multi-host runs only (keys absent otherwise): each host (HostStatus) and the router (RouterStatus)
      slurm_groups   [slurm] runs only (key absent otherwise): the server groups granted / serving / pending of those wanted
                     (max_groups), and the min_groups the plan counts on (SlurmGroups); offline, from Slurm's word now
      metrics        live: where the run's Prometheus metrics are served (MetricsStatus: url), or why not (error:
                     the port is busy, [metrics] enabled = false); offline: null
      brake          the data-quality brake (BrakeStatus): engaged (dispatch paused run-wide: `state`
                     is paused) with its cause, numbers, likely causes and remedy, and the shares over its window now;
                     offline: the same, from the store's record and last samples under run.toml's [brake]; null before
                     the ledger is loaded (and from an engine without the brake)

    Figure meanings (in `dispatch` and in each shard), the same names everywhere:
      done           samples committed (rows in committed parts)
      total          samples to generate: planned less rejected and failed (so a finished run is done == total)
      planned        samples the input plans (generated turns of the good conversations)
      rejected       samples never generated because their input cannot be (engine.run.counts); input rows refused
                     when read are not samples: they are in `rejects` (rejects.jsonl, by reason) with the rest
      after_cut      of the rejected: later turns not generated because an earlier turn of their conversation was cut
                     (ended at max_new_tokens or stopped as a runaway) and turns_after_cut = "stop"
      failed         samples whose retries were spent in this run (the next start generates them again)
      retried        attempts that failed and went back to the queue (not an outcome)
      in_flight      requests sent and not answered; while draining, what is left to drain
      output_tokens, empty, truncated, repetition   sums over the committed samples (repetition: answers the runaway
                     guard stopped, finish_reason "repetition"); per shard also unclosed_reasoning (a reasoning block
                     opened and never closed, not by the runaway guard)
      tokens_per_s   output tokens committed per second over the last minute of this start; null until measurable
                     and when not running
      eta_s          seconds left at that rate (remaining samples x committed tokens per sample); null until
                     measurable and whenever the run is not running
      dispatched     (per shard) requests sent for it by this supervisor (offline: 0)
      state          (dispatch) the run state the figures were taken in: as `state`, but disk_full while commits wait
                     for space; (per shard) shard_state's
    """
    run_dir: str
    state: str
    running: bool = True
    offline: bool = False
    fatal: FatalRecord | None = None
    phase: str | None = None
    startup: list[StartCheck] = field(default_factory=list)
    write_errors: list[str] = field(default_factory=list)
    pid: int | None = None
    started_at: float | None = None
    config_hash: str | None = None
    host: str = ""
    dispatch: DispatchEvent | None = None
    workers: list[WorkerEvent] = field(default_factory=list)
    shards: list[ShardFigures] = field(default_factory=list)
    # asked without its shard list (a console that follows the shard events keeps its own, 10,000 shards are ~2 MB)
    shards_omitted: bool = False
    gpus: list[GpuEvent] = field(default_factory=list)
    disk: list[DiskEvent] = field(default_factory=list)
    alerts: list[AlertEvent] = field(default_factory=list)  # raised now (the record), not a replay of telemetry
    alert_events: list[AlertEvent] = field(default_factory=list)  # history: the latest alert events said
    rejects: Rejects = field(default_factory=Rejects)
    run_end: RunEndEvent | None = None
    last_state: str | None = None
    log: str = ""
    log_tail: list[str] = field(default_factory=list)
    checked_at: float = field(default_factory=time.time)
    read_errors: list[str] = field(default_factory=list)
    hosts: list[HostStatus] | None = None  # multi-host runs only (with router)
    router: RouterStatus | None = None
    slurm_groups: SlurmGroups | None = None  # [slurm] runs only
    brake: BrakeStatus | None = None
    metrics: MetricsStatus | None = None  # live only
    levels: AlertLevels = field(default_factory=AlertLevels)  # the shares the engine alerts a shard above

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.update(fatal=self.fatal.to_dict() if self.fatal is not None else None,
                 startup=[c.to_dict() for c in self.startup],
                 dispatch=self.dispatch.to_dict() if self.dispatch is not None else None,
                 workers=[w.to_dict() for w in self.workers], shards=[sh.to_dict() for sh in self.shards],
                 gpus=[g.to_dict() for g in self.gpus], disk=[x.to_dict() for x in self.disk],
                 alerts=[a.to_dict() for a in self.alerts], alert_events=[a.to_dict() for a in self.alert_events],
                 rejects=self.rejects.to_dict(),
                 run_end=self.run_end.to_dict() if self.run_end is not None else None,
                 write_errors=list(self.write_errors), log_tail=list(self.log_tail),
                 read_errors=list(self.read_errors), brake=self.brake.to_dict() if self.brake is not None else None,
                 metrics=self.metrics.to_dict() if self.metrics is not None else None,
                 levels=self.levels.to_dict())
        del d["hosts"], d["router"], d["slurm_groups"]
        if self.hosts is not None:
            d["hosts"] = [h.to_dict() for h in self.hosts]
            d["router"] = self.router.to_dict() if self.router is not None else None
        if self.slurm_groups is not None:
            d["slurm_groups"] = self.slurm_groups.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: Any, what: str = "status reply") -> RunStatus:
        """A reply read back (the console), checked field by field (engine.api.wire.decode: WireError names a malformed
        field); fields an older engine did not send take their defaults, fields this one does not know are dropped."""
        if isinstance(data, dict) and "running" not in data:  # an engine before `running`: offline said it
            data = {**data, "running": not data.get("offline")}
        return decode(cls, data, what)
