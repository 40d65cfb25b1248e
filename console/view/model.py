"""The console's data model: telemetry events (console.view.event_fold) and status replies folded into the current
state plus bounded history, and what each figure is worth now (console.view.liveness). No Textual: the TUI and the
CLI read it, tests drive it directly. A missing number (no NVML, a silent worker) is None, shown as N/A."""
from __future__ import annotations

import time

from console.view.event_fold import EventFold
from console.view.liveness import Freshness, Liveness, of_host, of_run, of_worker
from console.view.model_parts import AlertView, ConnectionState, GpuView, ResumeHint, WorkerView
from engine.api.events import Event
from engine.api.status import HostStatus, RunStatus
from engine.api.wire import RunState, ShardState


class RunModel(EventFold):
    """The event fold with the status reply's, the derived figures and each figure's liveness (the UI reads these)."""

    def __init__(self, host: str = "", run_dir: str = ""):
        super().__init__(host, run_dir)
        self._run_liveness: tuple[tuple[object, ...], Liveness] | None = None  # (what it was judged on, the verdict)
        self._hosts_by_name: tuple[list[HostStatus], dict[str, HostStatus]] | None = None  # (of which list, index)

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
        if status.slurm_groups != self.slurm_groups:
            self.slurm_groups = status.slurm_groups
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
        """The supervisor's: the source of every live figure. Judged again only when what it is judged on changed (the
        Workers tab asks once per worker per redraw)."""
        connected = self.connection.state not in (ConnectionState.RECONNECTING, ConnectionState.LOST)
        key = (self.running, self.state, connected, self.pid, self.last_ts)
        if self._run_liveness is None or key != self._run_liveness[0]:
            self._run_liveness = (key, of_run(running=self.running, state=self.state, connected=connected,
                                              pid=self.pid, lost_since=self.last_ts))
        return self._run_liveness[1]

    def host_liveness(self, name: str) -> Liveness | None:
        """A multi-host run's host by name (None: no such host in the last status: a one-host run)."""
        if self._hosts_by_name is None or self._hosts_by_name[0] is not self.hosts:  # a status reply replaced them
            index: dict[str, HostStatus] = {}
            for host in self.hosts:
                index.setdefault(host.name, host)
            self._hosts_by_name = (self.hosts, index)
        h = self._hosts_by_name[1].get(name)
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
        return sorted(s.id for s in self.shards.values() if s.state == ShardState.PAUSED)
