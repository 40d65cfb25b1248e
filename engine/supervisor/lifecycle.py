"""How a run ends: a failed task or part fails it, a signal or an operator's op stops or drains it, every sample
settled finishes it; the shutdown holds dispatch, drains or aborts, commits, stops the servers, compacts."""
from __future__ import annotations

import asyncio
import logging
import signal
from enum import StrEnum
from typing import TYPE_CHECKING

from engine.api.wire import FINAL_RUN_STATES, RunState

if TYPE_CHECKING:
    from engine.supervisor.supervisor import Supervisor

log = logging.getLogger("regen.supervisor")

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_CHANGED, EXIT_LOCKED, EXIT_INPUT = 0, 1, 2, 3, 4, 5
STOP_ABORT_WAIT_S = 15.0


class EndHow(StrEnum):
    """How a run's shutdown ends it (Supervisor.end_how)."""
    DRAIN = "drain"  # finish what is in flight, then stop
    STOP = "stop"  # abort what is in flight, then stop
    DONE = "done"  # every sample settled
    FAILED = "failed"


class Lifecycle:
    def __init__(self, sup: Supervisor):
        self.sup = sup
        self.exit_event = asyncio.Event()  # set once the shutdown is done: the run returns
        self.shutdown_task: asyncio.Task | None = None

    def task_ended(self, task: asyncio.Task) -> None:
        """A supervisor task must not die unnoticed: its exception fails the run, with that cause."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        log.error("task %s failed: the run stops", task.get_name(), exc_info=exc)
        self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        if self.sup.fatal_exc is None:
            self.sup.fatal_exc, self.sup.fatal_phase = exc, self.sup.phase
        self.begin_shutdown(EndHow.FAILED)

    def on_signal(self, sig: signal.Signals) -> None:
        log.info("%s received: stopping", sig.name)
        self.sup.end_cause = self.sup.end_cause or f"{sig.name} received"
        self.begin_shutdown(EndHow.STOP)

    def begin_shutdown(self, how: EndHow) -> None:
        if self.shutdown_task is not None:
            if how == EndHow.STOP and self.sup.mode == RunState.DRAINING:
                self.shutdown_task.cancel()  # stop overrides a drain in progress
            else:
                return
        if how in (EndHow.DRAIN, EndHow.STOP) and self.sup.mode not in FINAL_RUN_STATES:
            self.sup.mode = RunState.DRAINING if how == EndHow.DRAIN else RunState.STOPPING
            if self.sup.dispatcher is not None:
                self.sup.dispatcher.hold(True)
        self.shutdown_task = asyncio.get_running_loop().create_task(self._shutdown(how), name=f"shutdown-{how}")

    async def _shutdown(self, how: EndHow) -> None:
        self.sup.phase = "shutdown"
        self.sup.end_how = how
        if how == EndHow.DONE:
            self.sup.end_cause = "every sample settled"
            self.sup.mode = RunState.FINISHING  # not `running` while the servers stop and the last shards are compacted
        try:
            d = self.sup.dispatcher
            if how == EndHow.DRAIN:
                self.sup.mode = RunState.DRAINING
                if d is not None:
                    d.hold(True)
                    log.info("draining: waiting for %d in-flight requests", d.in_flight)
                    await d.wait_idle()
                final = RunState.STOPPED
            elif how == EndHow.STOP:
                self.sup.mode = RunState.STOPPING
                if d is not None:
                    log.info("stopping: aborting %d in-flight requests", d.in_flight)
                    await d.abort_all()
                    if not await d.wait_idle(STOP_ABORT_WAIT_S):
                        log.warning("%d requests still open %.0f s after abort: cancelled", d.in_flight,
                                    STOP_ABORT_WAIT_S)
                        d.cancel_all()
                        await d.wait_idle(5)
                final = RunState.STOPPED
            elif how == EndHow.DONE:
                final = RunState.DONE
            else:
                if d is not None:
                    d.stop_retrying()
                    d.cancel_all()
                final = RunState.FAILED
                self.sup.exit_code = EXIT_FAILED
            if self.sup.committer is not None:
                await self.sup.committer.drain()
                if self.sup.committer.pending:
                    log.error("%d finished rows could not be committed (disk?): they will be regenerated",
                              self.sup.committer.pending)
            log.info("stopping workers")
            if d is not None:
                d.stop_retrying()  # worker stops must not re-queue anything
            if self.sup.fleet is not None:
                await self.sup.fleet.stop()
            else:
                await asyncio.gather(*(w.stop() for w in self.sup._local), return_exceptions=True)
            if self.sup.compactor is not None:
                # after the servers are released (compacting 1,000 shards took ~14 s of GPU time paid for
                # nothing): the shards the last commits finished; the run is `final` only once they are one file
                # each (killed before, the next start compacts them: every sample is already settled)
                due = len(self.sup.compactor.due())
                if due:
                    log.info("servers stopped; compacting %d finished shards", due)
                await self.sup.compactor.drain()
            self.sup.mode = final
            self.sup.monitor.tick(final=True)
            log.info("run %s: %d/%d samples done", final, self.sup.ledger.done if self.sup.ledger else 0,
                     self.sup.ledger.to_generate if self.sup.ledger else 0)
        except asyncio.CancelledError:
            self.shutdown_task = None
            if how == EndHow.DRAIN:
                self.begin_shutdown(EndHow.STOP)
            raise
        self.exit_event.set()
