"""Typed messages from the I/O workers to the app: data arrives only through these."""
from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from console.view.model_parts import ConnectionState

from engine.api.ops import ShardsChanged, WorkerRestarted
from engine.api.status import RunStatus
from engine.api.reports import RunStats
from engine.api.events import Event
from probes.model import ProbeReport


@dataclass
class TelemetryBatch(Message):
    """Events read from the host since the last batch (coalesced, at most a few per second)."""

    events: list[Event]


@dataclass
class StatusReceived(Message):
    status: RunStatus


@dataclass
class ConnectionChanged(Message):
    state: ConnectionState
    retry_in_s: float | None = None
    error: str = ""


@dataclass
class LogTail(Message):
    worker: str
    text: str
    error: str = ""


@dataclass
class StatsReceived(Message):
    stats: RunStats | None
    error: str = ""


@dataclass
class ProbeReportReady(Message):
    report: ProbeReport
    partial: bool = False  # only some probes were rerun: merge into the shown report


@dataclass
class ControlDone(Message):
    """A control operation's outcome (pause/resume/restart): shown to the operator either way."""

    op: str
    ok: bool
    text: str
    result: ShardsChanged | WorkerRestarted | None = None
