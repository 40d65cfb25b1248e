"""A remote host's GPU and disk readings on the dispatch host: fetched from its agent, emitted tagged with the host.

Readings that stop (the link is lost, the file cannot be read, the agent no longer samples) are not left
frozen on screen: the host's GPUs and disks are emitted once more as N/A, with why and when the last
reading came.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Awaitable, Callable

from engine.placement.hosts.readings import HostReadings
from engine.api.events import DiskEvent, Event, GpuEvent

log = logging.getLogger("regen.hosts")

FETCH_EVERY_S = 5.0  # one ssh round trip per host this often
STALE_AFTER_S = 20.0  # no new reading for this long (the agent writes one every 2 s): the host's readings are N/A


class ReadingsUnavailable(Exception):
    """The readings could not be fetched; the message says which step failed and what it printed."""


class ReadingsFeed:
    def __init__(self, host: str, fetch: Callable[[], Awaitable[str]], emit: Callable[[Event], None]):
        self.host = host
        self._fetch = fetch  # the agent's READINGS_FILE as text; raises ReadingsUnavailable
        self.emit = emit
        # the GPUs the last reading named; before one, GPU 0 stands for the host (as a sampler without NVML does)
        self.gpu_indices: list[int] = [0]
        self.disk_paths: list[str] = []
        self.stale: str | None = None  # why the readings shown are N/A now; None while they flow
        self._last: tuple[int, int] | None = None  # (agent pid, seq) of the last reading emitted
        self._fresh_at: float | None = None  # monotonic time it came
        self._fresh_clock = ""  # and its wall-clock time, for the N/A text

    async def run(self, every_s: float = FETCH_EVERY_S) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # one bad poll must not end this host's readings; the traceback goes to the log
                log.exception("host %s: reading its GPUs and disks failed", self.host)
            await asyncio.sleep(every_s)

    async def poll(self) -> None:
        try:
            readings = HostReadings.from_json(await self._fetch())
        except (ReadingsUnavailable, ValueError) as exc:
            if self._overdue():
                self.mark_stale(str(exc))
            return
        if (readings.pid, readings.seq) == self._last:
            if self._overdue():
                self.mark_stale(f"the host agent (pid {readings.pid}) wrote no new reading for over"
                                f" {STALE_AFTER_S:.0f} s")
            return
        self._take(readings)

    def _overdue(self) -> bool:
        return (self._fresh_at is None or self.stale is not None
                or time.monotonic() - self._fresh_at >= STALE_AFTER_S)

    def _take(self, r: HostReadings) -> None:
        if self.stale is not None:
            log.info("host %s: GPU and disk readings again (agent pid %d)", self.host, r.pid)
        self._last, self._fresh_at, self.stale = (r.pid, r.seq), time.monotonic(), None
        self._fresh_clock = time.strftime("%H:%M:%S")
        now = time.time()  # the dispatch host's clock, as every other event (the hosts' clocks may differ)
        for g in r.gpus:
            self.emit(dataclasses.replace(g, host=self.host, ts=now))
        for d in r.disks:
            self.emit(dataclasses.replace(d, host=self.host, ts=now))
        self.gpu_indices = [g.index for g in r.gpus] or self.gpu_indices
        self.disk_paths = [d.path for d in r.disks]

    def mark_stale(self, why: str) -> None:
        """The host's GPUs and disks become N/A with `why` (emitted once per cause)."""
        why = " | ".join(line.strip() for line in why.splitlines() if line.strip())  # ssh's stderr: one line
        text = f"no reading from {self.host}: {why}" + (f" (last reading {self._fresh_clock})"
                                                        if self._fresh_clock else "")
        if text == self.stale:
            return
        if self.stale is None:
            log.warning("host %s: %s", self.host, text)
        self.stale = text
        now = time.time()
        for i in self.gpu_indices:
            self.emit(GpuEvent(ts=now, index=i, host=self.host, error=text))
        for path in self.disk_paths:
            self.emit(DiskEvent(ts=now, path=path, host=self.host, error=text))
