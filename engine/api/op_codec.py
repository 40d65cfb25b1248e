"""The one codec of the control ops (engine.api.ops): encode_op / decode_op through one pydantic TypeAdapter of their
union (a bad request is refused with a ControlError naming the field and what it must be), and each op's reply read
back into its declared type (decode_result: the console) or checked on its way out (encode_reply_of: the supervisor).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, cast

from pydantic import TypeAdapter, ValidationError

from engine.api.ops import CHANNEL_OPS, AnyOp, ChannelOp, ControlError, ControlOp, WireReply
from engine.api.wire import decode

_OPS: TypeAdapter[ChannelOp] = TypeAdapter(AnyOp)
_BY_NAME: dict[str, type[ControlOp]] = {cls.op: cls for cls in CHANNEL_OPS}


def encode_op(op: ChannelOp) -> dict[str, Any]:
    """The op's JSON request object ({"op": name, ...its arguments}), as every protocol version wrote it."""
    # pydantic types the dump as Any; every op serializes to a dict (ControlOp._named)
    return cast(dict[str, Any], _OPS.dump_python(op, mode="json"))


def decode_op(data: Any) -> ChannelOp:
    """One decoded JSON request as its op; ControlError (the reply's text) names an unknown op, or each field that is
    not what it must be, with the value that came."""
    try:
        return _OPS.validate_python(data)
    except ValidationError as exc:
        raise ControlError(_refusal(data, exc)) from None


def _refusal(data: Any, exc: ValidationError) -> str:
    name = data.get("op") if isinstance(data, dict) else None
    cls = _BY_NAME.get(name) if isinstance(name, str) else None
    if cls is None:
        return f"unknown op {name!r}; known: {', '.join(_BY_NAME)}"
    said: dict[str, str] = {}
    for error in exc.errors(include_url=False):
        key = str(error["loc"][1]) if len(error["loc"]) > 1 else "op"
        info = cls.model_fields.get(key)
        must = info.description if info is not None and info.description else error["msg"]
        said.setdefault(key, f'"{key}" must be {must}; got {data.get(key)!r}')
    return "; ".join(said.values())


def reply_type(op: ControlOp | type[ControlOp]) -> type:
    """The type of the op's reply (its class's Reply)."""
    return op.Reply


def decode_result(op: ChannelOp, data: Any, what: str) -> Any:
    """An op's result (decoded JSON) as its reply type; WireError (engine.api.wire) names a malformed field. A type
    with its own from_dict(data, what) reads itself (RunStatus: what an older engine left out)."""
    cls = reply_type(op)
    own = getattr(cls, "from_dict", None)
    return own(data, what) if own is not None else decode(cls, data, what)


def encode_reply_of(op: ChannelOp, reply: WireReply | dict[str, Any]) -> dict[str, Any]:
    """A handler's reply to `op` as its JSON result; TypeError when it is not the op's reply type (a dict passes as
    the JSON form already: a stand-in supervisor's)."""
    if isinstance(reply, dict):
        return reply
    expected = reply_type(op)
    if not isinstance(reply, expected):
        raise TypeError(f"{op.op}'s handler replied a {type(reply).__name__}, not its {expected.__name__}")
    return reply.to_dict()


class _ReplyTypes(Mapping[type, type]):
    """Each op class answered by one reply -> its reply type (a follow streams: its last reply is the channel's)."""

    def __getitem__(self, cls: type) -> type:
        if cls not in CHANNEL_OPS or cls.streams:
            raise KeyError(cls)
        return reply_type(cls)

    def __iter__(self) -> Iterator[type]:
        return (cls for cls in CHANNEL_OPS if not cls.streams)

    def __len__(self) -> int:
        return sum(1 for _ in self)


REPLY_TYPES: Mapping[type, type] = _ReplyTypes()
