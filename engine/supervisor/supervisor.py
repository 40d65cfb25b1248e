"""The supervisor: composes the run on the training host (the control socket, the metrics server, the servers, the
run wing) and runs it until every sample is settled, or drain / stop / SIGTERM. Its parts: servers.py, wiring.py,
monitor.py, ops.py, lifecycle.py; the process around it: main.py (`python -m engine.supervisor --run-dir D`)."""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from engine.api.ops import Op, WireReply
from engine.api.wire import ALREADY_SETTLED, RunState
from engine.config.load import RunConfig
from engine.http_client import client_session
from engine.notify import Notifier
from engine.observe.metrics_server import ALERT_KEY as METRICS_ALERT_KEY, MetricsServer
from engine.observe.watch import RunWatch
from engine.placement.fleet import Fleet
from engine.placement.hosts.remote_worker import RemoteWorker
from engine.run.committer import Committer
from engine.run.compactor import Compactor
from engine.run.dispatch.loop import Dispatcher
from engine.run.feed import Feed
from engine.run.ledger import Ledger
from engine.servers.gpu import GpuSampler
from engine.servers.gpu_sim import SimGpuReader
from engine.servers.startup import StartupChecks
from engine.servers.workers import Worker
from engine.store.rejects import RejectLog
from engine.store.shard_store import ShardStore
from engine.supervisor import ops
from engine.supervisor.control import ControlServer
from engine.supervisor.lifecycle import EXIT_OK, EndHow, Lifecycle
from engine.supervisor.monitor import Monitor
from engine.supervisor.parts import made
from engine.supervisor.servers import Servers
from engine.supervisor.wiring import RunWing
from engine.telemetry import Telemetry
from probes.context import is_rehearsal

log = logging.getLogger("regen.supervisor")

# young-generation collections after startup: each answer allocates a few dozen short-lived containers
# (request, response, futures, the row) that live across awaits; with the default 700 they are walked
# ~every 15 answers, mostly while still alive. Fewer, larger young collections walk less of them.
GC_THRESHOLDS = (20_000, 20, 10)


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
        self.end_how: EndHow | None = None  # how the run ended
        self.end_cause = ""  # who ended it (an operator's stop, a signal, every sample settled, the failure)
        self.startup = startup or StartupChecks()
        self.telemetry = telemetry
        self.emit = self.telemetry.emit
        self.notifier = notifier  # started and closed by main: it must outlive the fatal / run_end events
        self._tasks: list[asyncio.Task] = []
        self.sim_gpus: SimGpuReader | None = None  # a rehearsal without NVML: the simulators' modelled GPUs
        self.workers: Sequence[Worker | RemoteWorker] = []  # every server: a fleet's (engine.placement) or _local
        self._local: list[Worker] = []  # the servers this supervisor launches and stops itself (no fleet)
        self.watch = RunWatch(cfg, run_dir, telemetry)
        self.feed: Feed | None = None  # the run wing's parts, made by self.wing
        self.ledger: Ledger | None = None
        self.dispatcher: Dispatcher | None = None
        self.committer: Committer | None = None
        self.compactor: Compactor | None = None
        self.fleet: Fleet | None = None
        self.metrics: MetricsServer | None = None
        self.servers = Servers(self)
        self.wing = RunWing(self)
        self.monitor = Monitor(self)
        self.ending = Lifecycle(self)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.ending.on_signal, sig)
        self.store = ShardStore(self.run_dir)
        removed = self.store.recover()
        if removed:
            log.info("recovered the shard store: removed %d uncommitted files: %s", len(removed), ", ".join(removed[:10]))
        # the alerts an earlier supervisor raised stay raised (not said again) until their condition is judged again
        self.telemetry.keep_alerts(self.store)
        self.rejects = RejectLog(self.run_dir)
        self.control = ControlServer(self.run_dir / "control.sock", self.handle)
        await self.control.start()
        self.metrics = MetricsServer(self.cfg.metrics, self.monitor.status, self.emit)
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
        early = self.servers.launch_early()
        try:
            await self.wing.open_inputs()
        except BaseException:
            await self.servers.close_early(early)  # the servers launched first must not outlive a failed start
            raise
        if self.ending.shutdown_task is not None:
            log.info("stopped before dispatch began" if early else "stopped before any worker was launched")
            await self.ending.shutdown_task
            await self.servers.close_early(early)
            return self.exit_code
        ledger = made(self.ledger, "ledger")
        if ledger.finished:
            log.info("every sample is already settled (%d done): nothing to generate", ledger.done)
            self.startup.ok("workers", "none launched: every sample is already settled")
            self.mode = RunState.DONE
            self.end_how, self.end_cause = EndHow.DONE, ALREADY_SETTLED
            await self.servers.close_early(early)
            # a shard finished by the last start and not yet compacted (it was stopped or killed first)
            await Compactor(self.store, ledger, self.emit).drain()
            self.monitor.tick(final=True)
            return EXIT_OK
        self.gpu = GpuSampler()
        if self.gpu.init_error:
            log.warning("%s (GPU readings will show N/A)", self.gpu.init_error)
        if not early:
            self.session = client_session()
        if not self.gpu.available and not self.servers.placed() and is_rehearsal(self.cfg.workers.launch):
            # a rehearsal: the simulators' modelled GPUs stand in, named as simulated
            self.sim_gpus = SimGpuReader(self.session, lambda: self._local)
        try:
            targets = self.servers.fleet_targets() if self.servers.placed() else self.servers.local_targets(early)
            dispatcher = self.wing.compose(targets)
            committer = made(self.committer, "committer")
            for w in targets:
                w.listeners.append(self.servers.on_target_state)
                w.served = ledger.served_for(w.name)
            await self.servers.launch(early)
            # the startup heap (transformers, the tokenizer, every module) lives as long as the process:
            # keep it out of the full collections the per-answer garbage triggers (each walked ~10^6
            # objects, ~30 ms, a few times per 10^7 tokens)
            gc.collect()
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLDS)
            dispatcher.start()
            self._tasks = [
                asyncio.create_task(committer.run_forever(), name="committer"),
                asyncio.create_task(self.wing.compact_after_first_dispatch(), name="compactor"),
                asyncio.create_task(self.monitor.monitor_forever(), name="monitor"),
                asyncio.create_task(self.servers.start_feed_when_ready(), name="feed"),
            ]
            if self.sim_gpus is not None:
                self._tasks.append(asyncio.create_task(self.monitor.poll_sim_gpus(), name="sim-gpus"))
            for task in self._tasks:
                task.add_done_callback(self.ending.task_ended)
            self.phase = "run"
            await self.ending.exit_event.wait()
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
            made(self.feed, "feed").close()
            await self.session.close()

    async def handle(self, op: Op) -> WireReply:
        """One control op (engine.supervisor.ops)."""
        return await ops.handle(self, op)

    def state(self) -> RunState:
        if self.mode != RunState.RUNNING:
            return self.mode
        if self.watch.disk_full or (self.ledger is not None and self.ledger.all_paused):
            return RunState.PAUSED
        return RunState.RUNNING

    def dispatch_state(self) -> RunState:
        return RunState.DISK_FULL if self.watch.disk_full and self.mode == RunState.RUNNING else self.state()
