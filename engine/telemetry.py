"""telemetry.jsonl writer, the latest-status cache for the `status` op, and the alert rules.

Lines are appended and flushed per event (a reader never sees half a line for long) and fsynced
every few seconds. Alerts carry a stable `key`; rules that watch a state (quality shares, disk)
fire once when the state is entered and again only after it was left.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterable

import psutil

from engine.telemetry_events import AlertEvent, DiskEvent, DispatchEvent, Event, GpuEvent, ShardEvent, WorkerEvent

log = logging.getLogger("regen.telemetry")

FSYNC_INTERVAL_S = 5.0
QUALITY_MIN_SAMPLES = 50
THROUGHPUT_DROP_RATIO = 0.3


class Telemetry:
    def __init__(self, run_dir: Path):
        self.path = run_dir / "telemetry.jsonl"
        self._f = open(self.path, "ab", buffering=0)
        self._last_fsync = time.monotonic()
        self.dispatch: DispatchEvent | None = None
        self.workers: dict[str, WorkerEvent] = {}
        self.gpus: dict[int, GpuEvent] = {}
        self.disk: dict[str, DiskEvent] = {}
        self.shards: dict[str, ShardEvent] = {}
        self.alerts: collections.deque[AlertEvent] = collections.deque(maxlen=50)
        self._active_conditions: set[str] = set()
        # called with every event after it is recorded (e.g. the notifier); must not raise or block
        self.listeners: list[Callable[[Event], None]] = []

    def emit(self, event: Event) -> None:
        if isinstance(event, DispatchEvent):
            self.dispatch = event
        elif isinstance(event, WorkerEvent):
            self.workers[event.name] = event
        elif isinstance(event, GpuEvent):
            self.gpus[event.index] = event
        elif isinstance(event, DiskEvent):
            self.disk[event.path] = event
        elif isinstance(event, ShardEvent):
            self.shards[event.id] = event
        elif isinstance(event, AlertEvent):
            self.alerts.append(event)
            log.log(logging.ERROR if event.severity in ("error", "critical") else logging.WARNING,
                    "ALERT %s: %s%s", event.severity, event.text, f"\n{event.evidence}" if event.evidence else "")
        try:
            self._f.write(event.to_json() + b"\n")
            now = time.monotonic()
            if now - self._last_fsync > FSYNC_INTERVAL_S:
                os.fsync(self._f.fileno())
                self._last_fsync = now
        except OSError as exc:
            # telemetry must not take the run down (a full disk is handled by the disk guard)
            log.error("cannot write %s: %s", self.path, exc)
        for listener in self.listeners:
            listener(event)

    def condition(self, key: str, active: bool, severity: str, text: str, evidence: str = "") -> None:
        """Alert once when a watched condition becomes true; re-arm when it clears."""
        if active and key not in self._active_conditions:
            self._active_conditions.add(key)
            self.emit(AlertEvent(severity=severity, text=text, evidence=evidence, key=key))
        elif not active and key in self._active_conditions:
            self._active_conditions.discard(key)
            self.emit(AlertEvent(severity="info", text=f"cleared: {text.split(':')[0]}", key=key))

    def close(self) -> None:
        try:
            os.fsync(self._f.fileno())
        finally:
            self._f.close()


def disk_events(paths: Iterable[Path]) -> list[DiskEvent]:
    events = []
    for path in paths:
        try:
            usage = psutil.disk_usage(str(path))
        except OSError as exc:
            log.warning("disk usage of %s: %s", path, exc)
            continue
        events.append(DiskEvent(path=str(path), free_bytes=usage.free, total_bytes=usage.total))
    return events


class ThroughputWatch:
    """Alerts when the sliding tokens/s falls far below the best seen recently while work is running."""

    def __init__(self, horizon_s: float = 600.0):
        self.horizon_s = horizon_s
        self.samples: collections.deque[tuple[float, float]] = collections.deque()

    def dropped(self, tokens_per_s: float, running: bool) -> tuple[bool, str]:
        now = time.time()
        if not running:
            self.samples.clear()
            return False, ""
        self.samples.append((now, tokens_per_s))
        while self.samples and now - self.samples[0][0] > self.horizon_s:
            self.samples.popleft()
        if len(self.samples) < 30 or now - self.samples[0][0] < 60:
            return False, ""
        best = max(v for _, v in self.samples)
        if best > 0 and tokens_per_s < THROUGHPUT_DROP_RATIO * best:
            return True, f"{tokens_per_s:.0f} tok/s now, {best:.0f} tok/s best in the last {self.horizon_s / 60:.0f} min"
        return False, ""
