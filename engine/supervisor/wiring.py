"""The run wing built and wired in one place: the counting pass, the feed, the ledger (given the feed and the wing's
events at construction), the committer (the ledger's answer sink), the compactor and the dispatcher (it delivers to
the ledger). A sample's route: feed -> ledger's ready queue -> dispatcher -> ledger.take -> committer -> shard store."""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Sequence

from engine.api.events import AlertEvent
from engine.api.wire import AlertKind, Severity
from engine.fatal import RunRefused
from engine.api.brake import BRAKE_ALERT_KEY, BrakeStatus
from engine.run.committer import Committer
from engine.run.compactor import Compactor
from engine.run.dispatch.loop import Dispatcher
from engine.servers.target import DispatchTarget
from engine.run.feed import Feed
from engine.run.ledger import Ledger
from engine.run.prompt_count import PromptCount
from engine.run.refusals import RefusalTrip
from engine.servers.startup import open_prompt_files
from engine.supervisor.parts import made
from engine.text.render import Renderer

if TYPE_CHECKING:
    from engine.supervisor.supervisor import Supervisor

log = logging.getLogger("regen.supervisor")


class RunWing:
    """Builds the wing's parts (kept on the supervisor, which the monitor, the ops and the shutdown read) and hears
    the ledger's events (engine.run.ledger_ports.LedgerEvents)."""

    def __init__(self, sup: Supervisor):
        self.sup = sup
        self.renderer: Renderer | None = None  # the model's tokenizer and chat template, loaded by open_inputs

    async def open_inputs(self) -> None:
        """Prompt files open, tokenizer loaded, prompts counted, the ledger opened on the store: each a start
        check; the first error is fatal."""
        sup, cfg = self.sup, self.sup.cfg
        sup.startup.ok("prompts", await asyncio.to_thread(open_prompt_files, cfg.prompts))
        self.renderer = renderer = await asyncio.to_thread(
            Renderer, cfg.tokenizer_path, enable_thinking=cfg.enable_thinking, context_length=cfg.context_length)
        sup.startup.ok("tokenizer", f"{cfg.tokenizer_path} (context {renderer.context_length})")
        prompts = PromptCount(cfg, renderer, sup.rejects)
        sup.startup.ok("count", "counting the prompts")
        bad = await asyncio.to_thread(prompts.count_stream)
        prompts.finish_count(bad)
        sup.feed = feed = Feed(cfg, renderer, prompts)
        sup.ledger = ledger = Ledger(cfg, prompts.planned, sup.store, sup.rejects, feed=feed, events=self)
        ledger.open()
        feed.attach(ledger)
        sup.monitor.dirty_shards.update(ledger.shards)
        if ledger.guard.brake_note:
            log.info("data-quality brake: %s", ledger.guard.brake_note)
        # kept from the last supervisor, or taken on the store's last samples at this start (ledger.braked: at open only
        # the brake can hold, the servers' refusals are counted from this start on)
        if (engaged := ledger.brake.engaged) is not None:
            self.brake_changed(engaged, True)
        else:  # an earlier supervisor's brake alert, and the brake is off now (lifted by a changed [brake])
            sup.telemetry.clear(BRAKE_ALERT_KEY, "cleared: data-quality brake: not engaged at this start",
                                ledger.guard.brake_note)
        log.info("plan: %d samples in %d shards (%d already committed), %d bad input rows, %s", ledger.total,
                 len(ledger.shards), ledger.done, prompts.input_rejects, prompts.counted())
        sup.startup.ok("count", f"{ledger.total} samples in {len(ledger.shards)} shards ({ledger.done} already done)")

    def compose(self, targets: Sequence[DispatchTarget]) -> Dispatcher:
        """The committer (the ledger's answer sink), the compactor and the dispatcher over `targets`, which delivers
        every outcome to the ledger."""
        sup = self.sup
        ledger, store_cfg = made(sup.ledger, "ledger"), sup.cfg.store
        sup.committer = Committer(sup.store, ledger, sup.emit, max_rows=store_cfg.part_max_rows,
                                  max_age_s=store_cfg.part_max_age_s, disk_ok=sup.watch.disk_ok_for_commit)
        ledger.answers_to(sup.committer)
        sup.compactor = Compactor(sup.store, ledger, sup.emit, disk_ok=sup.watch.disk_ok_for_commit)
        sup.dispatcher = Dispatcher(sup.cfg, ledger, targets, ledger.take, made(self.renderer, "renderer"), sup.session, sup.emit)
        return sup.dispatcher

    async def compact_after_first_dispatch(self) -> None:
        """The compactor's periodic task, from the first request on: a resumed run may find hundreds of shards
        the last start finished and did not compact, and their rewrites (a thread on the supervisor's core)
        slowed the servers' launch-to-dispatch path; a run that never dispatches compacts at its end."""
        await made(self.sup.dispatcher, "dispatcher").first_sent.wait()
        await made(self.sup.compactor, "compactor").run_forever()

    # -- the ledger's events (LedgerEvents) ------------------------------------------------------------------------
    def shard_changed(self, shard_id: str) -> None:
        self.sup.monitor.dirty_shards.add(shard_id)

    def brake_changed(self, status: BrakeStatus, engaged: bool) -> None:
        """The ledger braked (or released the brake): the operator is told why, with the numbers and the causes."""
        if engaged:
            self.sup.emit(AlertEvent(severity=Severity.ERROR, key=BRAKE_ALERT_KEY, kind=AlertKind.RAISED,
                                     text=f"data-quality brake: dispatch paused run-wide: {status.text}",
                                     evidence=status.evidence()))
        else:
            self.sup.telemetry.clear(BRAKE_ALERT_KEY,
                                     "cleared: data-quality brake released by resume --all; its window starts over",
                                     f"it braked on: {status.text}")

    def refused(self, trip: RefusalTrip) -> None:
        """The servers refuse the run's requests run-wide: a critical alert quoting them, and the run fails."""
        self.sup.emit(AlertEvent(severity=Severity.CRITICAL, key="refused", text=trip.text(), evidence=trip.evidence()))
        self.sup.ending.fail(RunRefused(f"{trip.text()}; likely config key: {trip.key}", self.sup.cfg.source_path))
