"""The console's model, first half: its state, and each telemetry event folded into it (workers, GPUs, dispatch
figures, shards, disks, alerts, the brake, a fatal error, a death). console.view.model adds the status reply's fold,
the derived figures and the liveness of each; no Textual here."""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Iterable

from console.view.model_parts import (ALERTS_KEPT, AlertView, Connection, ConnectionState, DiskView, GpuView,
                                      ResumeHint, ShardView, WorkerView, cause_text)
from console.view.series import Series
from engine.api.brake import BRAKE_ALERT_KEY, BrakeStatus
from engine.api.events import (AlertEvent, DiskEvent, DispatchEvent, Event, FatalEvent, GpuEvent, RunEndEvent,
                               ShardEvent, WorkerEvent)
from engine.api.status import FatalRecord, HostStatus, Rejects, SlurmGroups
from engine.api.reports import RunStats
from engine.api.wire import (ENDED_RUN_STATES, LIVE_RUN_STATES, AlertLevels, RunState, Severity, ShardFigures,
                             WorkerState)


class EventFold:
    """The model's state and its fold of telemetry events. apply() returns the names of the sections that changed, so
    the UI redraws only those (and only when their tab is visible)."""

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
        self.stats: RunStats | None = None
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
        self.slurm_groups: SlurmGroups | None = None  # a [slurm] run's groups granted / pending of those wanted
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
        if ev.severity == Severity.INFO:
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
        w.retracted, w.conservativeness, w.conservativeness_source = (ev.retracted, ev.conservativeness,
                                                                      ev.conservativeness_source)
        w.as_of = ev.ts
        w.tok_history.add(ev.ts, ev.gen_throughput if ev.gen_throughput is not None else
                          (0.0 if ev.state != WorkerState.READY else None))
        changed = {"workers"}
        if ev.state in (WorkerState.CRASHED, WorkerState.FAILED) and before != ev.state:
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
