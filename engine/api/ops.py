"""Each control op as one typed message (a pydantic model, told apart by `op`) with its reply type beside it (`Reply`).
engine.api.op_codec reads and writes them, engine.api.op_cli derives their command lines from their fields. A new op
is its class here (listed in Op or CtlOp) and its handler (@handles in engine.supervisor.ops, or engine.ctl.answer
for one served without a supervisor). ReplyAbove: the status types are imported lazily until they move into engine.api.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Protocol, TypeAlias, TypeGuard, Union, get_args

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, PlainSerializer,
                      SerializerFunctionWrapHandler, Strict, Tag, model_serializer)

from engine.api.status import HostStatus, RunStatus


class ControlError(Exception):
    """A request that cannot be served; its text is the reply's `error`."""


class WireReply(Protocol):
    """What an op's reply is: a typed value that writes its JSON form."""

    def to_dict(self) -> dict[str, Any]: ...


class ControlOp(BaseModel):
    """One op: `op` its name (the wire's "op", `op-name` on the command line), its fields its arguments. Each field's
    description says what its value must be (a bad request's error, the command's help); its type gives its
    command-line form (engine.api.op_cli)."""
    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")
    op: ClassVar[str]
    Reply: ClassVar[type]
    streams: ClassVar[bool] = False  # answered by event lines and then one last reply (follow)

    @model_serializer(mode="wrap")
    def _named(self, fields: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = {"op": self.op, **fields(self)}  # the name first, as every engine wrote it
        for name, info in type(self).model_fields.items():
            if any(isinstance(m, OmitDefault) for m in info.metadata) and getattr(self, name) == info.default:
                del data[name]
        return data


class OmitDefault:
    """Marks a field left out of the wire JSON while it holds its default (as the engines before it wrote the op)."""


class AllOrSome:
    """Marks a selection field: a tuple of names, or None for all of them ("all" on the wire, --all on the command
    line, the names as positional arguments)."""


def _all_is_none(value: Any) -> Any:
    if value == "all":
        return None
    return tuple(value) if isinstance(value, list) else value


Selection = Annotated[tuple[str, ...] | None, BeforeValidator(_all_is_none),
                      PlainSerializer(lambda v: "all" if v is None else list(v)), AllOrSome()]
MAX_LOG_LINES = 10_000


# -- replies ---------------------------------------------------------------------------------------------------------
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


@dataclass(frozen=True)
class HelloResult:
    """hello's reply: which engine answers and which protocol it speaks."""
    engine_version: Annotated[str, Field(alias="engine"), Strict()]  # engine.__version__ of the engine that answers
    protocol: Annotated[int, Strict()]

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine_version, "protocol": self.protocol}


@dataclass(frozen=True)
class FollowEnded:
    """follow's last reply, after its events: how the stream ended."""
    ended: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- the supervisor's ops (its control socket) ----------------------------------------------------------------------
class Status(ControlOp):
    """The run's status; shards=False: without the shard list (its figures and the dispatch totals stay)."""
    op = "status"
    shards: Annotated[bool, OmitDefault()] = Field(default=True, description="true or false")
    Reply = RunStatus


class Pause(ControlOp):
    """Hold the shards (None: every shard) back from dispatch; requests in flight finish."""
    op = "pause"
    shards: Selection = Field(default=None, description='a list of shard ids or "all"')
    Reply = ShardsChanged


class Resume(ControlOp):
    """Dispatch the shards again (None: every shard, and the data-quality brake released: engine.run.brake)."""
    op = "resume"
    shards: Selection = Field(default=None, description='a list of shard ids or "all"')
    Reply = ShardsChanged


class RestartWorker(ControlOp):
    """Restart one worker's server."""
    op = "restart_worker"
    worker: str = Field(description="a worker's name, e.g. w0 (a string)")
    Reply = WorkerRestarted


class DrainHost(ControlOp):
    """Multi-host: send the host no new work (its requests in flight finish)."""
    op = "drain_host"
    host: str = Field(description="a [[hosts]] name of the run config (a string)")
    Reply = HostStatus


class UndrainHost(ControlOp):
    """Multi-host: send the host new work again."""
    op = "undrain_host"
    host: str = Field(description="a [[hosts]] name of the run config (a string)")
    Reply = HostStatus


class LogTail(ControlOp):
    """The last `lines` lines of a server's server.log, read where the server runs: this machine, a [[hosts]] host
    (over the supervisor's SSH to it) or a [slurm] job's dir. The console reaches only the supervisor's machine."""
    op = "log_tail"
    worker: str = Field(description="a worker's name, e.g. gpu0 (a string)")
    lines: int = Field(default=200, ge=1, le=MAX_LOG_LINES, description=f"an integer from 1 to {MAX_LOG_LINES}")
    Reply = LogText


class Drain(ControlOp):
    """End the run once the requests in flight are answered and committed."""
    op = "drain"
    Reply = RunEnding


class Stop(ControlOp):
    """End the run now: requests in flight are aborted (their samples are generated again on the next start)."""
    op = "stop"
    Reply = RunEnding


# -- engine.ctl's own ops (no supervisor needed) --------------------------------------------------------------------
class Hello(ControlOp):
    """Which engine answers and which protocol it speaks (engine.api.protocol)."""
    op = "hello"
    Reply = HelloResult


class LastStatus(ControlOp):
    """The status the run dir recorded (engine.observe.offline_status), for a run whose supervisor has exited."""
    op = "last_status"
    Reply = RunStatus


class Follow(ControlOp):
    """Stream the run's telemetry events with ts >= since (None: from the start) until the supervisor has exited
    and every line is sent (protocol 2)."""
    op = "follow"
    # always sent, null for from the start
    since: float | None = Field(default=None, description="a number (a unix time) or null")
    Reply = FollowEnded
    streams = True


Op = Status | Pause | Resume | RestartWorker | DrainHost | UndrainHost | LogTail | Drain | Stop  # the supervisor's
CtlOp = Hello | LastStatus | Follow  # answered by engine.ctl itself
ChannelOp = Op | CtlOp

SUPERVISOR_OPS: tuple[type[ControlOp], ...] = get_args(Op)
CHANNEL_OPS: tuple[type[ControlOp], ...] = get_args(ChannelOp)
OPS = tuple(cls.op for cls in SUPERVISOR_OPS)


def is_supervisor_op(op: ChannelOp) -> TypeGuard[Op]:
    """Whether the supervisor's control socket answers `op` (engine.ctl answers the others itself)."""
    return isinstance(op, SUPERVISOR_OPS)


def _name_of(value: Any) -> str | None:
    name = value.get("op") if isinstance(value, dict) else getattr(value, "op", None)
    return name if isinstance(name, str) else None


# the one union the codec reads and writes (engine.api.op_codec), told apart by "op"; built from CHANNEL_OPS, which
# the checker cannot follow: to it, AnyOp is the union it validates to
if TYPE_CHECKING:
    AnyOp: TypeAlias = ChannelOp
else:
    AnyOp = Annotated[Union[tuple(Annotated[cls, Tag(cls.op)] for cls in CHANNEL_OPS)], Discriminator(_name_of)]
