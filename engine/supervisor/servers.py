"""The run's servers: local workers (one SGLang server per GPU group, launched early while the prompts are counted)
or a fleet of placed hosts behind a router (engine.placement); their states size the dispatch and start the feed."""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from engine.api.events import AlertEvent
from engine.api.status import CheckState
from engine.api.wire import RunState, Severity
from engine.fatal import WorkersFailed
from engine.http_client import client_session
from engine.placement.fleet import Fleet
from engine.run.prompt_limit import tightest
from engine.api.wire import WorkerState
from engine.servers.launch import worker_specs
from engine.servers.tuning import RunTuning
from engine.servers.workers import Worker
from engine.supervisor.parts import made

if TYPE_CHECKING:
    from engine.supervisor.supervisor import Supervisor

log = logging.getLogger("regen.supervisor")


class Servers:
    def __init__(self, sup: Supervisor):
        self.sup = sup
        self._ready_seen = asyncio.Event()  # a server became ready (the feed starts at the first)

    def launch_early(self) -> bool:
        """Local servers are launched before the inputs are opened: they load (minutes for SGLang, ~1.5 s for
        the simulator) while the tokenizer loads and the prompts are counted, instead of after. Not when the
        store says every sample is settled (a start with nothing to do launches nothing)."""
        if self.placed() or self._looks_finished():
            return False
        self.sup.session = client_session()
        self.sup.workers = self.sup._local = self._make_workers()
        for w in self.sup._local:
            w.start()
        return True

    def _make_workers(self) -> list[Worker]:
        # each server's --schedule-conservativeness: the pilot's choice or where its last restart left it (run dir)
        tuning = RunTuning(self.sup.cfg, self.sup.run_dir)
        self.sup.emit(tuning.start_alert())
        workers = [Worker(spec=s, cfg=self.sup.cfg, run_dir=self.sup.run_dir, session=self.sup.session, emit=self.sup.emit,
                          tuner=tuning.for_server(s.name))
                   for s in worker_specs(self.sup.cfg)]
        for w in workers:
            w.listeners.append(self._on_worker_state)
        return workers

    def local_targets(self, early: bool) -> list[Worker]:
        if not early:
            self.sup.workers = self.sup._local = self._make_workers()
        return self.sup._local

    def fleet_targets(self) -> list:
        self.sup.fleet = Fleet(self.sup.cfg, self.sup.run_dir, self.sup.session, self.sup.emit)
        self.sup.fleet.on_change = self.resize
        self.sup.fleet.on_failed = self.sup.ending.fail
        self.sup.workers = self.sup.fleet.workers
        return [self.sup.fleet.endpoint]

    async def launch(self, early: bool) -> None:
        if self.sup.fleet is not None:
            await self.sup.fleet.start()
            self.sup.startup.ok("workers", f"router up; {len(self.sup.workers)} servers on {len(self.sup.fleet.links) or len(self.sup.cfg.hosts)} hosts"
                                       " launching")
        elif early:
            for w in self.sup.workers:
                if w.state == WorkerState.READY:  # became ready while the prompts were counted
                    self.on_target_state(w, w.state)
        else:
            for w in self.sup._local:
                w.start()

    def update_workers_check(self) -> None:
        """`workers launched`: every server launched (a pid, its port was free); refused or failed ones fail it."""
        ws = [w for w in self.sup.workers if isinstance(w, Worker)]
        if not ws:
            return
        bad = [w for w in ws if w.state in (WorkerState.REFUSED, WorkerState.FAILED)]
        if bad:
            self.sup.startup.failed("workers", "; ".join(f"{w.name} {w.state}: {w.error or 'no error text'}" for w in bad))
            return
        if self.sup.startup.checks["workers"].state == CheckState.OK:
            return  # passed: later crashes and restarts are the run's, shown as worker states and alerts
        live = (WorkerState.STARTING, WorkerState.LOADING, WorkerState.READY)
        if all(w.pid is not None and w.state in live for w in ws):
            self.sup.startup.ok("workers", ", ".join(f"{w.name} pid {w.pid} on {w.spec.host}:{w.spec.port} ({w.state})"
                                                 for w in ws))
        else:
            self.sup.startup.set("workers", CheckState.PENDING, "; ".join(
                f"{w.name} {w.state}" + (f": {w.error}" if w.error else "") for w in ws
                if w.pid is None or w.state not in live))

    def _looks_finished(self) -> bool:
        """Every shard's committed samples reach its planned samples (from the last count): a start
        with nothing to do launches no server before the count says so."""
        progress = self.sup.store.progress()
        return bool(progress) and all(p.total_samples is not None and p.done_samples + p.rejected >= p.total_samples
                                      for p in progress)

    async def close_early(self, early: bool) -> None:
        """Servers launched before the count, when the run ends before dispatch: stopped."""
        if self.sup.feed is not None:
            self.sup.feed.close()
        if early:
            await asyncio.gather(*(w.stop() for w in self.sup._local), return_exceptions=True)
            await self.sup.session.close()

    async def start_feed_when_ready(self) -> None:
        while not any(w.state == WorkerState.READY for w in self.sup.workers):
            # woken by the first ready state a listener sees (a resume's first dispatch waited up to 0.2 s
            # more); the timeout covers a multi-host run's servers, whose states come with the router's
            self._ready_seen.clear()
            try:
                await asyncio.wait_for(self._ready_seen.wait(), 0.2)
            except asyncio.TimeoutError:
                pass
        self._tighten_prompt_limit()
        if self.sup.mode == RunState.STARTING:
            self.sup.mode = RunState.RUNNING
            made(self.sup.ledger, "ledger").dispatch_began()
            made(self.sup.dispatcher, "dispatcher").hold(self.sup.watch.disk_full)
        await made(self.sup.feed, "feed").feed_forever()

    def on_target_state(self, w, state: str) -> None:
        """A dispatch target (a worker, or the router of a multi-host run) changed state."""
        if state == WorkerState.READY:
            self._ready_seen.set()
            self.resize()

    def _tighten_prompt_limit(self) -> None:
        """The feed's prompt limit: SGLang's rule with the smallest figures any server has reported."""
        if self.sup.feed is None:
            return
        limit = tightest(self.sup.feed.limit, ((w.name, w.capacity_info) for w in self.sup.workers))
        if limit != self.sup.feed.limit:
            log.info("prompts of %d tokens or more are rejected up front (was %d): %s", limit.max_input_len,
                     self.sup.feed.limit.max_input_len, limit.source)
            self.sup.feed.use_limit(limit)

    def resize(self) -> None:
        """Size the in-flight caps and the ledger's look-ahead to the ready capacity (also when servers
        join or leave the router), and the feed's prompt limit to what the servers reported."""
        self._tighten_prompt_limit()
        if self.sup.dispatcher is not None and self.sup.ledger is not None:
            self.sup.dispatcher.adjust_capacity()
            self.sup.ledger.size_for(sum(self.sup.dispatcher.capacity_for(x) for x in self.sup.dispatcher.workers
                                     if x.state == WorkerState.READY))

    def _on_worker_state(self, w: Worker, state: str) -> None:
        if state == WorkerState.READY:
            self._ready_seen.set()
            # its own server serves: a refusal an earlier supervisor raised for it ended (this one's own refusal is
            # cleared by the worker when the port is free again)
            self.sup.telemetry.clear(f"worker:{w.name}:refused", f"worker {w.name}: its own server is ready", w.url)
        self.update_workers_check()
        if state == WorkerState.FAILED and all(x.state == WorkerState.FAILED for x in self.sup.workers):
            evidence = "; ".join(f"{x.name}: {x.error}" for x in self.sup.workers)
            self.sup.emit(AlertEvent(severity=Severity.CRITICAL, text="every worker failed: the run stops",
                                 evidence=evidence, key="all-failed"))
            self.sup.ending.fail(WorkersFailed(f"every worker failed: {evidence}", str(self.sup.run_dir / "workers")))

    def placed(self) -> bool:
        """The servers are placed elsewhere ([[hosts]] over SSH, or [slurm] jobs) behind a router."""
        return bool(self.sup.cfg.hosts) or self.sup.cfg.slurm is not None
