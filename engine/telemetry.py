"""telemetry.jsonl writer, the latest-status cache for the `status` op, and the alert rules.

An alert of a condition is raised once while it holds (across restarts: engine.store.alert_record) and cleared
when it ends. On a full disk telemetry degrades instead of stopping the run: alerts and the end events are kept
and written first when writing works again; other events are counted as dropped.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterable

import psutil

from engine.store.alert_record import AlertRecord, AlertStore
from engine.api.events import (AlertEvent, DiskEvent, DispatchEvent, Event, FatalEvent, GpuEvent, RunEndEvent,
                                     ShardEvent, WorkerEvent)
from engine.api.wire import AlertKind, Severity

log = logging.getLogger("regen.telemetry")

FSYNC_INTERVAL_S = 5.0
QUALITY_MIN_SAMPLES = 50
THROUGHPUT_DROP_RATIO = 0.3
WRITE_RETRY_S = 2.0
KEPT_WHILE_FAILING = 500  # alerts / fatal / run_end lines held while the file cannot be written
KEPT_TYPES = (AlertEvent, FatalEvent, RunEndEvent)


class Telemetry:
    def __init__(self, run_dir: Path):
        self.path = run_dir / "telemetry.jsonl"
        self._f = open(self.path, "ab", buffering=0)
        self._last_fsync = time.monotonic()
        self.dispatch: DispatchEvent | None = None
        self.workers: dict[str, WorkerEvent] = {}
        self.gpus: dict[tuple[str, int], GpuEvent] = {}  # by (host, index): every host's, "" the supervisor's own
        self.disk: dict[tuple[str, str], DiskEvent] = {}  # by (host, path)
        self.shards: dict[str, ShardEvent] = {}
        self.alerts: collections.deque[AlertEvent] = collections.deque(maxlen=50)  # the latest said: history
        self.raised = AlertRecord()  # the conditions that hold now (in memory until keep_alerts attaches the store)
        self.write_error: str | None = None  # why telemetry.jsonl cannot be written now
        self.write_error_since: float | None = None
        self.dropped = 0  # events not written during the current failure
        self._kept: collections.deque[bytes] = collections.deque(maxlen=KEPT_WHILE_FAILING)
        self._torn = False  # a failing write left a partial line: end it before the next one
        self._next_try = 0.0
        # called with every event after it is recorded (e.g. the notifier); must not raise or block
        self.listeners: list[Callable[[Event], None]] = []

    def emit(self, event: Event) -> None:
        if isinstance(event, DispatchEvent):
            self.dispatch = event
        elif isinstance(event, WorkerEvent):
            self.workers[event.name] = event
        elif isinstance(event, GpuEvent):
            self.gpus[(event.host, event.index)] = event
        elif isinstance(event, DiskEvent):
            self.disk[(event.host, event.path)] = event
        elif isinstance(event, ShardEvent):
            self.shards[event.id] = event
        elif isinstance(event, AlertEvent):
            if event.key and event.kind == AlertKind.RAISED and not self.raised.raise_(event):
                return  # this condition is raised already (perhaps by the supervisor before a restart): said once
            if event.key and event.kind == AlertKind.CLEARED:
                was = self.raised.clear(event.key)
                if was is None:
                    return  # nothing raised to clear (a judge that says `cleared` on its first look after a start)
                said = f"raised {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(was.ts))}: {was.text}"
                event = dataclasses.replace(event, evidence=f"{said}\n{event.evidence}" if event.evidence else said)
            self.alerts.append(event)
            log.log(logging.ERROR if event.severity in (Severity.ERROR, Severity.CRITICAL) else logging.WARNING,
                    "ALERT %s: %s%s", event.severity, event.text, f"\n{event.evidence}" if event.evidence else "")
        self._record(event)
        for listener in self.listeners:
            listener(event)

    def _record(self, event: Event) -> None:
        line = event.to_json() + b"\n"
        if self.write_error is not None:
            if isinstance(event, KEPT_TYPES):
                if len(self._kept) == self._kept.maxlen:
                    self.dropped += 1
                self._kept.append(line)
            else:
                self.dropped += 1
            if time.monotonic() >= self._next_try:
                self._retry()
            return
        try:
            self._write(line)
            now = time.monotonic()
            if now - self._last_fsync > FSYNC_INTERVAL_S:
                os.fsync(self._f.fileno())
                self._last_fsync = now
        except OSError as exc:
            self._fail(exc, line if isinstance(event, KEPT_TYPES) else None)

    def _write(self, line: bytes) -> None:
        data = (b"\n" + line) if self._torn else line
        written = 0
        try:
            while written < len(data):
                n = self._f.write(data[written:])
                if not n:
                    raise OSError(f"write to {self.path} wrote nothing")
                written += n
        except OSError:
            if written:
                self._torn = True  # the file ends in a partial line now
            raise
        self._torn = False

    def _fail(self, exc: OSError, keep: bytes | None) -> None:
        self.write_error = f"{type(exc).__name__}: {exc}"
        self.write_error_since = time.time()
        self._next_try = time.monotonic() + WRITE_RETRY_S
        if keep is not None:
            self._kept.append(keep)
        else:
            self.dropped += 1
        # once per failure, not per event: the run goes on, the status op still has the latest state
        log.error("cannot write %s: %s; alerts are kept in memory and written when it works again, other"
                  " events are dropped meanwhile", self.path, exc)

    def _retry(self) -> None:
        try:
            while self._kept:
                self._write(self._kept[0])
                self._kept.popleft()
        except OSError as exc:
            self.write_error = f"{type(exc).__name__}: {exc}"
            self._next_try = time.monotonic() + WRITE_RETRY_S
            return
        log.warning("%s can be written again after %.0f s (%s): %d events were not written", self.path,
                    time.time() - (self.write_error_since or time.time()), self.write_error, self.dropped)
        self.write_error, self.write_error_since, self.dropped = None, None, 0

    def flush_kept(self) -> bool:
        """Write what is kept now (before exit, e.g. once the fatal reserve freed room); True if nothing is left."""
        if self.write_error is not None:
            self._retry()
        return self.write_error is None

    def keep_alerts(self, store: AlertStore) -> list[AlertEvent]:
        """Record the raised alerts in the run's store from now on; what an earlier supervisor raised is loaded
        (returned) and stays raised until its condition is judged again."""
        return self.raised.attach(store)

    def raised_alerts(self) -> list[AlertEvent]:
        """The alerts raised now (their conditions hold), oldest first."""
        return self.raised.raised()

    def condition(self, key: str, active: bool, severity: Severity, text: str, evidence: str = "",
                  cleared: str | None = None) -> None:
        """Judge a watched condition: alert once when it holds (not again while it is raised, also when an earlier
        supervisor raised it), `cleared` (info; `cleared` is its text, by default the alert's head) when it ends."""
        if active:
            if key not in self.raised:
                self.emit(AlertEvent(severity=severity, text=text, evidence=evidence, key=key, kind=AlertKind.RAISED))
        elif key in self.raised:
            self.clear(key, cleared or f"cleared: {text.split(':')[0]}", evidence)

    def clear(self, key: str, text: str, evidence: str = "") -> None:
        """End a raised condition (its evidence: when and with what text it was raised, then `evidence`, the
        state now); nothing when `key` is not raised."""
        if key in self.raised:
            self.emit(AlertEvent(severity=Severity.INFO, text=text, key=key, kind=AlertKind.CLEARED,
                                 evidence=f"now: {evidence}" if evidence else ""))

    def close(self) -> None:
        self.flush_kept()
        try:
            os.fsync(self._f.fileno())
        except OSError as exc:
            log.error("cannot fsync %s at exit: %s", self.path, exc)
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
