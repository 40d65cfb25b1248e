"""Work stranded in one server's own queue while another has room: moved off it with POST /abort_request {"rid"}.

Only when regen's queue is empty and a server has run under its batch with no queue of its own for MOVE_AFTER_S:
a request still waiting comes back unrun and is re-queued once (engine.run.dispatch.answers); one that started is
answered as any abort.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from typing import Callable

from engine.api.events import Event
from engine.run.dispatch.client import SGLangClient
from engine.run.dispatch.pauses import PullPauses
from engine.run.dispatch.sizing import Sizing
from engine.run.dispatch.work_queue import WorkQueue
from engine.run.items import WorkItem
from engine.run.spread import StrandedWatch, room
from engine.servers.target import DispatchTarget

log = logging.getLogger("regen.dispatch")

MOVE_AFTER_S = 1.0  # a server under its batch with an empty queue this long takes work waiting in another's queue


class StrandedMover:
    """Which requests are moved off which server, and the stranded-queue alert. `running` holds the rids in flight
    that have streamed output (they run, so they are not in their server's waiting queue)."""

    def __init__(self, queue: WorkQueue, workers: Sequence[DispatchTarget], sizing: Sizing,
                 inflight: dict[str, dict[asyncio.Task[None], WorkItem]], pauses: PullPauses,
                 emit: Callable[[Event], None]):
        self.queue = queue
        self.workers = workers
        self.sizing = sizing
        self.inflight = inflight
        self.pauses = pauses
        self.emit = emit
        self.running: set[str] = set()
        self.moved = 0  # requests moved off a server's queue in this run
        self._moving: dict[str, str] = {}  # rid -> the worker it is being moved off (its abort sent)
        self._underused_since: dict[str, float] = {}  # per ready worker running under its batch with no queue
        self._watch = StrandedWatch()

    def check(self) -> None:
        """The stranded-queue alert (engine.run.spread.StrandedWatch), while dispatch accepts work."""
        alert = self._watch.check(self.sizing.loads(), time.monotonic())
        if alert is not None:
            self.emit(alert)

    def was_moving(self, rid: str) -> bool:
        """An answer of `rid` came back aborted: True if it was being moved (forgotten now)."""
        return self._moving.pop(rid, None) is not None

    def finished(self, rid: str) -> None:
        self.running.discard(rid)
        self._moving.pop(rid, None)

    def move(self, client: SGLangClient, accepting: bool) -> None:
        """Move requests waiting in a server's own queue to servers that have had room for MOVE_AFTER_S (see the
        module doc): at most as many as those can start now and the queue holds."""
        now = time.monotonic()
        loads = self.sizing.loads()
        space = 0
        for x in loads:
            if room(x):
                since = self._underused_since.setdefault(x.name, now)
                space += room(x) if now - since >= MOVE_AFTER_S else 0
            else:
                self._underused_since.pop(x.name, None)
        # work in regen's queue that a server with room can take is taken that way (items a lane holds for another
        # server's cache are not: they wait for it, up to dispatch.affinity_hold_s)
        if space <= 0 or not accepting or self.queue.queued > sum(self.queue.queued_for(x.name) for x in loads):
            return
        by_name = {w.name: w for w in self.workers}
        for x in sorted(loads, key=lambda x: -(x.queued or 0)):
            waiting = int(x.queued or 0) - sum(1 for name in self._moving.values() if name == x.name)
            if waiting <= 0 or space <= 0:
                break
            # the latest sent without output yet: the likeliest still in its waiting queue
            candidates = [item for item in reversed(list(self.inflight[x.name].values()))
                          if item.rid not in self.running and item.rid not in self._moving]
            for item in candidates[:min(waiting, space)]:
                self._moving[item.rid] = x.name
                self.pauses.set(x.name, now + MOVE_AFTER_S)  # or its own freed slot pulls it straight back
                space -= 1
                log.info("%s: moving %s off its queue (%d waiting there; another server has room)", x.name, item.rid,
                         waiting)
                client.abort_soon(by_name[x.name], item.rid, "moving",
                                  on_failure=functools.partial(self._not_moved, item.rid))

    def _not_moved(self, rid: str, problem: str) -> None:
        self._moving.pop(rid, None)  # it stays where it is and is answered there
