"""The console's control channel: PROTOCOL_VERSION, the hello op, the request/reply envelope and its JSON-lines codec.

`python -m engine.ctl --run-dir D serve` reads requests on stdin and writes replies on stdout, one JSON object per
line, in the order the requests came:

    {"id": 7, "op": {"op": "pause", "shards": ["s00001"]}}
    {"id": 7, "ok": true, "result": {...}}
    {"id": 8, "ok": false, "error": "no supervisor at ...", "kind": "no_supervisor"}
    {"id": 9, "op": {"op": "follow", "since": 1796220000.5}}
    {"id": 9, "event": {"type": "dispatch", "ts": ..., ...}}      (one line per telemetry event, as it is written)
    {"id": 9, "ok": true, "result": {"ended": "..."}}             (the supervisor exited and every event was sent)

`op` is a control op as engine.api.ops writes it, or a channel op served by engine.ctl itself (hello,
last_status, follow: no supervisor needed). Replies to other requests go on while a follow streams; a new follow
ends the one before it (its last reply says so). A one-shot `python -m engine.ctl --run-dir D OP ...` prints the same
reply without an id (an engine deployed before this module printed {"ok", "result" | "error"}: the same shape).
Bump PROTOCOL_VERSION when a request or reply changes meaning; a console that gets a version it does not support
(SUPPORTED_PROTOCOLS) in hello's reply uses the one-shot form.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

import orjson

from engine.api.ops import (ControlError, Drain, DrainHost, LogTail, Op, Pause, RestartWorker, Resume, Status,
                                    Stop, UndrainHost, parse_op, to_request)

PROTOCOL_VERSION = 2  # 2: follow over the channel
SUPPORTED_PROTOCOLS = frozenset({1, 2})  # 1: the ops, without follow (the console follows one process then)


class ProtocolError(Exception):
    """A line that is not a request or reply of this protocol; `id` is the request's id when it could be read."""

    def __init__(self, message: str, id: int | None = None):
        super().__init__(message)
        self.id = id


@dataclass(frozen=True)
class Hello:
    """Which engine answers and which protocol it speaks (served by engine.ctl itself)."""
    op: ClassVar[str] = "hello"


@dataclass(frozen=True)
class LastStatus:
    """The status the run dir recorded (engine.observe.offline_status), for a run whose supervisor has exited."""
    op: ClassVar[str] = "last_status"


@dataclass(frozen=True)
class Follow:
    """Stream the run's telemetry events with ts >= since (None: from the start) until the supervisor has exited
    and every line is sent (served by engine.ctl itself, protocol 2)."""
    op: ClassVar[str] = "follow"
    since: float | None = None


ChannelOp = Op | Hello | LastStatus | Follow
LOCAL_OPS: dict[str, type[Hello] | type[LastStatus] | type[Follow]] = {Hello.op: Hello, LastStatus.op: LastStatus,
                                                                       Follow.op: Follow}


@dataclass(frozen=True)
class HelloResult:
    engine_version: str  # engine.__version__ of the engine that answers
    protocol: int

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine_version, "protocol": self.protocol}

    @classmethod
    def from_dict(cls, data: Any) -> "HelloResult":
        if not (isinstance(data, dict) and isinstance(data.get("engine"), str)
                and isinstance(data.get("protocol"), int)):
            raise ProtocolError(f'hello\'s result must be {{"engine": str, "protocol": int}}; got {data!r}')
        return cls(engine_version=data["engine"], protocol=data["protocol"])


class ErrorKind(StrEnum):
    REFUSED = "refused"  # the supervisor answered, refusing the op (its text says why)
    NO_SUPERVISOR = "no_supervisor"  # nothing answers at the run dir's control socket (or no run dir there)
    BAD_REQUEST = "bad_request"  # the line was not a request of this protocol


@dataclass(frozen=True)
class Request:
    id: int
    op: ChannelOp


@dataclass(frozen=True)
class Reply:
    id: int | None  # None: a one-shot engine.ctl command's reply (no request id)
    ok: bool
    result: dict[str, Any] | None = None  # ok: the op's result (a status's is engine.observe.status's to_dict())
    error: str = ""  # not ok: what went wrong, for the operator
    kind: ErrorKind = ErrorKind.REFUSED  # not ok: which way
    event: dict[str, Any] | None = None  # a follow's streamed event (ok, and not its last reply)


def encode_request(request: Request) -> bytes:
    return orjson.dumps({"id": request.id, "op": op_to_json(request.op)}) + b"\n"


def decode_request(line: bytes | str) -> Request:
    """One request line; ProtocolError (with the id, when there is one) when it is not one."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"request is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ProtocolError(f'a request is {{"id": int, "op": {{...}}}}; got {data!r}')
    rid = data.get("id")
    if not isinstance(rid, int) or isinstance(rid, bool):
        raise ProtocolError(f'a request needs an integer "id"; got {rid!r}')
    try:
        return Request(id=rid, op=op_from_json(data.get("op")))
    except ControlError as exc:
        raise ProtocolError(str(exc), id=rid) from exc


def op_to_json(op: ChannelOp) -> dict[str, Any]:
    if isinstance(op, Follow):
        return {"op": op.op, "since": op.since}
    return {"op": op.op} if isinstance(op, (Hello, LastStatus)) else to_request(op)


def op_from_json(data: Any) -> ChannelOp:
    """A request's op; ControlError (its text names the known ops) when it is not one."""
    name = data.get("op") if isinstance(data, dict) else None
    if name == Follow.op:
        since = data.get("since")
        if since is not None and (not isinstance(since, (int, float)) or isinstance(since, bool)):
            raise ControlError(f'"since" must be a number (a unix time) or null; got {since!r}')
        return Follow(since=None if since is None else float(since))
    if isinstance(name, str) and name in LOCAL_OPS:
        return LOCAL_OPS[name]()
    try:
        return parse_op(data)
    except ControlError as exc:
        raise ControlError(f"{exc}, {', '.join(LOCAL_OPS)}") from exc


def encode_event_line(rid: int, line: bytes) -> bytes:
    """A follow's streamed event: the telemetry line as written (a JSON object), not parsed again."""
    return b'{"id":%d,"event":%s}\n' % (rid, line.strip())


def encode_reply(reply: Reply) -> bytes:
    data: dict[str, Any] = {} if reply.id is None else {"id": reply.id}
    data["ok"] = reply.ok
    if reply.ok:
        data["result"] = reply.result if reply.result is not None else {}
    else:
        data["error"] = reply.error
        data["kind"] = reply.kind.value
    return orjson.dumps(data) + b"\n"


def decode_reply(line: bytes | str) -> Reply:
    """One reply line (with an id: the channel's; without: a one-shot command's, of this engine or an older one)."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"reply is not JSON: {exc}: {_clip(line)}") from exc
    if not isinstance(data, dict) or not (isinstance(data.get("ok"), bool) or "event" in data):
        raise ProtocolError(f'a reply is {{"id": int, "ok": bool, ...}}; got {_clip(line)}')
    rid = data.get("id")
    if rid is not None and (not isinstance(rid, int) or isinstance(rid, bool)):
        raise ProtocolError(f'a reply\'s "id" must be an integer; got {rid!r}')
    if "event" in data and "ok" not in data:
        if rid is None or not isinstance(data["event"], dict):
            raise ProtocolError(f'a follow\'s event line is {{"id": int, "event": {{...}}}}; got {_clip(line)}')
        return Reply(id=rid, ok=True, event=data["event"])
    if data["ok"]:
        result = data.get("result")
        if result is not None and not isinstance(result, dict):
            raise ProtocolError(f'a reply\'s "result" must be an object; got {_clip(line)}')
        return Reply(id=rid, ok=True, result=result or {})
    try:
        kind = ErrorKind(data.get("kind", ErrorKind.REFUSED.value))
    except ValueError as exc:
        raise ProtocolError(f'unknown error kind {data.get("kind")!r} in {_clip(line)}') from exc
    return Reply(id=rid, ok=False, error=str(data.get("error") or "error reply without text"), kind=kind)


def ctl_argv(op: ChannelOp) -> list[str]:
    """The one-shot form's arguments for an op (`python -m engine.ctl --run-dir D <these>`), which every engine
    version's engine.ctl parses (hello excepted: an engine that has it has the channel)."""
    if isinstance(op, (Pause, Resume)):
        return [op.op, *(["--all"] if op.shards is None else op.shards)]
    if isinstance(op, Status):
        return ["status"] if op.shards else ["status", "--no-shards"]
    if isinstance(op, RestartWorker):
        return ["restart-worker", op.worker]
    if isinstance(op, (DrainHost, UndrainHost)):
        return [op.op.replace("_", "-"), op.host]
    if isinstance(op, LogTail):
        return ["log-tail", op.worker, "--lines", str(op.lines)]
    if isinstance(op, LastStatus):
        return ["last-status"]
    if isinstance(op, Follow):
        return ["follow", *([] if op.since is None else ["--since", repr(op.since)])]
    if isinstance(op, (Drain, Stop, Hello)):
        return [op.op]
    raise TypeError(f"not a channel op: {op!r}")


def _clip(line: bytes | str, limit: int = 300) -> str:
    text = line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."
