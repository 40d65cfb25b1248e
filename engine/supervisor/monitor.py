"""The monitor: a tick every TICK_S emits each server's, GPU's, shard's and the dispatch's figures and runs the watch's
rules (disk, data quality, throughput); and the status reply, built from the same parts (engine.observe.status)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from typing import TYPE_CHECKING

from engine import safe_log
from engine.api.events import DispatchEvent, ShardEvent
from engine.api.wire import RunState, ShardFigures
from engine.fatal import RunRefused
from engine.observe.status import build_run_status, dispatch_figures, levels_of, shard_statuses
from engine.api.status import Rejects, RunStatus
from engine.run.ledger import Ledger
from engine.supervisor.lifecycle import EndHow
from engine.supervisor.parts import made

if TYPE_CHECKING:
    from engine.supervisor.supervisor import Supervisor

log = logging.getLogger("regen.supervisor")

TICK_S = 2.0
QUALITY_EVERY_S = 10.0
GPU_ERROR_EVERY_S = 60.0


class Monitor:
    def __init__(self, sup: Supervisor):
        self.sup = sup
        self.dirty_shards: set[str] = set()  # shards whose figures moved since the last tick (the ledger's events)
        self._shard_states: dict[str, str] = {}  # the state each shard's last event said
        self._last_quality = 0.0  # monotonic time of the last data-quality check
        self._last_gpu = -1e9  # ... and of the last GPU reading (NVML missing: once a minute, to say why)

    async def monitor_forever(self) -> None:
        while True:
            try:
                self.tick()
                if self.sup.mode == RunState.RUNNING and self.sup.ending.shutdown_task is None:
                    ledger, d = made(self.sup.ledger, "ledger"), made(self.sup.dispatcher, "dispatcher")
                    committer = made(self.sup.committer, "committer")
                    if ledger.finished and d.in_flight == 0 and committer.pending == 0:
                        log.info("all %d samples settled", ledger.total)
                        if ledger.done == 0 and ledger.total > 0:
                            self.sup.ending.fail(RunRefused(
                                f"no sample was generated: all {ledger.total} samples were rejected or failed; the "
                                f"last reason: {ledger.refusals.last_reason or 'see rejects.jsonl'}",
                                self.sup.cfg.source_path))
                        else:
                            self.sup.ending.begin_shutdown(EndHow.DONE)
            except Exception:  # one bad tick must not end monitoring; the traceback goes to supervisor.log
                log.exception("monitor tick failed")
            await asyncio.sleep(TICK_S)

    def tick(self, final: bool = False) -> None:
        now = time.monotonic()
        d = self.sup.dispatcher
        self.sup.servers.resize()  # the caps follow each server's queue (feedback): the look-ahead follows the caps
        for w in self.sup.workers:
            self.sup.emit(w.snapshot())
        if self.sup.fleet is not None:
            self.sup.fleet.endpoint.refresh()
        simulated = self.sup.sim_gpus.sample() if self.sup.sim_gpus is not None and not final else []
        for ev in simulated:
            self.sup.emit(ev)
        if getattr(self, "gpu", None) is not None and not final and not simulated:
            if self.sup.gpu.available or now - self._last_gpu >= GPU_ERROR_EVERY_S:
                self._last_gpu = now
                for ev in self.sup.gpu.sample():
                    self.sup.emit(ev)
        if self.sup.watch.check_disk() and self.sup.dispatcher is not None and self.sup.mode == RunState.RUNNING:
            self.sup.dispatcher.hold(self.sup.watch.disk_full)
        if self.sup.ledger is not None:
            if final or now - self._last_quality >= QUALITY_EVERY_S:
                self._last_quality = now
                self.sup.watch.quality(self.sup.ledger.shards)
            # copied and cleared in place: the ledger's `changed` listener is this very set's add method
            dirty = set(self.dirty_shards)
            self.dirty_shards.clear()
            for sh in self._shard_statuses():
                if sh.id in dirty or self._shard_states.get(sh.id) != sh.state:
                    self._shard_states[sh.id] = sh.state
                    self.sup.emit(ShardEvent.of(sh))
            figures = self._figures(self.sup.ledger)
            self.sup.emit(figures)
            if d is not None:
                self.sup.watch.throughput(figures, self.sup.ledger.work_waiting)

    async def poll_sim_gpus(self) -> None:
        sim_gpus = made(self.sup.sim_gpus, "simulated GPU reader")
        while True:
            await sim_gpus.poll()
            await asyncio.sleep(TICK_S)

    def _figures(self, ledger: Ledger) -> DispatchEvent:
        d = self.sup.dispatcher
        return dispatch_figures(ledger.shards, self.sup.dispatch_state(), rate=ledger.rate,
                                in_flight=d.in_flight if d is not None else 0, retried=d.retried if d is not None else 0)

    def _shard_statuses(self) -> list[ShardFigures]:
        if self.sup.ledger is None:
            return []
        return shard_statuses(self.sup.ledger.shards, self.sup.ledger.paused, self.sup.dispatch_state(),
                              self.sup.dispatcher.dispatched if self.sup.dispatcher is not None else None)

    def status(self) -> RunStatus:
        t = self.sup.telemetry
        self.sup.servers.update_workers_check()
        ledger, d = self.sup.ledger, self.sup.dispatcher
        write_errors = safe_log.failures() + ([f"{t.path}: {t.write_error} ({t.dropped} events not written)"]
                                              if t.write_error else []) + (
            [f"the raised alerts' record ({self.sup.run_dir / 'state.sqlite'}): {t.raised.write_error}"]
            if t.raised.write_error else [])
        fleet = self.sup.fleet
        return build_run_status(
            run_dir=str(self.sup.run_dir), state=self.sup.state(), dispatch_state=self.sup.dispatch_state(),
            shards=ledger.shards if ledger is not None else None, paused=ledger.paused if ledger is not None else (),
            rate=ledger.rate if ledger is not None else None, in_flight=d.in_flight if d is not None else 0,
            retried=d.retried if d is not None else 0, dispatched=d.dispatched if d is not None else None,
            last_dispatch=t.dispatch, rejects=Rejects(self.sup.rejects.count, self.sup.rejects.counts_by_reason()),
            running=True, phase=self.sup.phase, startup=self.sup.startup.in_order(), write_errors=write_errors,
            pid=os.getpid(), started_at=self.sup.started_at, config_hash=self.sup.cfg.content_hash(), levels=levels_of(self.sup.cfg),
            host=socket.gethostname(), log=str(self.sup.run_dir / "supervisor.log"),
            workers=[w.snapshot() for w in self.sup.workers], gpus=list(t.gpus.values()), disk=list(t.disk.values()),
            alerts=t.raised_alerts(), alert_events=list(t.alerts), hosts=fleet.host_statuses() if fleet is not None else None,
            router=fleet.router_status() if fleet is not None else None,
            slurm_groups=fleet.slurm_groups() if fleet is not None else None,
            brake=ledger.brake.status() if ledger is not None else None,
            metrics=dataclasses.replace(self.sup.metrics.state) if self.sup.metrics is not None else None)

