"""The parts the console's model keeps: one view per worker, GPU, shard, disk and alert, the connection to the host,
and the words of a missing figure (N/A). Plain data, no Textual."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from console.view.series import Series
from engine.api.status import FatalRecord

ALERTS_KEPT = 500
DISK_RATE_WINDOW_S = 600.0  # free-space slope over the last ten minutes


def na(value: Any, fmt: str = "{}") -> str:
    return "N/A" if value is None else fmt.format(value)


def bytes_text(n: float | None) -> str:
    if n is None:
        return "N/A"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def cause_text(fatal: FatalRecord | None) -> str:
    """One line: the message's first (a missing file's message goes on with the candidates found)."""
    first = ((fatal.message if fatal is not None else "") or "(no message)").splitlines()[0]
    return f"{(fatal.exc_type if fatal is not None else '') or 'Error'}: {first}"


@dataclass
class WorkerView:
    name: str
    state: str = "starting"
    gpus: list[int] = field(default_factory=list)
    pid: int | None = None
    restarts: int = 0
    running: float | None = None
    queued: float | None = None
    tok_s: float | None = None
    token_usage: float | None = None
    in_flight: int | None = 0  # None: not known (behind a router that keeps no count, or no live figure)
    in_flight_source: str = "dispatch"  # who counted it (engine.api.wire.InFlightSource)
    held: int = 0  # regen's queued items held for it (not sent)
    capacity: int = 0
    batch_size: int | None = None  # the server's running batch dispatch works with, and where it came from
    batch_source: str = ""
    discovered_batch: int | None = None  # what discovery said before feedback corrected it
    discovered_source: str = ""
    error: str | None = None
    url: str = ""
    host: str = ""  # multi-host runs: the [[hosts]] name
    remote: bool = False  # on another host: its GPUs are that host's agent's readings (GpuView.host)
    node: str = ""  # a [slurm] group's server: the node and job that run it
    job_id: str = ""
    prompt_tokens: int | None = None  # committed from it in this start, and how many its prefix cache served
    cached_tokens: int | None = None
    retracted: float | None = None  # requests its server retracted since its launch (None: N/A)
    conservativeness: float | None = None  # its --schedule-conservativeness and where it came from
    conservativeness_source: str = ""
    tok_history: Series = field(default_factory=Series)
    as_of: float | None = None  # the host time of its last reading


@dataclass
class GpuView:
    index: int
    host: str = ""  # whose agent sampled it; "" the dispatch host
    name: str | None = None
    mem_used_mb: float | None = None
    mem_total_mb: float | None = None
    util_pct: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    error: str | None = None
    mem_history: Series = field(default_factory=Series)

    @property
    def label(self) -> str:
        """`h1/gpu0` for another host's; the dispatch host's as always, `gpu0`."""
        return f"{self.host}/gpu{self.index}" if self.host else f"gpu{self.index}"


@dataclass
class ShardView:
    id: str
    state: str = "pending"
    done: int = 0
    total: int = 0
    output_tokens: int = 0
    empty: int = 0
    truncated: int = 0
    repetition: int = 0  # stopped by the runaway guard
    as_of: float | None = None  # the host time of these figures (an event's ts, or the status reply's)

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0

    @property
    def empty_share(self) -> float | None:
        return self.empty / self.done if self.done else None

    @property
    def truncated_share(self) -> float | None:
        return self.truncated / self.done if self.done else None


@dataclass
class DiskView:
    path: str
    host: str = ""  # as GpuView.host
    free_bytes: int = 0
    total_bytes: int = 0
    error: str | None = None  # no reading now (e.g. its host's link is lost): the figures are N/A
    history: Series = field(default_factory=Series)

    @property
    def label(self) -> str:
        return f"{self.host}:{self.path}" if self.host else self.path

    def write_rate(self, window_s: float = DISK_RATE_WINDOW_S) -> float | None:
        """Bytes/s consumed over the window (positive: filling up); None without two points."""
        pts = self.history.points
        if len(pts) < 2:
            return None
        t_end, free_end = pts[-1]
        start = next(((t, f) for t, f in pts if t >= t_end - window_s), pts[0])
        if t_end - start[0] <= 0:
            return None
        return (start[1] - free_end) / (t_end - start[0])

    def time_to_full(self) -> float | None:
        """Seconds until the free space is gone at the current write rate; None when not filling."""
        rate = self.write_rate()
        if rate is None or rate <= 0 or self.error is not None:
            return None
        return self.free_bytes / rate


@dataclass
class AlertView:
    ts: float
    severity: str
    text: str
    evidence: str = ""
    key: str = ""
    origin: str = "host"  # host (the supervisor's alert) | console (seen by the console)
    count: int = 1


class ConnectionState(StrEnum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    RECONNECTING = "reconnecting"
    LOST = "lost"
    ENDED = "ended"  # the follow ended with the run: nothing more will come
    REFUSED = "refused"


@dataclass(frozen=True)
class ResumeHint:
    """The `regen start` that resumes the run, from its start record (console/host/start_record.py), and where that line
    comes from; or, without a record, only why (command "")."""
    command: str = ""
    note: str = ""

    def text(self) -> str:
        if not self.command:
            return self.note
        return f"resume with: {self.command}" + (f" ({self.note})" if self.note else "")


@dataclass
class Connection:
    state: ConnectionState = ConnectionState.CONNECTING
    retry_at: float | None = None  # monotonic time of the next attempt
    error: str = ""
    since: float = field(default_factory=time.monotonic)

    def text(self, now_mono: float | None = None) -> str:
        now_mono = time.monotonic() if now_mono is None else now_mono
        if self.state in (ConnectionState.RECONNECTING, ConnectionState.LOST) and self.retry_at is not None:
            left = max(0, round(self.retry_at - now_mono))
            return (f"{self.state} in {left}s" if self.state == ConnectionState.RECONNECTING
                    else f"lost (retry in {left}s)")
        return str(self.state)
