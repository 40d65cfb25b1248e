"""Work spread across servers: a server's fair share of scarce work, its room, and the stranded-queue alert.

While regen's queue holds more than the free slots every server fills up; when it holds fewer (start, tail) each
takes only its capacity's share of the work left (servers still starting counted), so the last samples end together.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.api.events import AlertEvent
from engine.api.wire import AlertKind, Severity

STRANDED_ALERT_S = 5.0  # a server idle this long while another's own queue holds work: an alert
STRANDED_KEY = "stranded-queue"


@dataclass(frozen=True)
class ServerLoad:
    """One ready server as dispatch sees it now."""
    name: str
    capacity: int  # its in-flight cap (what it can run now plus a margin)
    in_flight: int  # requests regen has sent it and not had back
    batch: int | None = None  # the running batch size dispatch works with (None: not known yet)
    running: float | None = None  # sglang:num_running_reqs (None: no reading)
    queued: float | None = None  # sglang:num_queue_reqs: its own waiting queue


def within_share(me: ServerLoad, loads: list[ServerLoad], queued: int, starting: int = 0) -> bool:
    """May `me` take one more item? `loads`: every ready server (`me` among them); `queued`: items in regen's queue;
    `starting`: servers expected ready soon, each counted with the ready ones' mean capacity."""
    if queued > sum(max(0, x.capacity - x.in_flight) for x in loads):
        return True  # enough for every free slot
    total: float = sum(x.capacity for x in loads)
    if loads and starting:
        total += starting * total / len(loads)
    if total <= 0:
        return True
    work = queued + sum(x.in_flight for x in loads)
    share = -(-work * me.capacity // total)  # ceil: the shares cover the work
    return me.in_flight < max(1, share)


def room(load: ServerLoad) -> int:
    """Requests the server could start now: it runs under its batch with nothing in its own queue, and its cap is
    not full (0 otherwise, and while its gauges or its size are unknown)."""
    if load.batch is None or load.running is None or load.queued or load.running >= load.batch:
        return 0
    return max(0, min(load.batch - int(load.running), load.capacity - load.in_flight))


class StrandedWatch:
    """Says (once, and once cleared) when a server's own waiting queue holds work while another server has been
    idle, nothing in flight and nothing running, for STRANDED_ALERT_S. A condition (engine.api.wire.AlertKind): its first
    look after a start says `cleared` when nothing is stranded, which clears an earlier supervisor's alert still
    raised in the run's record (telemetry says nothing when none is)."""

    def __init__(self) -> None:
        self._idle_since: dict[str, float] = {}
        self.alerted: bool | None = None  # None: not judged yet by this process

    def check(self, loads: list[ServerLoad], now: float) -> AlertEvent | None:
        for x in loads:
            if x.in_flight or (x.running or 0) > 0:
                self._idle_since.pop(x.name, None)
            else:
                self._idle_since.setdefault(x.name, now)
        names = {x.name for x in loads}
        for gone in [n for n in self._idle_since if n not in names]:
            del self._idle_since[gone]
        idle = [x.name for x in loads if now - self._idle_since.get(x.name, now) >= STRANDED_ALERT_S]
        waiting = [x for x in loads if (x.queued or 0) >= 1]
        if idle and waiting:
            if self.alerted:
                return None
            self.alerted = True
            held = ", ".join(f"{x.name} {int(x.queued or 0)}" for x in waiting)
            return AlertEvent(severity=Severity.WARNING, key=STRANDED_KEY, kind=AlertKind.RAISED,
                              text=f"work waits in a server's own queue while {', '.join(idle)} idles",
                              evidence=f"queued in SGLang: {held}; idle for {STRANDED_ALERT_S:.0f} s or more")
        if self.alerted is not False:
            self.alerted = False
            return AlertEvent(severity=Severity.INFO, key=STRANDED_KEY, kind=AlertKind.CLEARED,
                              text="cleared: no server idles while another's queue holds work")
        return None
