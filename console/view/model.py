"""The console's data model: telemetry events and status replies folded into the current state
plus bounded history (console/view/series.py). No Textual here: the UI reads this, tests drive it directly.

Every number that may be missing (NVML not available, a worker that never answered /metrics) is
kept as None and shown as N/A; nothing here raises on a partial event.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Iterable

from console.view.liveness import Freshness, Liveness, of_host, of_run, of_worker
from console.view.series import Series
from engine.api.wire import ENDED_RUN_STATES, LIVE_RUN_STATES, AlertLevels, RunState, ShardFigures
from engine.api.status import FatalRecord, HostStatus, Rejects, RunStatus
from engine.api.brake import BRAKE_ALERT_KEY, BrakeStatus
from engine.api.events import (AlertEvent, DiskEvent, DispatchEvent, Event, FatalEvent, GpuEvent, RunEndEvent,
                                     ShardEvent, WorkerEvent)

ALERTS_KEPT = 500
DISK_RATE_WINDOW_S = 600.0  # free-space slope over the last ten minutes


def na(value: Any, fmt: str = "{}") -> str:
    return "N/A" if value is None else fmt.format(value)


def bytes_text(n: float | None) -> str:
    if n is None:
        return "N/A"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def cause_text(fatal: FatalRecord | None) -> str:
    """One line: the message's first (a missing file's message goes on with the candidates found)."""
    first = ((fatal.message if fatal is not None else "") or "(no message)").splitlines()[0]
    return f"{(fatal.exc_type if fatal is not None else '') or 'Error'}: {first}"


@dataclass
class WorkerView:
    name: str
    state: str = "starting"
    gpus: list[int] = field(default_factory=list)
    pid: int | None = None
    restarts: int = 0
    running: float | None = None
    queued: float | None = None
    tok_s: float | None = None
    token_usage: float | None = None
    in_flight: int | None = 0  # None: not known (behind a router that keeps no count, or no live figure)
    in_flight_source: str = "dispatch"  # who counted it (engine.api.wire.InFlightSource)
    held: int = 0  # regen's queued items held for it (not sent)
    capacity: int = 0
    batch_size: int | None = None  # the server's running batch dispatch works with, and where it came from
    batch_source: str = ""
    discovered_batch: int | None = None  # what discovery said before feedback corrected it
    discovered_source: str = ""
    error: str | None = None
    url: str = ""
    host: str = ""  # multi-host runs: the [[hosts]] name
    remote: bool = False  # on another host: its GPUs are that host's agent's readings (GpuView.host)
    node: str = ""  # a [slurm] group's server: the node and job that run it
    job_id: str = ""
    prompt_tokens: int | None = None  # committed from it in this start, and how many its prefix cache served
    cached_tokens: int | None = None
    tok_history: Series = field(default_factory=Series)
    as_of: float | None = None  # the host time of its last reading


@dataclass
class GpuView:
    index: int
    host: str = ""  # whose agent sampled it; "" the dispatch host
    name: str | None = None
    mem_used_mb: float | None = None
    mem_total_mb: float | None = None
    util_pct: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    error: str | None = None
    mem_history: Series = field(default_factory=Series)

    @property
    def label(self) -> str:
        """`h1/gpu0` for another host's; the dispatch host's as always, `gpu0`."""
        return f"{self.host}/gpu{self.index}" if self.host else f"gpu{self.index}"


@dataclass
class ShardView:
    id: str
    state: str = "pending"
    done: int = 0
    total: int = 0
    output_tokens: int = 0
    empty: int = 0
    truncated: int = 0
    repetition: int = 0  # stopped by the runaway guard
    as_of: float | None = None  # the host time of these figures (an event's ts, or the status reply's)

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0

    @property
    def empty_share(self) -> float | None:
        return self.empty / self.done if self.done else None

    @property
    def truncated_share(self) -> float | None:
        return self.truncated / self.done if self.done else None


@dataclass
class DiskView:
    path: str
    host: str = ""  # as GpuView.host
    free_bytes: int = 0
    total_bytes: int = 0
    error: str | None = None  # no reading now (e.g. its host's link is lost): the figures are N/A
    history: Series = field(default_factory=Series)

    @property
    def label(self) -> str:
        return f"{self.host}:{self.path}" if self.host else self.path

    def write_rate(self, window_s: float = DISK_RATE_WINDOW_S) -> float | None:
        """Bytes/s consumed over the window (positive: filling up); None without two points."""
        pts = self.history.points
        if len(pts) < 2:
            return None
        t_end, free_end = pts[-1]
        start = next(((t, f) for t, f in pts if t >= t_end - window_s), pts[0])
        if t_end - start[0] <= 0:
            return None
        return (start[1] - free_end) / (t_end - start[0])

    def time_to_full(self) -> float | None:
        """Seconds until the free space is gone at the current write rate; None when not filling."""
        rate = self.write_rate()
        if rate is None or rate <= 0 or self.error is not None:
            return None
        return self.free_bytes / rate


@dataclass
class AlertView:
    ts: float
    severity: str
    text: str
    evidence: str = ""
    key: str = ""
    origin: str = "host"  # host (the supervisor's alert) | console (seen by the console)
    count: int = 1


class ConnectionState(StrEnum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    RECONNECTING = "reconnecting"
    LOST = "lost"
    ENDED = "ended"  # the follow ended with the run: nothing more will come
    REFUSED = "refused"




@dataclass(frozen=True)
class ResumeHint:
    """The `regen start` that resumes the run, from its start record (console/host/start_record.py), and where that line
    comes from; or, without a record, only why (command "")."""
    command: str = ""
    note: str = ""

    def text(self) -> str:
        if not self.command:
            return self.note
        return f"resume with: {self.command}" + (f" ({self.note})" if self.note else "")




@dataclass
class Connection:
    state: ConnectionState = ConnectionState.CONNECTING
    retry_at: float | None = None  # monotonic time of the next attempt
    error: str = ""
    since: float = field(default_factory=time.monotonic)

    def text(self, now_mono: float | None = None) -> str:
        now_mono = time.monotonic() if now_mono is None else now_mono
        if self.state in (ConnectionState.RECONNECTING, ConnectionState.LOST) and self.retry_at is not None:
            left = max(0, round(self.retry_at - now_mono))
            return (f"{self.state} in {left}s" if self.state == ConnectionState.RECONNECTING
                    else f"lost (retry in {left}s)")
        return str(self.state)


class RunModel:
    """Folds events into state. apply() returns the names of the sections that changed, so the UI
    redraws only those (and only when their tab is visible)."""

    def __init__(self, host: str = "", run_dir: str = ""):
        self.host = host
        self.run_dir = run_dir
        self.state: str = "unknown"
        self.pid: int | None = None
        self.started_at: float | None = None
        self.dispatch: DispatchEvent | None = None
        self.workers: dict[str, WorkerView] = {}
        self.gpus: dict[tuple[str, int], GpuView] = {}  # by (host, index): every host's
        self.shards: dict[str, ShardView] = {}
        self.changed_shards: set[str] = set()  # since the UI last took them (take_changed_shards)
        self.levels = AlertLevels()  # the engine's alert levels (status `levels`): the shards' problem marks
        self.resume_hint = ResumeHint()  # from the run's start record (console.host.start_record), shown with a death
        self._dead_alerted = False  # one death alert per death (the live signal, then the recorded last state)
        self.disks: dict[tuple[str, str], DiskView] = {}  # by (host, path)
        self.alerts: deque[AlertView] = deque(maxlen=ALERTS_KEPT)
        self._alert_by_key: dict[tuple[str, str], AlertView] = {}  # (key, text): one key says several things
        self.rejects = Rejects()
        self.throughput = Series()
        self.last_ts: float | None = None
        self.connection = Connection()
        self.protocol_note = ""  # the engine has no control channel: ops go one process each (console.host.source)
        self.stats: dict[str, Any] | None = None
        self.stats_error: str = ""
        self.stats_at: float | None = None
        self.new_alerts: list[AlertView] = []  # raised since the UI last took them (for notifications)
        self.running: bool | None = None  # a supervisor answers / its events flow; False: it is gone; None: unknown
        self.fatal: FatalRecord | None = None  # the supervisor's recorded cause
        self.run_end: RunEndEvent | None = None
        # when the supervisor was last known gone (its run_end / fatal ts, or a last-status reply's checked_at):
        # history before it (a backfill) folds into the figures but does not change the state
        self.gone_since: float | None = None
        # the data-quality brake: a status reply's (the whole of it), or what a later brake alert said
        self.brake: BrakeStatus | None = None
        self._brake_as_of = 0.0
        # a multi-host run's hosts ([slurm]: each group's job, as squeue said it), from the last status reply
        self.hosts: list[HostStatus] = []
        self.hosts_as_of: float | None = None  # that reply's checked_at: how long a job has waited, as of then
        # what regen has open through the router (a multi-host run), for a server whose own count is not known
        self.router_in_flight: int | None = None

    # -- folding -----------------------------------------------------------------------------
    def apply_all(self, events: Iterable[Event]) -> set[str]:
        changed: set[str] = set()
        for ev in events:
            changed |= self.apply(ev)
        return changed

    def apply(self, ev: Event) -> set[str]:
        if self.last_ts is None or ev.ts > self.last_ts:
            self.last_ts = ev.ts
        if isinstance(ev, WorkerEvent):
            return self._worker(ev)
        if isinstance(ev, GpuEvent):
            key = (ev.host, ev.index)
            g = self.gpus.get(key) or self.gpus.setdefault(key, GpuView(ev.index, ev.host))
            g.name, g.mem_used_mb, g.mem_total_mb = ev.name, ev.mem_used_mb, ev.mem_total_mb
            g.util_pct, g.temp_c, g.power_w, g.error = ev.util_pct, ev.temp_c, ev.power_w, ev.error
            g.mem_history.add(ev.ts, ev.mem_used_mb)
            return {"workers"}
        if isinstance(ev, DispatchEvent):
            return self._dispatch(ev)
        if isinstance(ev, ShardEvent):
            return self._fold_shard(ev, ev.ts)
        if isinstance(ev, DiskEvent):
            return self._disk(ev)
        if isinstance(ev, AlertEvent):
            self.add_alert(AlertView(ev.ts, ev.severity, ev.text, ev.evidence, ev.key or ev.text, "host"))
            if ev.key == BRAKE_ALERT_KEY and ev.ts > self._brake_as_of:
                return {"alerts", "header", "shards", "stats"} | self._brake_alert(ev)
            return {"alerts"}
        if isinstance(ev, FatalEvent):
            fatal = FatalRecord(exc_type=ev.exc_type, message=ev.message, path=ev.path, remedy=ev.remedy,
                                phase=ev.phase, ts=ev.ts)
            if self._before_known_end(ev.ts):
                self._fatal_alert(fatal)  # history of an earlier supervisor: listed, not the state
                return {"alerts"}
            return self._fatal(fatal, ev.ts)
        if isinstance(ev, RunEndEvent):
            if self._before_known_end(ev.ts):
                return set()
            self.run_end, self.running, self.gone_since = ev, False, ev.ts
            self.state = "failed" if self.fatal is not None else ev.state
            return {"header", "workers"}
        return set()

    def _fold_shard(self, sh: ShardFigures, ts: float) -> set[str]:
        """A shard's figures (a shard event's, or a status reply's shard) as of host time ts."""
        sid = sh.id
        figures = (sh.state, sh.done, sh.total, sh.output_tokens, sh.empty, sh.truncated, sh.repetition)
        s = self.shards.get(sid)
        if s is None:
            s = self.shards[sid] = ShardView(sid)
            self.changed_shards.add(sid)
        if s.as_of is not None and ts < s.as_of:
            return set()  # backfilled history older than the figures shown (a status reply's): not current
        s.as_of = ts
        if figures == (s.state, s.done, s.total, s.output_tokens, s.empty, s.truncated, s.repetition) \
                and sid not in self.changed_shards:
            return set()  # a status snapshot repeating what the events said: nothing to redraw
        s.state, s.done, s.total, s.output_tokens, s.empty, s.truncated, s.repetition = figures
        self.changed_shards.add(sid)
        return {"shards"}

    def take_changed_shards(self) -> set[str]:
        """The ids of the shards whose figures changed since the last call (the Shards tab redraws only those)."""
        out, self.changed_shards = self.changed_shards, set()
        return out

    def _brake_alert(self, ev: AlertEvent) -> set[str]:
        """A brake (or its release) the telemetry says before the next status reply gives the whole of it."""
        self._brake_as_of = ev.ts
        base = self.brake or BrakeStatus()
        if ev.severity == "info":
            self.brake = dataclasses.replace(base, engaged=False, since=None, text="", crossed=[], causes=[], remedy="")
        else:
            lines = ev.evidence.splitlines()
            self.brake = dataclasses.replace(
                base, engaged=True, since=ev.ts, text=ev.text.split("dispatch paused run-wide: ", 1)[-1],
                causes=[line.strip()[2:] for line in lines if line.strip().startswith("- ")],
                remedy=lines[-1] if lines else "")
        return set()

    def brake_line(self) -> str:
        """The brake's cause in one line, "" when it is not engaged."""
        b = self.brake
        return f"BRAKED: {b.text}" if b is not None and b.engaged else ""

    def _before_known_end(self, ts: float) -> bool:
        return self.gone_since is not None and ts < self.gone_since

    def _fatal(self, fatal: FatalRecord, gone_since: float) -> set[str]:
        """The supervisor's last word: the header says `failed: <cause>`, the alerts list has it with its evidence."""
        self.fatal, self.running, self.state = fatal, False, "failed"
        self.gone_since = max(self.gone_since or 0.0, gone_since)
        self._fatal_alert(fatal)
        return {"header", "alerts"}

    def _fatal_alert(self, fatal: FatalRecord) -> None:
        ts = fatal.ts or time.time()
        more = (fatal.message or "").splitlines()[1:]  # e.g. the candidates for a missing prompts file
        said = {"path": fatal.path, "remedy": fatal.remedy, "log": fatal.log, "phase": fatal.phase}
        evidence = "\n".join([f"{k}: {v}" for k, v in said.items() if v] + more)
        self.add_alert(AlertView(ts, "critical", f"supervisor failed: {cause_text(fatal)}", evidence,
                                 f"fatal:{fatal.exc_type}:{fatal.message}", "host"))

    def mark_dead(self, ts: float, why: str) -> set[str]:
        """The follow stream ended and nothing answers at the control socket: the supervisor is gone now. Unless it
        said how it ended (run_end, fatal), it died: `dead` at once, no figures, a critical alert with the resume hint
        (the run dir's last status, read next, may still bring a recorded cause). Only a supervisor seen alive dies
        here: attaching to a run that has already ended, its recorded last state says how (apply_status)."""
        if self.running is not True or self.run_end is not None or self.fatal is not None:
            return set()
        self.running, self.state = False, RunState.DEAD
        self.gone_since = max(self.gone_since or 0.0, ts)
        self._dead_alert(ts, why)
        return {"header", "alerts", "workers", "shards"}

    def _dead_alert(self, ts: float, why: str) -> None:
        if self._dead_alerted:
            return
        self._dead_alerted = True
        evidence = "\n".join(x for x in (why, self.resume_hint.text()) if x)
        self.add_alert(AlertView(ts, "critical", "supervisor dead: killed, no cause recorded", evidence,
                                 f"dead:{ts}", "console"))

    def cause_text(self) -> str:
        return cause_text(self.fatal)

    @property
    def gone(self) -> bool:
        """The supervisor is gone (a replay, a finished run): nothing to pause, resume or restart."""
        return self.running is False or self.connection.state == ConnectionState.ENDED

    @property
    def is_running(self) -> bool:
        """False once the run ended or its supervisor is gone: no tok/s, no ETA then."""
        return self.running is not False and self.state not in ENDED_RUN_STATES  # no tok/s, no ETA then

    def state_text(self) -> str:
        return f"failed: {self.cause_text()}" if self.fatal is not None else self.state

    def _worker(self, ev: WorkerEvent) -> set[str]:
        w = self.workers.get(ev.name) or self.workers.setdefault(ev.name, WorkerView(ev.name))
        before = w.state
        w.state, w.gpus, w.pid, w.restarts, w.url = ev.state, list(ev.gpus), ev.pid, ev.restarts, ev.url
        w.running, w.queued, w.tok_s, w.token_usage = ev.running_reqs, ev.queued_reqs, ev.gen_throughput, ev.token_usage
        w.in_flight, w.capacity, w.error, w.held = ev.in_flight, ev.capacity, ev.error, ev.held
        w.in_flight_source, w.node, w.job_id = ev.in_flight_source, ev.node, ev.job_id
        w.batch_size, w.batch_source = ev.batch_size, ev.batch_source
        w.discovered_batch, w.discovered_source = ev.discovered_batch, ev.discovered_source
        w.host, w.remote = getattr(ev, "host", ""), getattr(ev, "remote", False)
        w.prompt_tokens, w.cached_tokens = ev.prompt_tokens, ev.cached_tokens
        w.as_of = ev.ts
        w.tok_history.add(ev.ts, ev.gen_throughput if ev.gen_throughput is not None else
                          (0.0 if ev.state != "ready" else None))
        changed = {"workers"}
        if ev.state in ("crashed", "failed") and before != ev.state:
            self.add_alert(AlertView(ev.ts, "error", f"worker {ev.name} {ev.state}" + (f": {ev.error}" if ev.error else ""),
                                     ev.error or "", f"console.worker:{ev.name}:{ev.state}:{ev.restarts}", "console"))
            changed.add("alerts")
        return changed

    def _dispatch(self, ev: DispatchEvent) -> set[str]:
        if self.dispatch is not None and ev.ts < self.dispatch.ts:
            # backfilled history older than the figures shown (a status reply folded first): a chart point only
            if ev.tokens_per_s is not None:
                self.throughput.add(ev.ts, ev.tokens_per_s)
            return {"workers"}
        if self.gone_since is not None:
            if ev.ts > self.gone_since and ev.state in LIVE_RUN_STATES:  # a new supervisor took the run dir
                self.run_end, self.fatal, self.running, self.gone_since = None, None, True, None
                self.state = ev.state
        else:
            self.state = ev.state
        self.dispatch = ev
        if ev.tokens_per_s is not None:  # None: not measured yet (or not running), no point on the chart
            self.throughput.add(ev.ts, ev.tokens_per_s)
        # the throughput-drop, empty-share and disk alerts are the engine's (engine.telemetry, engine.observe.watch):
        # judged once, with the run's levels, and shown here as the engine sent them
        return {"header", "workers"}

    def _disk(self, ev: DiskEvent) -> set[str]:
        key = (ev.host, ev.path)
        d = self.disks.get(key) or self.disks.setdefault(key, DiskView(ev.path, ev.host))
        d.error = ev.error
        if ev.error is not None:
            return {"disk"}  # no reading: the figures shown go N/A, the history keeps the last real point
        d.free_bytes, d.total_bytes = ev.free_bytes, ev.total_bytes
        d.history.add(ev.ts, ev.free_bytes)
        return {"disk"}

    def add_alert(self, alert: AlertView) -> None:
        # by key and text: a key's alerts with other texts (job 6 submitted, then job 9) come back in every status
        # reply, and each must stay one row
        known = self._alert_by_key.get((alert.key, alert.text))
        if known is not None:
            if alert.ts > known.ts:  # a repeat (or a backfilled copy) of the same alert: count, don't list twice
                known.ts = alert.ts
                known.count += 1
            return
        self.alerts.append(alert)
        self._alert_by_key[(alert.key, alert.text)] = alert
        if len(self._alert_by_key) > 4 * ALERTS_KEPT:
            live = {id(a) for a in self.alerts}
            self._alert_by_key = {k: a for k, a in self._alert_by_key.items() if id(a) in live}
        self.new_alerts.append(alert)

    def take_new_alerts(self) -> list[AlertView]:
        out, self.new_alerts = self.new_alerts, []
        return out

    def apply_status(self, status: RunStatus) -> set[str]:
        """A `status` reply (decoded once by console.host.run_client): the authoritative snapshot (shard list, paused
        state, rejects); engine.ctl last-status's for a run whose supervisor is gone (`running` false, `fatal` its
        recorded cause)."""
        self.running = status.running
        if status.running:
            self.fatal, self.run_end, self.gone_since, self._dead_alerted = None, None, None, False
        else:
            self.gone_since = max(self.gone_since or 0.0, status.checked_at)
            if status.fatal is not None:
                self._fatal(status.fatal, self.gone_since)
        self.state = status.state or self.state
        if not status.running and status.state == RunState.DEAD and status.fatal is None:
            self._dead_alert(status.checked_at, "the run dir records no end: its supervisor was killed")
        self.pid = status.pid
        if status.started_at is not None:
            self.started_at = status.started_at
        self.run_dir = status.run_dir or self.run_dir
        changed = {"header"}
        if status.dispatch is not None and (self.dispatch is None or status.dispatch.ts >= self.dispatch.ts):
            self.dispatch = status.dispatch
        # the shards' figures are as of the reply (committed state then): older backfilled events do not replace them
        as_of = status.dispatch.ts if status.dispatch is not None else status.checked_at
        for ev in status.workers + status.gpus:
            changed |= self._snapshot(ev)
        for sh in status.shards:  # folded as figures, not as 10,000 events: a snapshot every STATUS_EVERY_S
            changed |= self._fold_shard(sh, as_of)
        for disk in status.disk:
            changed |= self._snapshot(disk)
        # the Alerts tab is history: the latest alert events said, and the alerts raised now (a condition raised by an
        # earlier supervisor of the run may be older than every event kept), each once (by key and text)
        for alert in sorted(status.alert_events + status.alerts, key=lambda a: a.ts):
            self.add_alert(AlertView(alert.ts, alert.severity, alert.text, alert.evidence, alert.key or alert.text,
                                     "host"))
            changed.add("alerts")
        self.rejects = status.rejects
        if status.hosts is not None and (status.hosts != self.hosts or self._waiting(status.hosts)):
            self.hosts, self.hosts_as_of = status.hosts, status.checked_at
            changed.add("workers")
        router_in_flight = status.router.in_flight if status.router is not None else None
        if router_in_flight != self.router_in_flight:
            self.router_in_flight = router_in_flight
            changed.add("workers")
        if status.levels != self.levels:
            self.levels = status.levels
            changed |= {"shards"}
        if status.brake is not None and status.checked_at >= self._brake_as_of:
            self.brake, self._brake_as_of = status.brake, status.checked_at
            changed |= {"shards", "stats"}
        return changed

    @staticmethod
    def _waiting(hosts: list[HostStatus]) -> bool:
        """A job waits to start: its wait, shown as of each reply, grows."""
        return any(h.job is not None and h.job.waiting_since is not None and h.job.state != "RUNNING" for h in hosts)

    def _snapshot(self, ev: Event) -> set[str]:
        # a status snapshot updates the current values but does not advance last_ts (the follow position)
        last = self.last_ts
        changed = self.apply(ev)
        self.last_ts = last
        return changed

    # -- derived figures -----------------------------------------------------------------------
    @property
    def done(self) -> int:
        return self.dispatch.done if self.dispatch else sum(s.done for s in self.shards.values())

    @property
    def total(self) -> int:
        return self.dispatch.total if self.dispatch else sum(s.total for s in self.shards.values())

    @property
    def tokens_per_s(self) -> float | None:
        return self.dispatch.tokens_per_s if self.dispatch else None

    def eta_s(self) -> float | None:
        """The engine's ETA (engine.observe.status: committed samples and rate); None until measurable, and when the
        run is not running."""
        d = self.dispatch
        return d.eta_s if d is not None and self.is_running else None

    def elapsed_s(self, now: float | None = None) -> float | None:
        if self.started_at is None:
            return None
        return (time.time() if now is None else now) - self.started_at

    def worker_gpu(self, w: WorkerView) -> dict[str, float | None]:
        """VRAM used/total (sum), util (mean), temperature (max) over the worker's GPUs, as its host's agent read
        them (a worker on the dispatch host: the supervisor's readings, host ""); None = N/A."""
        host = w.host if w.remote else ""
        gs = [self.gpus[(host, i)] for i in w.gpus if (host, i) in self.gpus]

        def agg(vals, how):
            vals = [v for v in vals if v is not None]
            return how(vals) if vals and len(vals) == len(gs) else None

        return {
            "mem_used_mb": agg([g.mem_used_mb for g in gs], sum),
            "mem_total_mb": agg([g.mem_total_mb for g in gs], sum),
            "util_pct": agg([g.util_pct for g in gs], lambda v: sum(v) / len(v)),
            "temp_c": agg([g.temp_c for g in gs], max),
        }

    # -- liveness (console/view/liveness.py): what each figure is worth now ------------------------------------
    def run_liveness(self) -> Liveness:
        """The supervisor's: the source of every live figure."""
        connected = self.connection.state not in (ConnectionState.RECONNECTING, ConnectionState.LOST)
        return of_run(running=self.running, state=self.state, connected=connected, pid=self.pid,
                      lost_since=self.last_ts)

    def host_liveness(self, name: str) -> Liveness | None:
        """A multi-host run's host by name (None: no such host in the last status: a one-host run)."""
        h = next((h for h in self.hosts if h.name == name), None)
        return None if h is None else of_host(self.run_liveness(), name, h.state)

    def worker_liveness(self, w: WorkerView) -> Liveness:
        host = self.host_liveness(w.host) if w.remote and w.host else None
        return of_worker(self.run_liveness(), w.name, w.state, w.as_of, self.last_ts, host)

    def gpu_liveness(self, g: GpuView) -> Liveness:
        """A GPU's readings: its host agent's (a remote host) or the supervisor's."""
        run = self.run_liveness()
        host = self.host_liveness(g.host) if g.host else None
        if host is not None and not host.live and run.live:
            return Liveness(host.freshness, f"{g.label} readings", why=host.why)
        return Liveness(run.freshness, f"{g.label} readings", why=run.why) if not run.live else run

    def next_step(self) -> ResumeHint | None:
        """What to do now that the supervisor is gone, where the operator looks (the TUI's banner, copied on a key):
        the same resume line as `regen status` (the run's start record); None while the run is live, or done."""
        run = self.run_liveness()
        if self.state == RunState.DONE or run.freshness in (Freshness.LIVE, Freshness.STALE):
            return None
        return self.resume_hint

    def paused_shards(self) -> list[str]:
        return sorted(s.id for s in self.shards.values() if s.state == "paused")
