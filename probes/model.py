"""Probe results and the probe report (`schema: "regen.probe/1"`)."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

SCHEMA = "regen.probe/1"


class Status(str, enum.Enum):
    PASS = "PASS"
    WARN = "WARN"
    FAIL = "FAIL"  # the probe ran and the host is not fit
    ERROR = "ERROR"  # the probe could not run (timeout, transport error): never a PASS
    SKIP = "SKIP"  # a probe it depends on did not pass; `summary` names it


class ConnectErrorKind(enum.StrEnum):
    """Why an SSH connection could not be opened or used (console.host.transport.TransportError.kind)."""
    UNREACHABLE = "unreachable"
    TIMEOUT = "timeout"
    AUTH = "auth"
    HOST_KEY = "host_key"
    CLOSED = "closed"
    ERROR = "error"


@dataclass(frozen=True)
class CommandResult:
    """What running one command on the host gave: the transport's answer."""

    command: str
    exit_status: int | None  # None: no exit status (timed out, killed by a signal, transport lost)
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    error: str | None = None  # transport-level failure text, verbatim


class CommandRunner(Protocol):
    """The one thing probes need from a transport (console/host/transport.py implements it)."""

    async def run(self, command: str, *, timeout: float, stdin: bytes | None = None) -> CommandResult: ...


@dataclass
class ProbeResult:
    id: str
    title: str
    status: Status
    summary: str
    expected: str = ""
    actual: str = ""
    command: str = ""
    exit_status: int | None = None
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    remedy: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    script: str = ""  # the probes/host script embedded in `command` (`python -c SCRIPT`), for a short display

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        return d


@dataclass
class ProbeReport:
    host: str
    results: list[ProbeResult]
    started_at: float
    duration_s: float
    schema: str = SCHEMA
    rehearsal: bool = False  # the run config launches the SGLang simulator: GPU/CUDA/sglang/weights probes SKIP
    connect_s: float = 0.0  # opening the connection, before the probes ran (duration_s): 0 on one already open

    def timing_text(self, on: str = "") -> str:
        """`N probes [on HOST] in T s`, the connection's share said when there was one to open."""
        total = self.connect_s + self.duration_s
        text = f"{len(self.results)} probes{f' on {on}' if on else ''} in {total:.1f}s"
        if self.connect_s:
            text += f" (connecting {self.connect_s:.1f}s, probes {self.duration_s:.1f}s)"
        return text

    def summary(self) -> dict[str, int]:
        counts = {s.value: 0 for s in Status}
        for r in self.results:
            counts[r.status.value] += 1
        return counts

    def exit_code(self) -> int:
        """0: no FAIL/ERROR; 1: some FAIL/ERROR (2, could not run at all, is the CLI's)."""
        bad = any(r.status in (Status.FAIL, Status.ERROR) for r in self.results)
        return 1 if bad else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "host": self.host,
            "started_at": self.started_at,
            "duration_s": self.duration_s,
            "connect_s": self.connect_s,
            "summary": self.summary(),
            "rehearsal": self.rehearsal,
            "probes": [r.to_dict() for r in self.results],
        }
