"""The run's figures for Prometheus (GET /metrics on [metrics] host:port), every series read from one RunStatus per
scrape, so it cannot disagree with `regen status`. Committed totals are counters whose value IS the committed total
(a restart resumes them, never from 0); what belongs to one start is a gauge. Served from the supervisor's loop; a
busy port is an alert and a status note, never the run's failure."""
from __future__ import annotations

import dataclasses
import errno
import logging
from collections.abc import Callable, Iterable, Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.config.load import Metrics
from engine.servers.port_holder import holders
from engine.api.status import MetricsStatus, RunStatus
from engine.api.events import AlertEvent
from engine.api.wire import AlertKind, RunState, Severity, ShardState, WorkerState

log = logging.getLogger("regen.metrics")

PATH = "/metrics"
# the text format every Prometheus reads (prometheus-client >= 0.22 says version=1.0.0, which Prometheus 2 does not
# name; regen's names are plain ASCII, so the two formats are the same text)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ALERT_KEY = "metrics-port"
# the shard states shard_state can say (engine.observe.status), each always exported (0 included) so a panel keeps its lines
SHARD_STATES: tuple[str, ...] = (*ShardState, "draining")
SHARE_KINDS = ("empty", "truncated", "repetition", "unclosed_reasoning")


class RunCollector:
    """A prometheus-client collector: each collect() is one status, turned into metric families."""

    def __init__(self, status: Callable[[], RunStatus], per_shard: bool = False):
        self.status = status
        self.per_shard = per_shard

    def collect(self) -> Iterator[Metric]:
        yield from families(self.status(), self.per_shard)


def families(s: RunStatus, per_shard: bool = False) -> Iterable[Metric]:
    """Every regen_ series of one status (their help texts are their meanings)."""
    state = GaugeMetricFamily("regen_run_state", "The run's state: 1 for the state it is in.", labels=["state"])
    for name in RunState:
        state.add_metric([name], 1.0 if s.state == name else 0.0)
    yield state
    if s.started_at is not None:
        yield GaugeMetricFamily("regen_supervisor_start_time_seconds",
                                "When this supervisor started (unix time): it changes at each restart.",
                                value=s.started_at)
    yield from _figures(s)
    yield from _shards(s, per_shard)
    yield from _workers(s)
    yield from _brake(s)
    yield from _rejects_alerts_disk(s)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _figures(s: RunStatus) -> Iterable[Metric]:
    d = s.dispatch
    if d is None:  # the ledger is not loaded yet: no figure rather than a 0 that would read as a counter reset
        return
    yield _counter("regen_samples_done", "Samples committed (rows in committed parts), from state.sqlite.", d.done)
    yield GaugeMetricFamily("regen_samples_planned", "Samples the input plans (generated turns of the good "
                            "conversations).", value=d.planned)
    yield GaugeMetricFamily("regen_samples_to_generate", "Samples to generate: planned less rejected and failed (a "
                            "finished run has done == to_generate).", value=d.total)
    yield _counter("regen_samples_rejected", "Samples never generated because their input cannot be (settled in "
                   "state.sqlite).", d.rejected)
    yield GaugeMetricFamily("regen_samples_failed", "Samples whose retries were spent in this start (the next start "
                            "generates them again).", value=d.failed)
    yield GaugeMetricFamily("regen_requests_in_flight", "Requests sent to the servers and not answered.",
                            value=d.in_flight)
    yield _counter("regen_output_tokens", "Output tokens of the committed samples.", d.output_tokens)
    if d.tokens_per_s is not None:
        yield GaugeMetricFamily("regen_output_tokens_per_second", "Output tokens committed per second over the last "
                                "minute (absent until measurable and when not running).", value=d.tokens_per_s)
    if d.eta_s is not None:
        yield GaugeMetricFamily("regen_eta_seconds", "Seconds left at the committed rate (absent until measurable and "
                                "when not running).", value=d.eta_s)
    if s.shards_omitted:
        return
    kinds = {"empty": sum(sh.empty for sh in s.shards), "truncated": sum(sh.truncated for sh in s.shards),
             "repetition": d.repetition, "unclosed_reasoning": sum(sh.unclosed_reasoning for sh in s.shards)}
    docs = {"empty": "Committed samples whose answer is empty.",
            "truncated": "Committed samples cut at max_new_tokens (finish_reason length).",
            "repetition": "Committed samples the runaway guard stopped (finish_reason repetition).",
            "unclosed_reasoning": "Committed samples whose reasoning block was opened and never closed (not by the "
                                  "runaway guard; a cut at max_new_tokens inside the reasoning counts)."}
    for kind in SHARE_KINDS:
        yield _counter(f"regen_samples_{kind}", docs[kind], kinds[kind])
    share = GaugeMetricFamily("regen_committed_share", "Share of the committed samples of each kind (empty, truncated, "
                              "repetition, unclosed_reasoning); absent before the first commit.", labels=["kind"])
    if d.done:
        for kind in SHARE_KINDS:
            share.add_metric([kind], kinds[kind] / d.done)
    yield share


def _shards(s: RunStatus, per_shard: bool) -> Iterable[Metric]:
    if s.shards_omitted or (s.dispatch is None and not s.shards):
        return
    counts = dict.fromkeys(SHARD_STATES, 0)
    for sh in s.shards:
        counts[sh.state] = counts.get(sh.state, 0) + 1
    by_state = GaugeMetricFamily("regen_shards", "Shards in each state.", labels=["state"])
    for name, n in counts.items():
        by_state.add_metric([name], n)
    yield by_state
    if not per_shard:
        return
    done = CounterMetricFamily("regen_shard_samples_done", "Samples committed, per shard ([metrics] per_shard).",
                               labels=["shard"])
    total = GaugeMetricFamily("regen_shard_samples_to_generate", "Samples to generate, per shard ([metrics] "
                              "per_shard).", labels=["shard"])
    for sh in s.shards:
        done.add_metric([sh.id], sh.done)
        total.add_metric([sh.id], sh.total)
    yield done
    yield total


def _workers(s: RunStatus) -> Iterable[Metric]:
    state = GaugeMetricFamily("regen_worker_state", "Each SGLang server regen launched: 1 for the state it is in.",
                              labels=["worker", "host", "state"])
    in_flight = GaugeMetricFamily("regen_worker_requests_in_flight", "Requests regen has outstanding on the server "
                                  "(behind the router: the router's count of it; absent where not known).",
                                  labels=["worker", "host"])
    capacity = GaugeMetricFamily("regen_worker_capacity_requests", "The server's in-flight target: its batch plus a "
                                 "small queue margin.", labels=["worker", "host"])
    restarts = GaugeMetricFamily("regen_worker_restarts", "Restarts of the server by this supervisor (this start).",
                                 labels=["worker", "host"])
    retracted = GaugeMetricFamily("regen_worker_retracted_requests", "Requests the server retracted since its launch "
                                  "(its sglang:num_retracted_requests_total; absent where the server exports none, "
                                  "SGLang before 0.5.10).", labels=["worker", "host"])
    conservativeness = GaugeMetricFamily("regen_worker_schedule_conservativeness", "The --schedule-conservativeness "
                                         "the server runs with (source: pilot, restart, SGLang default, run.toml or "
                                         "operator flag; absent where not known).",
                                         labels=["worker", "host", "source"])
    for w in s.workers:
        names = [*WorkerState] + ([w.state] if w.state not in tuple(WorkerState) else [])
        for name in names:
            state.add_metric([w.name, w.host, name], 1.0 if w.state == name else 0.0)
        if w.in_flight is not None:  # None: not known (behind a router that keeps no count; its host lost)
            in_flight.add_metric([w.name, w.host], w.in_flight)
        capacity.add_metric([w.name, w.host], w.capacity)
        restarts.add_metric([w.name, w.host], w.restarts)
        if w.retracted is not None:
            retracted.add_metric([w.name, w.host], w.retracted)
        if w.conservativeness is not None:
            conservativeness.add_metric([w.name, w.host, w.conservativeness_source], w.conservativeness)
    yield from (state, in_flight, capacity, restarts, retracted, conservativeness)


def _brake(s: RunStatus) -> Iterable[Metric]:
    b = s.brake
    if b is None:
        return
    yield GaugeMetricFamily("regen_brake_engaged", "1 while the data-quality brake pauses dispatch run-wide.",
                            value=1.0 if b.engaged else 0.0)
    share = GaugeMetricFamily("regen_brake_window_share", "Share of each kind of bad answer over the brake's window "
                              "(the last committed samples; thinking_missing: reasoning missing or unclosed).",
                              labels=["reason"])
    level = GaugeMetricFamily("regen_brake_level", "The share at which the brake engages, per kind.", labels=["reason"])
    for x in b.window:
        share.add_metric([x.reason], x.share)
        level.add_metric([x.reason], x.level)
    yield from (share, level)


def _rejects_alerts_disk(s: RunStatus) -> Iterable[Metric]:
    rejects = CounterMetricFamily("regen_rejects", "Rows of rejects.jsonl (input rows refused when read, samples "
                                  "rejected or failed), by reason.", labels=["reason"])
    for reason, n in sorted(s.rejects.by_reason.items()):
        rejects.add_metric([reason], n)
    yield rejects
    alerts = GaugeMetricFamily("regen_alerts", "Alerts raised now (each condition that still holds, once), by "
                               "severity.", labels=["severity"])
    last = GaugeMetricFamily("regen_alert_last_time_seconds", "When the latest alert of each severity was said, a "
                             "one-shot event or a condition's raise (unix time).", labels=["severity"])
    for sev in Severity:
        alerts.add_metric([sev], sum(1 for a in s.alerts if a.severity == sev))
        said = [a.ts for a in s.alert_events + s.alerts if a.severity == sev and a.kind != AlertKind.CLEARED]
        if said:
            last.add_metric([sev], max(said))
    yield from (alerts, last)
    free = GaugeMetricFamily("regen_disk_free_bytes", "Free space on the run dir's disk (and each host's work dir).",
                             labels=["host", "path"])
    total = GaugeMetricFamily("regen_disk_total_bytes", "Size of that disk.", labels=["host", "path"])
    for x in s.disk:
        if x.error is None:
            free.add_metric([x.host, x.path], x.free_bytes)
            total.add_metric([x.host, x.path], x.total_bytes)
    yield from (free, total)


class MetricsServer:
    """GET /metrics on [metrics] host:port from the supervisor's loop; `state` is what the status says of it."""

    def __init__(self, cfg: Metrics, status: Callable[[], RunStatus], emit: Callable[[AlertEvent], None]):
        self.cfg = cfg
        self.emit = emit
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RunCollector(status, cfg.per_shard))
        self.state = MetricsStatus(enabled=cfg.enabled, address=f"{cfg.host}:{cfg.port}")
        self._runner: web.AppRunner | None = None

    async def start(self) -> MetricsStatus:
        """Serve, or say why not: the state as of now (a copy)."""
        await self._start()
        return dataclasses.replace(self.state)

    async def _start(self) -> None:
        if not self.cfg.enabled:
            return
        app = web.Application()
        app.router.add_get(PATH, self._serve)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.cfg.host, self.cfg.port).start()
        except OSError as exc:
            await runner.cleanup()
            self._refused(exc)
            return
        self._runner = runner
        port = runner.addresses[0][1]  # the bound one: [metrics] port = 0 lets the system pick
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        self.state.address = f"{self.cfg.host}:{port}"
        self.state.url = f"http://{host}:{port}{PATH}"
        log.info("metrics served at %s", self.state.url)

    def _refused(self, exc: OSError) -> None:
        """The port is busy (or the address cannot be bound): said, named, and the run goes on."""
        where = f"{self.cfg.host}:{self.cfg.port}"
        if exc.errno == errno.EADDRINUSE:
            found, note = holders(self.cfg.host, self.cfg.port)
            who = ", ".join(h.describe() for h in found) or f"a process regen cannot name ({note})"
            self.state.error = f"port {self.cfg.port} is busy (held by {who}); set [metrics] port to a free one"
        else:
            self.state.error = f"cannot bind {where}: {exc}; check [metrics] host and port"
        log.warning("metrics not served: %s", self.state.error)
        self.emit(AlertEvent(severity=Severity.WARNING, key=ALERT_KEY, kind=AlertKind.RAISED,
                             text=f"Prometheus metrics not served on {where}: the run goes on without them",
                             evidence=self.state.error))

    async def _serve(self, request: web.Request) -> web.Response:
        try:
            body = generate_latest(self.registry)
        except Exception as exc:  # a scrape that cannot be answered says why (and the traceback goes to the log)
            log.exception("metrics scrape failed")
            return web.Response(status=500, text=f"regen: the status could not be read: {type(exc).__name__}: {exc}\n")
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            self.state.url = None
            self.state.error = "the supervisor is shutting down"
