"""A host agent's readings of its own host (GPUs through NVML, disks), published in one file for the dispatch host."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import orjson
import psutil

from engine.api.events import DiskEvent, Event, GpuEvent

log = logging.getLogger("regen.agent")

READINGS_FILE = "host_readings.json"  # in the agent's work dir, replaced whole with every reading
READINGS_EVERY_S = 2.0  # the supervisor's telemetry tick
SHM = Path("/dev/shm")  # SGLang's shared memory, watched beside the work dir as on the dispatch host


class Sampler(Protocol):
    """engine.servers.gpu.GpuSampler, or a stand-in with its interface."""
    init_error: str | None

    def sample(self) -> list[GpuEvent]: ...

    def close(self) -> None: ...


@dataclass
class HostReadings:
    """One reading: `seq` counts up with each of this agent's (pid), so a reading that does not change is stale."""
    host: str
    pid: int
    seq: int
    ts: float  # the agent's clock
    gpus: list[GpuEvent] = field(default_factory=list)
    disks: list[DiskEvent] = field(default_factory=list)

    def to_json(self) -> bytes:
        return orjson.dumps({"host": self.host, "pid": self.pid, "seq": self.seq, "ts": self.ts,
                             "gpus": [g.to_dict() for g in self.gpus], "disks": [d.to_dict() for d in self.disks]})

    @classmethod
    def from_json(cls, text: str | bytes) -> HostReadings:
        """Raises ValueError naming what is wrong (not JSON, a field missing or of the wrong kind)."""
        try:
            data = orjson.loads(text)
            return cls(host=str(data["host"]), pid=int(data["pid"]), seq=int(data["seq"]), ts=float(data["ts"]),
                       gpus=[_event(GpuEvent, g) for g in data["gpus"]],
                       disks=[_event(DiskEvent, d) for d in data["disks"]])
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a host readings record: {type(exc).__name__}: {exc}") from exc


E = TypeVar("E", bound=Event)


def _event(cls: type[E], data: dict[str, Any]) -> E:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def disk_reading(path: Path, host: str) -> DiskEvent:
    try:
        usage = psutil.disk_usage(str(path))
    except OSError as exc:
        return DiskEvent(path=str(path), host=host, error=f"{type(exc).__name__}: {exc}")
    return DiskEvent(path=str(path), host=host, free_bytes=usage.free, total_bytes=usage.total)


def take_reading(host: str, sampler: Sampler, work_dir: Path, seq: int) -> HostReadings:
    gpus = [dataclasses.replace(g, host=host) for g in sampler.sample()]
    return HostReadings(host=host, pid=os.getpid(), seq=seq, ts=time.time(), gpus=gpus,
                        disks=[disk_reading(p, host) for p in (work_dir, SHM)])


def write_readings(work_dir: Path, readings: HostReadings) -> None:
    """Replaced whole (temp file, rename): a reader never sees half a reading."""
    tmp = work_dir / f".{READINGS_FILE}.tmp"
    tmp.write_bytes(readings.to_json())
    os.replace(tmp, work_dir / READINGS_FILE)


async def publish_readings(work_dir: Path, host: str, sampler: Sampler, stop: asyncio.Event,
                           every_s: float = READINGS_EVERY_S) -> None:
    """Until `stop`: a reading every `every_s`. A failed write is logged once per cause; the dispatch host then
    shows this host's readings as stale."""
    seq, failing = 0, ""
    while not stop.is_set():
        seq += 1
        try:
            write_readings(work_dir, take_reading(host, sampler, work_dir, seq))
            if failing:
                log.info("host readings written again to %s", work_dir / READINGS_FILE)
            failing = ""
        except OSError as exc:
            if str(exc) != failing:
                log.error("cannot write the host readings to %s: %s", work_dir / READINGS_FILE, exc)
            failing = str(exc)
        try:
            await asyncio.wait_for(stop.wait(), timeout=every_s)
        except asyncio.TimeoutError:
            continue  # next reading
