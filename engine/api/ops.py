"""The control socket's operations as typed requests (parse_op reads one JSON request, to_request writes it) and the
replies of the ops that change something (status's is engine.observe.status.RunStatus, drain_host's HostStatus).

Wire format (one JSON object per line, engine.control): {"op": "status"[, "shards": false]} | {"op": "pause", "shards": [...] | "all"} |
{"op": "resume", "shards": ...} | {"op": "restart_worker", "worker": name} | {"op": "drain_host", "host": name} |
{"op": "undrain_host", "host": name} | {"op": "log_tail", "worker": name, "lines": n} | {"op": "drain"} | {"op": "stop"}.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar


class ControlError(Exception):
    """A request that cannot be served; its text is the reply's `error` (engine.control re-exports it)."""


@dataclass(frozen=True)
class Status:
    """The run's status; shards=False: without the shard list (its figures and the dispatch totals stay)."""
    op: ClassVar[str] = "status"
    shards: bool = True


@dataclass(frozen=True)
class Pause:
    """Hold the shards (None: every shard) back from dispatch; requests in flight finish."""
    op: ClassVar[str] = "pause"
    shards: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Resume:
    """Dispatch the shards again (None: every shard, and the data-quality brake released: engine.run.brake)."""
    op: ClassVar[str] = "resume"
    shards: tuple[str, ...] | None = None


@dataclass(frozen=True)
class RestartWorker:
    op: ClassVar[str] = "restart_worker"
    worker: str


@dataclass(frozen=True)
class DrainHost:
    """Multi-host: send the host no new work (its requests in flight finish)."""
    op: ClassVar[str] = "drain_host"
    host: str


@dataclass(frozen=True)
class UndrainHost:
    op: ClassVar[str] = "undrain_host"
    host: str


@dataclass(frozen=True)
class LogTail:
    """The last `lines` lines of a server's server.log, read where the server runs: this machine, a [[hosts]] host
    (over the supervisor's SSH to it) or a [slurm] job's dir. The console reaches only the supervisor's machine."""
    op: ClassVar[str] = "log_tail"
    worker: str
    lines: int = 200


@dataclass(frozen=True)
class Drain:
    """End the run once the requests in flight are answered and committed."""
    op: ClassVar[str] = "drain"


@dataclass(frozen=True)
class Stop:
    """End the run now: requests in flight are aborted (their samples are generated again on the next start)."""
    op: ClassVar[str] = "stop"


Op = Status | Pause | Resume | RestartWorker | DrainHost | UndrainHost | LogTail | Drain | Stop
OP_TYPES: dict[str, type[Op]] = {cls.op: cls for cls in (Status, Pause, Resume, RestartWorker, DrainHost, UndrainHost,
                                                         LogTail, Drain, Stop)}
MAX_LOG_LINES = 10_000
OPS = tuple(OP_TYPES)


@dataclass
class ShardsChanged:
    """pause's and resume's reply."""
    op: str = ""  # pause | resume
    shards: list[str] = field(default_factory=list)  # the shards the op changed (already so: not listed)
    paused: list[str] = field(default_factory=list)  # every shard paused now
    state: str = ""  # the run's state after the op (engine.api.wire.RunState)
    brake: str | None = None  # the data-quality brake's cause while it still holds dispatch run-wide

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class WorkerRestarted:
    """restart_worker's reply."""
    worker: str = ""
    state: str = ""  # the worker's state once the restart was asked (engine.api.wire.WorkerState)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LogText:
    """log_tail's reply."""
    worker: str = ""
    path: str = ""  # where the log is: a path on the supervisor's machine, or HOST:PATH on a [[hosts]] host
    text: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


EXITED = "exited:"  # stop found no supervisor but cleaned up after it (engine/ctl.py)


@dataclass
class RunEnding:
    """drain's and stop's reply."""
    state: str = ""  # draining | stopping, or how the run had already ended, or EXITED and what stop did without it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_op(request: Any) -> Op:
    """One decoded JSON request as its op; ControlError (the reply's text) when it is not one."""
    name = request.get("op") if isinstance(request, dict) else None
    cls = OP_TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ControlError(f"unknown op {name!r}; known: {', '.join(OPS)}")
    if cls in (Pause, Resume):
        shards = request.get("shards", "all")
        if shards == "all":
            return cls(shards=None)
        if not (isinstance(shards, list) and all(isinstance(s, str) for s in shards)):
            raise ControlError('"shards" must be a list of shard ids or "all"')
        return cls(shards=tuple(shards))
    if cls is RestartWorker:
        return RestartWorker(worker=_name(request, "worker", "a worker's name, e.g. w0"))
    if cls in (DrainHost, UndrainHost):
        return cls(host=_name(request, "host", "a [[hosts]] name of the run config"))
    if cls is LogTail:
        lines = request.get("lines", 200)
        if not (isinstance(lines, int) and not isinstance(lines, bool) and 1 <= lines <= MAX_LOG_LINES):
            raise ControlError(f'"lines" must be an integer from 1 to {MAX_LOG_LINES}; got {lines!r}')
        return LogTail(worker=_name(request, "worker", "a worker's name, e.g. gpu0"), lines=lines)
    if cls is Status:
        shards = request.get("shards", True)
        if not isinstance(shards, bool):
            raise ControlError(f'"shards" must be true or false; got {shards!r}')
        return Status(shards=shards)
    return cls()


def to_request(op: Op) -> dict[str, Any]:
    """The JSON request for an op (parse_op's inverse)."""
    if isinstance(op, (Pause, Resume)):
        return {"op": op.op, "shards": "all" if op.shards is None else list(op.shards)}
    if isinstance(op, RestartWorker):
        return {"op": op.op, "worker": op.worker}
    if isinstance(op, (DrainHost, UndrainHost)):
        return {"op": op.op, "host": op.host}
    if isinstance(op, LogTail):
        return {"op": op.op, "worker": op.worker, "lines": op.lines}
    if isinstance(op, Status) and not op.shards:
        return {"op": op.op, "shards": False}
    return {"op": op.op}


def _name(request: dict[str, Any], key: str, what: str) -> str:
    value = request.get(key)
    if not isinstance(value, str):
        raise ControlError(f'"{key}" must be {what} (a string); got {value!r}')
    return value
