"""The console's control channel: PROTOCOL_VERSION, the request/reply envelope and its JSON-lines codec (the ops and
their replies: engine.api.ops, read and written by engine.api.op_codec). `python -m engine.ctl --run-dir D serve`
answers one JSON line per request, in order ({"id", "op"} -> {"id", "ok", "result" | "error", "kind"}; a follow
streams {"id", "event"} lines before its reply); a one-shot `engine.ctl OP` prints the reply without an id.
Bump PROTOCOL_VERSION when a request or reply changes meaning (an older console falls back to the one-shot form)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from engine.api.ops import ChannelOp, ControlError
from engine.api.op_codec import decode_op, encode_op

PROTOCOL_VERSION = 2  # 2: follow over the channel
SUPPORTED_PROTOCOLS = frozenset({1, 2})  # 1: the ops, without follow (the console follows one process then)


class ProtocolError(Exception):
    """A line that is not a request or reply of this protocol; `id` is the request's id when it could be read."""

    def __init__(self, message: str, id: int | None = None):
        super().__init__(message)
        self.id = id


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
    result: dict[str, Any] | None = None  # ok: the op's result (a status's is engine.api.status.RunStatus's to_dict())
    error: str = ""  # not ok: what went wrong, for the operator
    kind: ErrorKind = ErrorKind.REFUSED  # not ok: which way
    event: dict[str, Any] | None = None  # a follow's streamed event (ok, and not its last reply)


def encode_request(request: Request) -> bytes:
    return orjson.dumps({"id": request.id, "op": encode_op(request.op)}) + b"\n"


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
        return Request(id=rid, op=decode_op(data.get("op")))
    except ControlError as exc:
        raise ProtocolError(str(exc), id=rid) from exc


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


def _clip(line: bytes | str, limit: int = 300) -> str:
    text = line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."
