"""The supervisor process on the training host: `python -m engine.supervisor --run-dir D`.

It reads D/run.toml, verifies the run dir (a changed content hash is refused), recovers the shard
store, takes the pid file, serves the control socket, launches one SGLang server per GPU group
(or, with [[hosts]], a fleet behind one router), and composes the run wing (engine.run: feed → ledger →
dispatcher → committer → ledger; a finished shard compacted into one file) until every sample is settled, or
until drain / stop / SIGTERM. Its start checks (engine.servers.startup) are in its status reply until they pass.

It never dies without saying why: a fatal error is written to D/fatal.json (engine.fatal: type,
message, path, remedy) and emitted as a `fatal` telemetry event, and every exit ends with one
`run_end` event (done | drained | stopped | failed). A full disk degrades logging and telemetry
(engine.safe_log, engine.telemetry) instead of ending the run, and a reserve file is given up to
make room for the last words.

Exit codes:
  0  done, drained or stopped
  1  the run failed: every worker failed, an OS error (a full disk), an internal error (fatal.json)
  2  unusable run config or run dir (ConfigError, RunDirError)
  3  the content config changed: refused to resume (ConfigChanged)
  4  another supervisor holds the run dir (nothing written: the run dir is that supervisor's)
  5  the run's input cannot be read: prompt files (PromptFileError) or tokenizer / model dir (RenderError)
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import os
import shlex
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import psutil

from engine import safe_log
from engine.config.load import ConfigError, RunConfig, load_config, resolve_sampling
from engine.control import ControlError, ControlServer
from engine.fatal import (PREVIOUS_FILE, FatalWriteError, RunRefused, SpaceReserve, WorkersFailed, archive_previous,
                          fallback_path, is_disk_full, record_for, write_fatal)
from engine.api.status import FatalRecord, HostStatus, Rejects, RunStatus
from engine.servers.gpu import GpuSampler
from engine.servers.gpu_sim import SimGpuReader
from engine.http_client import client_session
from engine.text.ingest import PromptFileError
from engine.notify import Notifier
from engine.text.render import Renderer, RenderError
from engine.store.rejects import RejectLog
from engine.store.manifest import ManifestError, write_run_manifest
from engine.store.run_dir import ConfigChanged, RunDirError, prepare_run_dir
from engine.store.shard_store import ShardStore
from engine.servers.startup import StartupChecks, open_prompt_files
from engine.telemetry import Telemetry
from engine.api.brake import BRAKE_ALERT_KEY, BrakeStatus
from engine.run.committer import Committer
from engine.run.compactor import Compactor
from engine.api.ops import (Drain, DrainHost, LogTail, LogText, Op, Pause, RestartWorker, Resume, RunEnding,
                            ShardsChanged, Status, Stop, UndrainHost, WireReply, WorkerRestarted)
from engine.run.dispatcher import Dispatcher
from engine.observe.metrics_server import ALERT_KEY as METRICS_ALERT_KEY, MetricsServer
from engine.run.feed import Feed
from engine.run.items import Generated, Outcome
from engine.run.ledger import Ledger
from engine.run.refusals import RefusalTrip
from engine.run.prompt_limit import tightest
from engine.observe.status import build_run_status, dispatch_figures, levels_of, shard_statuses
from engine.observe.watch import RunWatch
from engine.api.events import AlertEvent, DispatchEvent, RunEndEvent, ShardEvent
from engine.api.wire import ALREADY_SETTLED, AlertKind, FINAL_RUN_STATES, RunState, Severity, ShardFigures
from engine.placement.fleet import Fleet
from engine.placement.hosts.link import HostError, RemoteWorker
from engine.servers.workers import Worker, WorkerState, log_tail, worker_specs
from probes.context import is_rehearsal

log = logging.getLogger("regen.supervisor")

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_CHANGED, EXIT_LOCKED, EXIT_INPUT = 0, 1, 2, 3, 4, 5
# the exit code of a fatal exception (first match in its MRO); anything else is EXIT_FAILED
EXIT_FOR = ((ConfigChanged, EXIT_CHANGED), (ConfigError, EXIT_CONFIG), (RunDirError, EXIT_CONFIG),
            (PromptFileError, EXIT_INPUT), (RenderError, EXIT_INPUT))
TICK_S = 2.0
QUALITY_EVERY_S = 10.0
GPU_ERROR_EVERY_S = 60.0
STOP_ABORT_WAIT_S = 15.0
LOG_TAIL_TIMEOUT_S = 20.0  # a log_tail of a [[hosts]] server: one ssh to its host
# young-generation collections after startup: each answer allocates a few dozen short-lived containers
# (request, response, futures, the row) that live across awaits; with the default 700 they are walked
# ~every 15 answers, mostly while still alive. Fewer, larger young collections walk less of them.
GC_THRESHOLDS = (20_000, 20, 10)
T = TypeVar("T")


def _made(part: T | None, what: str) -> T:
    """A part of the run (the feed, the ledger, the dispatcher ...) where the supervisor has made it already: only a
    bug reaches the error."""
    if part is None:
        raise RuntimeError(f"the supervisor's {what} is used before it was made")
    return part


class Supervisor:
    def __init__(self, cfg: RunConfig, run_dir: Path, telemetry: Telemetry, startup: StartupChecks | None = None,
                 notifier: Notifier | None = None):
        self.cfg = cfg
        self.run_dir = run_dir
        self.started_at = time.time()
        self.mode = RunState.STARTING  # the supervisor's own phase; `paused` and `disk_full` are read from the ledger
        self.phase = "start"  # start | run | shutdown: where a fatal error happened
        self.exit_code = EXIT_OK
        self.fatal_exc: BaseException | None = None  # why the run failed, when it did
        self.fatal_phase = "start"
        self.end_how = ""  # drain | stop | done | failed: how the run ended
        self.end_cause = ""  # who ended it (an operator's stop, a signal, every sample settled, the failure)
        self.startup = startup or StartupChecks()
        self.telemetry = telemetry
        self.emit = self.telemetry.emit
        self.notifier = notifier  # started and closed by _load_and_run: it must outlive the fatal / run_end events
        self._exit = asyncio.Event()
        self._ready_seen = asyncio.Event()  # a server became ready (the feed starts at the first)
        self._shutdown_task: asyncio.Task | None = None
        self._dirty_shards: set[str] = set()
        self._shard_states: dict[str, str] = {}  # the state each shard's last event said
        self._tasks: list[asyncio.Task] = []
        self._last_quality = 0.0  # monotonic time of the last data-quality check
        self._last_gpu = -1e9  # ... and of the last GPU reading (NVML missing: once a minute, to say why)
        self.sim_gpus: SimGpuReader | None = None  # a rehearsal without NVML: the simulators' modelled GPUs
        self.workers: Sequence[Worker | RemoteWorker] = []  # every server: a fleet's (engine.placement) or _local
        self._local: list[Worker] = []  # the servers this supervisor launches and stops itself (no fleet)
        self.watch = RunWatch(cfg, run_dir, telemetry)
        self.feed: Feed | None = None
        self.ledger: Ledger | None = None
        self.dispatcher: Dispatcher | None = None
        self.committer: Committer | None = None
        self.compactor: Compactor | None = None
        self.fleet: Fleet | None = None
        self.metrics: MetricsServer | None = None

    # -- main -------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.store = ShardStore(self.run_dir)
        removed = self.store.recover()
        if removed:
            log.info("recovered the shard store: removed %d uncommitted files: %s", len(removed), ", ".join(removed[:10]))
        # the alerts an earlier supervisor raised stay raised (not said again) until their condition is judged again
        self.telemetry.keep_alerts(self.store)
        self.rejects = RejectLog(self.run_dir)
        self.control = ControlServer(self.run_dir / "control.sock", self.handle)
        await self.control.start()
        self.metrics = MetricsServer(self.cfg.metrics, self.status, self.emit)
        served = await self.metrics.start()  # a busy port is an alert and a status note, not the run's end
        if served.error is None:  # an earlier supervisor's busy port is not this one's
            self.telemetry.clear(METRICS_ALERT_KEY, f"cleared: Prometheus metrics served at {served.url}"
                                 if served.url else "cleared: Prometheus metrics not asked for ([metrics] enabled = false)")
        try:
            return await self._run()
        finally:
            await self.metrics.close()
            await self.control.close()

    async def _run(self) -> int:
        early = self._launch_early()
        try:
            await self._open_inputs()
        except BaseException:
            await self._close_early(early)  # the servers launched first must not outlive a failed start
            raise
        if self._shutdown_task is not None:
            log.info("stopped before dispatch began" if early else "stopped before any worker was launched")
            await self._shutdown_task
            await self._close_early(early)
            return self.exit_code
        ledger = _made(self.ledger, "ledger")
        if ledger.finished:
            log.info("every sample is already settled (%d done): nothing to generate", ledger.done)
            self.startup.ok("workers", "none launched: every sample is already settled")
            self.mode = RunState.DONE
            self.end_how, self.end_cause = "done", ALREADY_SETTLED
            await self._close_early(early)
            # a shard finished by the last start and not yet compacted (it was stopped or killed first)
            await Compactor(self.store, ledger, self.emit).drain()
            self._tick_once(final=True)
            return EXIT_OK
        self.gpu = GpuSampler()
        if self.gpu.init_error:
            log.warning("%s (GPU readings will show N/A)", self.gpu.init_error)
        if not early:
            self.session = client_session()
        if not self.gpu.available and not self._placed() and is_rehearsal(self.cfg.workers.launch):
            # a rehearsal: the simulators' modelled GPUs stand in, named as simulated
            self.sim_gpus = SimGpuReader(self.session, lambda: self._local)
        try:
            store_cfg = self.cfg.store
            self.committer = Committer(self.store, ledger, self.emit, max_rows=store_cfg.part_max_rows,
                                       max_age_s=store_cfg.part_max_age_s, disk_ok=self.watch.disk_ok_for_commit)
            self.compactor = Compactor(self.store, ledger, self.emit, disk_ok=self.watch.disk_ok_for_commit)
            targets = self._fleet_targets() if self._placed() else self._local_targets(early)
            self.dispatcher = Dispatcher(self.cfg, ledger, targets, self._deliver, self.renderer, self.session,
                                         self.emit)
            for w in targets:
                w.listeners.append(self._on_target_state)
                w.served = ledger.served_for(w.name)
            await self._launch(early)
            # the startup heap (transformers, the tokenizer, every module) lives as long as the process:
            # keep it out of the full collections the per-answer garbage triggers (each walked ~10^6
            # objects, ~30 ms, a few times per 10^7 tokens)
            gc.collect()
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLDS)
            self.dispatcher.start()
            self._tasks = [
                asyncio.create_task(self.committer.run_forever(), name="committer"),
                asyncio.create_task(self._compact_after_first_dispatch(), name="compactor"),
                asyncio.create_task(self._monitor(), name="monitor"),
                asyncio.create_task(self._start_feed_when_ready(), name="feed"),
            ]
            if self.sim_gpus is not None:
                self._tasks.append(asyncio.create_task(self._poll_sim_gpus(), name="sim-gpus"))
            for task in self._tasks:
                task.add_done_callback(self._task_ended)
            self.phase = "run"
            await self._exit.wait()
            return self.exit_code
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self.dispatcher is not None:
                await self.dispatcher.close()
            if self.fleet is not None:
                await self.fleet.stop()
            await asyncio.gather(*(w.stop() for w in self.workers if isinstance(w, Worker)), return_exceptions=True)
            self.gpu.close()
            _made(self.feed, "feed").close()
            await self.session.close()

    def _placed(self) -> bool:
        """The servers are placed elsewhere ([[hosts]] over SSH, or [slurm] jobs) behind a router."""
        return bool(self.cfg.hosts) or self.cfg.slurm is not None

    # -- topologies: local workers (one server per GPU group) or a fleet of hosts behind a router ---------
    def _launch_early(self) -> bool:
        """Local servers are launched before the inputs are opened: they load (minutes for SGLang, ~1.5 s for
        the simulator) while the tokenizer loads and the prompts are counted, instead of after. Not when the
        store says every sample is settled (a start with nothing to do launches nothing)."""
        if self._placed() or self._looks_finished():
            return False
        self.session = client_session()
        self.workers = self._local = self._make_workers()
        for w in self._local:
            w.start()
        return True

    def _make_workers(self) -> list[Worker]:
        workers = [Worker(spec=s, cfg=self.cfg, run_dir=self.run_dir, session=self.session, emit=self.emit)
                   for s in worker_specs(self.cfg)]
        for w in workers:
            w.listeners.append(self._on_worker_state)
        return workers

    def _local_targets(self, early: bool) -> list[Worker]:
        if not early:
            self.workers = self._local = self._make_workers()
        return self._local

    def _fleet_targets(self) -> list:
        self.fleet = Fleet(self.cfg, self.run_dir, self.session, self.emit)
        self.fleet.on_change = self._resize
        self.fleet.on_failed = self._fail
        self.workers = self.fleet.workers
        return [self.fleet.endpoint]

    async def _launch(self, early: bool) -> None:
        if self.fleet is not None:
            await self.fleet.start()
            self.startup.ok("workers", f"router up; {len(self.workers)} servers on {len(self.fleet.links) or len(self.cfg.hosts)} hosts"
                                       " launching")
        elif early:
            for w in self.workers:
                if w.state == WorkerState.READY:  # became ready while the prompts were counted
                    self._on_target_state(w, w.state)
        else:
            for w in self._local:
                w.start()

    async def _open_inputs(self) -> None:
        """Prompt files open, tokenizer loaded, prompts counted, the ledger opened on the store: each a start
        check; the first error is fatal."""
        cfg = self.cfg
        self.startup.ok("prompts", await asyncio.to_thread(open_prompt_files, cfg.prompts))
        self.renderer = await asyncio.to_thread(
            Renderer, cfg.tokenizer_path, enable_thinking=cfg.enable_thinking, context_length=cfg.context_length)
        self.startup.ok("tokenizer", f"{cfg.tokenizer_path} (context {self.renderer.context_length})")
        self.feed = feed = Feed(cfg, self.renderer, self.rejects)
        self.startup.ok("count", "counting the prompts")
        bad = await asyncio.to_thread(feed.count_stream)
        feed.finish_count(bad)
        self.ledger = ledger = Ledger(cfg, feed.planned, self.store, self.rejects)
        ledger.open()
        feed.attach(ledger)
        ledger.build_turn = feed.build_turn
        ledger.on_resume = feed.rescan
        ledger.want_more = feed.wake
        ledger.changed = self._dirty_shards.add
        ledger.on_brake = self._on_brake
        ledger.on_refused = self._on_refused
        self._dirty_shards.update(ledger.shards)
        if ledger.brake_note:
            log.info("data-quality brake: %s", ledger.brake_note)
        # kept from the last supervisor, or taken on the store's last samples at this start (ledger.braked: at open only
        # the brake can hold, the servers' refusals are counted from this start on)
        if (engaged := ledger.brake.engaged) is not None:
            self._on_brake(engaged, True)
        else:  # an earlier supervisor's brake alert, and the brake is off now (lifted by a changed [brake])
            self.telemetry.clear(BRAKE_ALERT_KEY, "cleared: data-quality brake: not engaged at this start",
                                 ledger.brake_note)
        log.info("plan: %d samples in %d shards (%d already committed), %d bad input rows, %s", ledger.total,
                 len(ledger.shards), ledger.done, feed.input_rejects, feed.counted())
        self.startup.ok("count", f"{ledger.total} samples in {len(ledger.shards)} shards ({ledger.done} already done)")

    def _deliver(self, outcome: Outcome) -> None:
        """The dispatcher's outcomes: an answer to the committer, every other outcome to the ledger."""
        committer, ledger = self.committer, self.ledger
        if committer is None or ledger is None:
            raise RuntimeError("an outcome is delivered before the committer and the ledger were made")
        if isinstance(outcome, Generated):
            committer.add(outcome)
            ledger.generated(outcome.item)
        else:
            ledger.settle(outcome)

    def _on_brake(self, status: BrakeStatus, engaged: bool) -> None:
        """The ledger braked (or released the brake): the operator is told why, with the numbers and the causes."""
        if engaged:
            self.emit(AlertEvent(severity=Severity.ERROR, key=BRAKE_ALERT_KEY, kind=AlertKind.RAISED,
                                 text=f"data-quality brake: dispatch paused run-wide: {status.text}",
                                 evidence=status.evidence()))
        else:
            self.telemetry.clear(BRAKE_ALERT_KEY,
                                 "cleared: data-quality brake released by resume --all; its window starts over",
                                 f"it braked on: {status.text}")

    def _on_refused(self, trip: RefusalTrip) -> None:
        """The servers refuse the run's requests run-wide: a critical alert quoting them, and the run fails."""
        self.emit(AlertEvent(severity=Severity.CRITICAL, key="refused", text=trip.text(), evidence=trip.evidence()))
        self._fail(RunRefused(f"{trip.text()}; likely config key: {trip.key}", self.cfg.source_path))

    def _update_workers_check(self) -> None:
        """`workers launched`: every server launched (a pid, its port was free); refused or failed ones fail it."""
        ws = [w for w in self.workers if isinstance(w, Worker)]
        if not ws:
            return
        bad = [w for w in ws if w.state in (WorkerState.REFUSED, WorkerState.FAILED)]
        if bad:
            self.startup.failed("workers", "; ".join(f"{w.name} {w.state}: {w.error or 'no error text'}" for w in bad))
            return
        if self.startup.checks["workers"].state == "ok":
            return  # passed: later crashes and restarts are the run's, shown as worker states and alerts
        live = (WorkerState.STARTING, WorkerState.LOADING, WorkerState.READY)
        if all(w.pid is not None and w.state in live for w in ws):
            self.startup.ok("workers", ", ".join(f"{w.name} pid {w.pid} on {w.spec.host}:{w.spec.port} ({w.state})"
                                                 for w in ws))
        else:
            self.startup.set("workers", "pending", "; ".join(
                f"{w.name} {w.state}" + (f": {w.error}" if w.error else "") for w in ws
                if w.pid is None or w.state not in live))

    def _task_ended(self, task: asyncio.Task) -> None:
        """A supervisor task must not die unnoticed: its exception fails the run, with that cause."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        log.error("task %s failed: the run stops", task.get_name(), exc_info=exc)
        self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self.fatal_exc is None:
            self.fatal_exc, self.fatal_phase = exc, self.phase
        self._begin_shutdown("failed")

    def _looks_finished(self) -> bool:
        """Every shard's committed samples reach its planned samples (from the last count): a start
        with nothing to do launches no server before the count says so."""
        progress = self.store.progress()
        return bool(progress) and all(p.total_samples is not None and p.done_samples + p.rejected >= p.total_samples
                                      for p in progress)

    async def _close_early(self, early: bool) -> None:
        """Servers launched before the count, when the run ends before dispatch: stopped."""
        if self.feed is not None:
            self.feed.close()
        if early:
            await asyncio.gather(*(w.stop() for w in self._local), return_exceptions=True)
            await self.session.close()

    async def _compact_after_first_dispatch(self) -> None:
        """The compactor's periodic task, from the first request on: a resumed run may find hundreds of shards
        the last start finished and did not compact, and their rewrites (a thread on the supervisor's core)
        slowed the servers' launch-to-dispatch path; a run that never dispatches compacts at its end."""
        await _made(self.dispatcher, "dispatcher").first_sent.wait()
        await _made(self.compactor, "compactor").run_forever()

    async def _start_feed_when_ready(self) -> None:
        while not any(w.state == WorkerState.READY for w in self.workers):
            # woken by the first ready state a listener sees (a resume's first dispatch waited up to 0.2 s
            # more); the timeout covers a multi-host run's servers, whose states come with the router's
            self._ready_seen.clear()
            try:
                await asyncio.wait_for(self._ready_seen.wait(), 0.2)
            except asyncio.TimeoutError:
                pass
        self._tighten_prompt_limit()
        if self.mode == RunState.STARTING:
            self.mode = RunState.RUNNING
            _made(self.ledger, "ledger").dispatch_began()
            _made(self.dispatcher, "dispatcher").hold(self.watch.disk_full)
        await _made(self.feed, "feed").feed_forever()

    def _on_target_state(self, w, state: str) -> None:
        """A dispatch target (a worker, or the router of a multi-host run) changed state."""
        if state == WorkerState.READY:
            self._ready_seen.set()
            self._resize()

    def _tighten_prompt_limit(self) -> None:
        """The feed's prompt limit: SGLang's rule with the smallest figures any server has reported."""
        if self.feed is None:
            return
        limit = tightest(self.feed.limit, ((w.name, w.capacity_info) for w in self.workers))
        if limit != self.feed.limit:
            log.info("prompts of %d tokens or more are rejected up front (was %d): %s", limit.max_input_len,
                     self.feed.limit.max_input_len, limit.source)
            self.feed.use_limit(limit)

    def _resize(self) -> None:
        """Size the in-flight caps and the ledger's look-ahead to the ready capacity (also when servers
        join or leave the router), and the feed's prompt limit to what the servers reported."""
        self._tighten_prompt_limit()
        if self.dispatcher is not None and self.ledger is not None:
            self.dispatcher.adjust_capacity()
            self.ledger.size_for(sum(self.dispatcher.capacity_for(x) for x in self.dispatcher.workers
                                     if x.state == WorkerState.READY))

    def _on_worker_state(self, w: Worker, state: str) -> None:
        if state == WorkerState.READY:
            self._ready_seen.set()
            # its own server serves: a refusal an earlier supervisor raised for it ended (this one's own refusal is
            # cleared by the worker when the port is free again)
            self.telemetry.clear(f"worker:{w.name}:refused", f"worker {w.name}: its own server is ready", w.url)
        self._update_workers_check()
        if state == WorkerState.FAILED and all(x.state == WorkerState.FAILED for x in self.workers):
            evidence = "; ".join(f"{x.name}: {x.error}" for x in self.workers)
            self.emit(AlertEvent(severity=Severity.CRITICAL, text="every worker failed: the run stops",
                                 evidence=evidence, key="all-failed"))
            self._fail(WorkersFailed(f"every worker failed: {evidence}", str(self.run_dir / "workers")))

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("%s received: stopping", sig.name)
        self.end_cause = self.end_cause or f"{sig.name} received"
        self._begin_shutdown("stop")

    # -- control ops ------------------------------------------------------------------------
    async def handle(self, op: Op) -> WireReply:
        """One control op (engine.api.ops), one method each, returning the op's Reply type; ControlError's text is the
        reply's error."""
        match op:
            case Status():
                status = self.status()
                if not op.shards:
                    status = dataclasses.replace(status, shards=[], shards_omitted=True)
                return status
            case Pause() | Resume():
                return self._set_paused(op)
            case RestartWorker():
                return self._restart_worker(op)
            case DrainHost() | UndrainHost():
                return self._set_host_drained(op)
            case LogTail():
                return await self._log_tail(op)
            case Drain() | Stop():
                return self._end_on_request(op)
        raise ControlError(f"unknown op {op!r}")

    def _needs_ledger(self) -> Ledger:
        if self.ledger is None:
            raise ControlError("the supervisor is still starting (counting prompts); try again in a moment")
        return self.ledger

    def _set_paused(self, op: Pause | Resume) -> ShardsChanged:
        ledger = self._needs_ledger()
        try:
            changed = ledger.set_paused(None if op.shards is None else list(op.shards), isinstance(op, Pause))
        except KeyError as exc:
            raise ControlError(exc.args[0]) from exc
        log.info("%s %s", op.op, "all" if op.shards is None else list(op.shards))
        braked = ledger.brake.engaged
        return ShardsChanged(op=op.op, shards=sorted(changed), paused=sorted(ledger.paused), state=self.state(),
                             brake=braked.text if braked is not None else None)

    def _worker(self, name: str) -> Worker | RemoteWorker:
        found = next((w for w in self.workers if w.name == name), None)
        if found is None:
            raise ControlError(f"unknown worker {name!r}; workers: {', '.join(w.name for w in self.workers)}")
        return found

    def _restart_worker(self, op: RestartWorker) -> WorkerRestarted:
        self._needs_ledger()
        found = self._worker(op.worker)
        try:
            found.restart()
        except NotImplementedError as exc:
            raise ControlError(str(exc)) from exc
        log.info("restart of worker %s requested", op.worker)
        return WorkerRestarted(worker=op.worker, state=found.state)

    async def _log_tail(self, op: LogTail) -> LogText:
        found = self._worker(op.worker)
        if isinstance(found, Worker):
            path = found.log_path
            return LogText(worker=op.worker, path=str(path),
                           text="\n".join(await asyncio.to_thread(log_tail, path, 0, op.lines)))
        assert self.fleet is not None  # a worker not of this machine is a fleet member
        link = self.fleet.link_of(found)
        path, where = link.server_log(found), link.server_log_where(found)
        try:
            rc, out, err = await link.ssh(f"tail -n {op.lines} -- {shlex.quote(path)}", timeout=LOG_TAIL_TIMEOUT_S)
        except HostError as exc:
            raise ControlError(f"tail {where}: {exc}") from exc
        if rc != 0:
            raise ControlError(f"tail {where}: exit status {rc}: {err.strip() or '(no stderr)'}")
        return LogText(worker=op.worker, path=where, text=out)

    def _set_host_drained(self, op: DrainHost | UndrainHost) -> HostStatus:
        if self.fleet is None:
            raise ControlError("drain_host: this run has no [[hosts]]")
        try:
            return self.fleet.set_drained(op.host, isinstance(op, DrainHost))
        except KeyError as exc:
            raise ControlError(exc.args[0]) from exc

    def _end_on_request(self, op: Drain | Stop) -> RunEnding:
        if isinstance(op, Drain):
            self.end_cause = self.end_cause or "drain requested over the control socket (regen stop --drain)"
        else:
            self.end_cause = self.end_cause or "stop requested over the control socket (regen stop)"
        self._begin_shutdown(op.op)
        return RunEnding(state=self.state())

    def state(self) -> RunState:
        if self.mode != RunState.RUNNING:
            return self.mode
        if self.watch.disk_full or (self.ledger is not None and self.ledger.all_paused):
            return RunState.PAUSED
        return RunState.RUNNING

    def dispatch_state(self) -> RunState:
        return RunState.DISK_FULL if self.watch.disk_full and self.mode == RunState.RUNNING else self.state()

    def status(self) -> RunStatus:
        t = self.telemetry
        self._update_workers_check()
        ledger, d = self.ledger, self.dispatcher
        write_errors = safe_log.failures() + ([f"{t.path}: {t.write_error} ({t.dropped} events not written)"]
                                              if t.write_error else []) + (
            [f"the raised alerts' record ({self.run_dir / 'state.sqlite'}): {t.raised.write_error}"]
            if t.raised.write_error else [])
        fleet = self.fleet
        return build_run_status(
            run_dir=str(self.run_dir), state=self.state(), dispatch_state=self.dispatch_state(),
            shards=ledger.shards if ledger is not None else None, paused=ledger.paused if ledger is not None else (),
            rate=ledger.rate if ledger is not None else None, in_flight=d.in_flight if d is not None else 0,
            retried=d.retried if d is not None else 0, dispatched=d.dispatched if d is not None else None,
            last_dispatch=t.dispatch, rejects=Rejects(self.rejects.count, self.rejects.counts_by_reason()),
            running=True, phase=self.phase, startup=self.startup.in_order(), write_errors=write_errors,
            pid=os.getpid(), started_at=self.started_at, config_hash=self.cfg.content_hash(), levels=levels_of(self.cfg),
            host=socket.gethostname(), log=str(self.run_dir / "supervisor.log"),
            workers=[w.snapshot() for w in self.workers], gpus=list(t.gpus.values()), disk=list(t.disk.values()),
            alerts=t.raised_alerts(), alert_events=list(t.alerts), hosts=fleet.host_statuses() if fleet is not None else None,
            router=fleet.router_status() if fleet is not None else None,
            brake=ledger.brake.status() if ledger is not None else None,
            metrics=dataclasses.replace(self.metrics.state) if self.metrics is not None else None)

    # -- shutdown ---------------------------------------------------------------------------
    def _begin_shutdown(self, how: str) -> None:
        if self._shutdown_task is not None:
            if how == "stop" and self.mode == RunState.DRAINING:
                self._shutdown_task.cancel()  # stop overrides a drain in progress
            else:
                return
        if how in ("drain", "stop") and self.mode not in FINAL_RUN_STATES:
            self.mode = RunState.DRAINING if how == "drain" else RunState.STOPPING
            if self.dispatcher is not None:
                self.dispatcher.hold(True)
        self._shutdown_task = asyncio.get_running_loop().create_task(self._shutdown(how), name=f"shutdown-{how}")

    async def _shutdown(self, how: str) -> None:
        self.phase = "shutdown"
        self.end_how = how
        if how == "done":
            self.end_cause = "every sample settled"
            self.mode = RunState.FINISHING  # not `running` while the servers stop and the last shards are compacted
        try:
            d = self.dispatcher
            if how == "drain":
                self.mode = RunState.DRAINING
                if d is not None:
                    d.hold(True)
                    log.info("draining: waiting for %d in-flight requests", d.in_flight)
                    await d.wait_idle()
                final = RunState.STOPPED
            elif how == "stop":
                self.mode = RunState.STOPPING
                if d is not None:
                    log.info("stopping: aborting %d in-flight requests", d.in_flight)
                    await d.abort_all()
                    if not await d.wait_idle(STOP_ABORT_WAIT_S):
                        log.warning("%d requests still open %.0f s after abort: cancelled", d.in_flight,
                                    STOP_ABORT_WAIT_S)
                        d.cancel_all()
                        await d.wait_idle(5)
                final = RunState.STOPPED
            elif how == "done":
                final = RunState.DONE
            else:
                if d is not None:
                    d.stop_retrying()
                    d.cancel_all()
                final = RunState.FAILED
                self.exit_code = EXIT_FAILED
            if self.committer is not None:
                await self.committer.drain()
                if self.committer.pending:
                    log.error("%d finished rows could not be committed (disk?): they will be regenerated",
                              self.committer.pending)
            log.info("stopping workers")
            if d is not None:
                d.stop_retrying()  # worker stops must not re-queue anything
            if self.fleet is not None:
                await self.fleet.stop()
            else:
                await asyncio.gather(*(w.stop() for w in self._local), return_exceptions=True)
            if self.compactor is not None:
                # after the servers are released (compacting 1,000 shards took ~14 s of GPU time paid for
                # nothing): the shards the last commits finished; the run is `final` only once they are one file
                # each (killed before, the next start compacts them: every sample is already settled)
                due = len(self.compactor.due())
                if due:
                    log.info("servers stopped; compacting %d finished shards", due)
                await self.compactor.drain()
            self.mode = final
            self._tick_once(final=True)
            log.info("run %s: %d/%d samples done", final, self.ledger.done if self.ledger else 0,
                     self.ledger.to_generate if self.ledger else 0)
        except asyncio.CancelledError:
            self._shutdown_task = None
            if how == "drain":
                self._begin_shutdown("stop")
            raise
        self._exit.set()

    # -- periodic telemetry and rules -------------------------------------------------------
    async def _monitor(self) -> None:
        while True:
            try:
                self._tick_once()
                if self.mode == RunState.RUNNING and self._shutdown_task is None:
                    ledger, d = _made(self.ledger, "ledger"), _made(self.dispatcher, "dispatcher")
                    committer = _made(self.committer, "committer")
                    if ledger.finished and d.in_flight == 0 and committer.pending == 0:
                        log.info("all %d samples settled", ledger.total)
                        if ledger.done == 0 and ledger.total > 0:
                            self._fail(RunRefused(
                                f"no sample was generated: all {ledger.total} samples were rejected or failed; the "
                                f"last reason: {ledger.refusals.last_reason or 'see rejects.jsonl'}",
                                self.cfg.source_path))
                        else:
                            self._begin_shutdown("done")
            except Exception:  # one bad tick must not end monitoring; the traceback goes to supervisor.log
                log.exception("monitor tick failed")
            await asyncio.sleep(TICK_S)

    def _tick_once(self, final: bool = False) -> None:
        now = time.monotonic()
        d = self.dispatcher
        self._resize()  # the caps follow each server's queue (feedback): the look-ahead follows the caps
        for w in self.workers:
            self.emit(w.snapshot())
        if self.fleet is not None:
            self.fleet.endpoint.refresh()
        simulated = self.sim_gpus.sample() if self.sim_gpus is not None and not final else []
        for ev in simulated:
            self.emit(ev)
        if getattr(self, "gpu", None) is not None and not final and not simulated:
            if self.gpu.available or now - self._last_gpu >= GPU_ERROR_EVERY_S:
                self._last_gpu = now
                for ev in self.gpu.sample():
                    self.emit(ev)
        if self.watch.check_disk() and self.dispatcher is not None and self.mode == RunState.RUNNING:
            self.dispatcher.hold(self.watch.disk_full)
        if self.ledger is not None:
            if final or now - self._last_quality >= QUALITY_EVERY_S:
                self._last_quality = now
                self.watch.quality(self.ledger.shards)
            # copied and cleared in place: the ledger's `changed` listener is this very set's add method
            dirty = set(self._dirty_shards)
            self._dirty_shards.clear()
            for sh in self._shard_statuses():
                if sh.id in dirty or self._shard_states.get(sh.id) != sh.state:
                    self._shard_states[sh.id] = sh.state
                    self.emit(ShardEvent.of(sh))
            figures = self._figures(self.ledger)
            self.emit(figures)
            if d is not None:
                self.watch.throughput(figures, self.ledger.work_waiting)

    async def _poll_sim_gpus(self) -> None:
        sim_gpus = _made(self.sim_gpus, "simulated GPU reader")
        while True:
            await sim_gpus.poll()
            await asyncio.sleep(TICK_S)

    def _figures(self, ledger: Ledger) -> DispatchEvent:
        d = self.dispatcher
        return dispatch_figures(ledger.shards, self.dispatch_state(), rate=ledger.rate,
                                in_flight=d.in_flight if d is not None else 0, retried=d.retried if d is not None else 0)

    def _shard_statuses(self) -> list[ShardFigures]:
        if self.ledger is None:
            return []
        return shard_statuses(self.ledger.shards, self.ledger.paused, self.dispatch_state(),
                              self.dispatcher.dispatched if self.dispatcher is not None else None)




# -- process setup --------------------------------------------------------------------------
def setup_logging(run_dir: Path) -> None:
    """INFO to stderr and supervisor.log (one handler when the starter made stderr that file); both degrade on a
    full disk instead of printing a `--- Logging error ---` block per record (engine.safe_log)."""
    log_path = run_dir / "supervisor.log"
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    stderr_handler = safe_log.ResilientHandler(2, str(log_path) if _stderr_is(log_path) else "stderr")
    stderr_handler.setFormatter(fmt)
    root.addHandler(stderr_handler)
    if not _stderr_is(log_path):
        file_handler = safe_log.ResilientHandler(safe_log.open_log_fd(str(log_path)), str(log_path))
        file_handler.setFormatter(fmt)
        root.addHandler(file_handler)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _stderr_is(path: Path) -> bool:
    """The starter redirects stderr into supervisor.log; then one handler is enough."""
    try:
        a, b = os.fstat(2), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class PidFile:
    def __init__(self, path: Path):
        self.path = path

    def acquire(self) -> str | None:
        """Take the pid file; returns a refusal message if a live supervisor holds it."""
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            text = ""
        if text:
            holder = _live_supervisor(text)
            if holder:
                return f"another supervisor (pid {text}) runs on this run dir: {holder}"
            log.info("replacing stale pid file %s (pid %s is not a live supervisor)", self.path, text)
        tmp = self.path.with_suffix(".pid.tmp")
        tmp.write_text(f"{os.getpid()}\n")
        os.replace(tmp, self.path)
        return None

    def release(self) -> None:
        try:
            if self.path.read_text().strip() == str(os.getpid()):
                self.path.unlink()
        except FileNotFoundError:
            log.warning("pid file %s was already removed", self.path)


def _live_supervisor(pid_text: str) -> str | None:
    try:
        pid = int(pid_text)
    except ValueError:
        return None
    if pid == os.getpid():
        return None
    try:
        cmdline = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return f"pid {pid} (cmdline not readable: access denied)"
    joined = " ".join(cmdline)
    return joined if "engine.supervisor" in joined else None


def _exit_code_for(exc: BaseException) -> int:
    for cls, code in EXIT_FOR:
        if isinstance(exc, cls):
            return code
    return EXIT_FAILED


def _log_failure(exc: BaseException) -> None:
    """Known causes in one line (their text says what and where); anything else with its traceback."""
    if isinstance(exc, ConfigChanged):
        log.error("refusing to resume: %s", exc)
    elif isinstance(exc, (ConfigError, RunDirError, PromptFileError, RenderError, WorkersFailed, OSError)) \
            or is_disk_full(exc):
        log.error("%s: %s", type(exc).__name__, exc)
    else:
        log.error("supervisor failed: %s: %s", type(exc).__name__, exc, exc_info=exc)


def say_fatal(record: FatalRecord, run_dir: Path, reserve: SpaceReserve | None,
              telemetry: Telemetry | None) -> None:
    """The last words: fatal.json (room made by giving up the reserve), the `fatal` event, a log line on stderr."""
    if reserve is not None:
        why = reserve.release()
        if why:
            log.error("%s", why)
    try:
        where = str(write_fatal(run_dir, record))
    except FatalWriteError as exc:
        where = f"nowhere: {exc}"
    log.error("FATAL (%s, exit %d): %s\n  path: %s\n  remedy: %s\n  recorded in %s", record.phase,
              record.exit_code, record.headline, record.path or "-", record.remedy, where)
    if telemetry is not None:
        telemetry.emit(record.event())


async def _load_and_run(run_dir: Path, config_path: Path) -> int:
    """Everything after the pid file, inside the event loop (listeners of the `fatal` and `run_end` events, such as
    a notifier, may still use it): load the config, prepare the run dir, supervise; a fatal error is recorded,
    and one `run_end` event emitted, before the return."""
    reserve = SpaceReserve(run_dir)
    startup = StartupChecks()
    telemetry: Telemetry | None = None
    notifier: Notifier | None = None
    sup: Supervisor | None = None
    failure: tuple[BaseException, str] | None = None
    code = EXIT_FAILED
    try:
        previous = archive_previous(run_dir)
        if previous is not None:
            log.info("the previous supervisor on this run dir ended with %s (kept in %s)", previous.headline,
                     PREVIOUS_FILE)
        why = reserve.take()
        if why:
            log.warning("%s; a fatal record would go to %s", why, fallback_path(run_dir))
        telemetry = Telemetry(run_dir)
        cfg, effective = resolve_sampling(load_config(config_path))
        startup.ok("config", str(config_path))
        log.info("sampling: %s%s", ", ".join(f"{s.key} {s.value!r} ({s.source})" for s in effective.sources),
                 f"; {effective.note}" if effective.note else "")
        if cfg.notify.enabled:  # from here on a death or the run's end reaches an operator who is not looking
            notifier = Notifier(cfg.notify, run_dir, telemetry.emit)
            telemetry.listeners.append(notifier.on_event)
            notifier.start()
        cfg = cfg.model_copy(update={"run_dir": str(run_dir)})
        prepare_run_dir(cfg)
        startup.ok("run_dir", str(run_dir))
        _write_manifest(cfg, run_dir)
        _single_cpu_tokenizer()
        sup = Supervisor(cfg, run_dir, telemetry, startup, notifier)
        code = await sup.run()
        _write_manifest(cfg, run_dir)
        if sup.fatal_exc is not None:
            failure = (sup.fatal_exc, sup.fatal_phase)
            code = code or EXIT_FAILED
    except Exception as exc:  # every fatal error ends here, recorded below: never a silent exit
        failure = (exc, sup.phase if sup is not None else "start")
        code = _exit_code_for(exc)
        _log_failure(exc)
    record = None
    if failure is not None:
        failed, phase = failure
        startup.fail_pending(f"{type(failed).__name__}: {failed}")
        record = record_for(failed, run_dir=run_dir, phase=phase, exit_code=code,
                            default_path=str(config_path) if isinstance(failed, ConfigError) else None)
        say_fatal(record, run_dir, reserve, telemetry)
    else:
        why = reserve.release()
        if why:
            log.error("%s", why)
    if telemetry is not None:
        ledger = sup.ledger if sup is not None else None
        if record is not None:
            state, cause = RunState.FAILED, record.headline
        else:
            how = sup.end_how if sup is not None else ""
            state = RunState.DRAINED if how == "drain" else (sup.mode if sup is not None else RunState.FAILED)
            cause = sup.end_cause if sup is not None else ""
        telemetry.emit(RunEndEvent(state=state, exit_code=code, cause=cause, done=ledger.done if ledger else 0,
                                   total=ledger.to_generate if ledger else 0))
        if notifier is not None:
            await notifier.aclose()  # bounded: notify.flush_timeout_s
        telemetry.close()
    return code


def _write_manifest(cfg: RunConfig, run_dir: Path) -> None:
    """run_dir/manifest.json; a failure to write it is logged and does not stop the run (the shards are the data)."""
    try:
        write_run_manifest(cfg, run_dir)
    except (ManifestError, OSError) as exc:
        log.warning("manifest not written: %s", exc)


def _single_cpu_tokenizer() -> None:
    """On one CPU the Rust tokenizer's thread pool only adds hand-offs (~10% of a prompt's encode):
    turn it off there, unless the operator set TOKENIZERS_PARALLELISM."""
    try:
        one_cpu = len(os.sched_getaffinity(0)) == 1
    except (AttributeError, OSError):
        one_cpu = os.cpu_count() == 1
    if one_cpu:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.supervisor", description=__doc__.splitlines()[0],
                                     epilog=__doc__[__doc__.index("Exit codes:"):],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--config", default=None,
                        help="the config to run with (default: RUN_DIR/run.toml); written to RUN_DIR/run.toml once the "
                             "run dir accepts it (`regen start` passes RUN_DIR/.regen/run.next.toml)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir).expanduser().resolve()
    config_path = Path(args.config).expanduser().resolve() if args.config else run_dir / "run.toml"
    if not run_dir.is_dir():
        print(f"regen supervisor: run dir {run_dir} does not exist (FileNotFoundError)", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(run_dir)
    log.info("supervisor pid %d starting on %s (python %s)", os.getpid(), run_dir, sys.executable)
    pidfile = PidFile(run_dir / "supervisor.pid")
    try:
        refusal = pidfile.acquire()
    except OSError as exc:  # e.g. a full disk: no live supervisor holds the run dir (checked first), so say why here
        _log_failure(exc)
        say_fatal(record_for(exc, run_dir=run_dir, phase="start", exit_code=EXIT_FAILED), run_dir, None, None)
        return EXIT_FAILED
    if refusal:
        log.error("refusing to start: %s", refusal)
        return EXIT_LOCKED  # the run dir, its fatal record and telemetry are the live supervisor's: nothing written
    try:
        code = asyncio.run(_load_and_run(run_dir, config_path))
    except Exception as exc:  # a failure of the recording itself: still said, on stderr and in the log
        log.error("supervisor failed while recording its end: %s: %s", type(exc).__name__, exc, exc_info=exc)
        code = EXIT_FAILED
    finally:
        pidfile.release()
    log.info("supervisor exits with %d", code)
    logging.shutdown()  # the resilient handlers write what they kept, if they can
    return code


if __name__ == "__main__":
    sys.exit(main())
