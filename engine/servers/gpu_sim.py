"""A rehearsal's GPU readings: each local SGLang simulator's modelled GPUs (its `GET /sim/gpu`), named as simulated.

Used only where NVML is unavailable and the workers are the simulator (probes.context.is_rehearsal); a real GPU is
always read through NVML (engine/servers/gpu.py).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Sequence

import aiohttp

from engine.api.events import GpuEvent
from engine.servers.workers import Worker
from engine.api.wire import WorkerState

SIM_GPU_PATH = "/sim/gpu"
READ_TIMEOUT_S = 5.0
FIELDS = ("index", "name", "mem_used_mb", "mem_total_mb", "util_pct")

log = logging.getLogger(__name__)


class SimGpuReader:
    """The newest reading of every GPU of the ready simulators; a simulator that stops answering loses its GPUs'
    readings (an error reading says why) until it answers again. A GPU whose simulator is stopped, crashed or
    restarting reads as released (no memory held, idle), as NVML would show a real one: its last reading would
    otherwise stay on every screen, and a read the stop cut short is no error."""

    def __init__(self, session: aiohttp.ClientSession, workers: Callable[[], Sequence[Worker]]):
        self.session = session
        self.workers = workers
        self._latest: dict[str, list[GpuEvent]] = {}  # worker name -> its GPUs' readings

    def sample(self) -> list[GpuEvent]:
        return sorted((ev for evs in self._latest.values() for ev in evs), key=lambda ev: ev.index)

    async def poll(self) -> None:
        ready = [w for w in self.workers() if w.state == WorkerState.READY]
        readings = await asyncio.gather(*(self._read(w) for w in ready))
        for w, evs in zip(ready, readings):
            if w.state == WorkerState.READY:  # not stopped while its reading was on its way
                self._latest[w.name] = evs
        for w in self.workers():
            if w.state != WorkerState.READY and w.name in self._latest:
                self._latest[w.name] = [released(ev) for ev in self._latest[w.name]]

    async def _read(self, w: Worker) -> list[GpuEvent]:
        try:
            async with self.session.get(w.url + SIM_GPU_PATH, headers=w.headers,
                                        timeout=aiohttp.ClientTimeout(total=READ_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                body = await resp.json(content_type=None)
            return [GpuEvent(**{k: g.get(k) for k in FIELDS}) for g in body]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, TypeError, AttributeError) as exc:
            error = f"worker {w.name}: GET {SIM_GPU_PATH} failed: {type(exc).__name__}: {exc}"
            log.warning("%s", error)
            return [GpuEvent(index=g, name="simulated (no reading)", error=error) for g in w.spec.gpus]


def released(ev: GpuEvent) -> GpuEvent:
    """A simulated GPU once its server is gone: nothing held, nothing running (its name and size as last read)."""
    return GpuEvent(index=ev.index, name=ev.name if ev.error is None else "simulated", mem_used_mb=0.0,
                    mem_total_mb=ev.mem_total_mb, util_pct=0.0)
