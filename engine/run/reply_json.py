"""A /generate reply's JSON with its top-level output_ids read straight into an int32 array, exactly.

The ids' text is checked against JSON's grammar for a list of non-negative integers and converted by numpy (orjson's
int-per-id path cost ~12-15% of the engine's CPU); anything else takes orjson's own path, so the result, or the
error, is orjson's.
"""
from __future__ import annotations

import secrets
from array import array
from typing import Any

import numpy as np
import orjson

_KEY = b'"output_ids":['
_META = b'],"meta_info":'
# stands in for the ids while orjson reads the rest: no server can write it, so finding it as the top-level
# output_ids proves the list cut out was that one (and the last, where a key is repeated: orjson keeps the last;
# otherwise orjson reads the reply whole)
_NONCE = "regen-ids-" + secrets.token_hex(16)
_HOLE = b'"' + _NONCE.encode() + b'"'
_ALLOWED = b"0123456789,"
_INT32_MAX = 2**31 - 1
MIN_IDS_BYTES = 2048  # shorter lists (a streamed delta of a few ids) go through orjson: numpy's per-call cost


def loads(payload: bytes) -> Any:
    """orjson.loads(payload), except that a top-level output_ids list comes as array("i") of the same ids. Any: decoded
    JSON, whose shape its caller checks."""
    first, end = _ids_span(payload)
    if end - first >= MIN_IDS_BYTES and payload[first - len(_KEY) - 1] in b"{, ":
        ids = int32_ids(payload[first:end])
        if ids is not None:
            try:
                data = orjson.loads(payload[:first - 1] + _HOLE + payload[end + 1:])
            except orjson.JSONDecodeError:
                data = None  # orjson's own error, from the reply as it came
            if type(data) is dict and data.get("output_ids") == _NONCE:
                data["output_ids"] = ids
                return data
    return orjson.loads(payload)


def _ids_span(payload: bytes) -> tuple[int, int]:
    """Where the top-level output_ids list's inside may be, (first, end); (0, 0) when not found. SGLang writes text,
    output_ids, meta_info in that order: the ids end where meta_info starts, found from the payload's end (~300
    bytes) without scanning the text (a search for the key from the start read ~7 us of text an answer)."""
    end = payload.rfind(_META)
    if end > 0:
        first = payload.rfind(b"[", 0, end) + 1
        if first > len(_KEY) and payload.startswith(_KEY, first - len(_KEY)):
            return first, end
    start = payload.find(_KEY)
    if start <= 0:
        return 0, 0
    first = start + len(_KEY)
    return first, payload.find(b"]", first)


def int32_ids(text: bytes) -> array[int] | None:
    """The ids of `text`, a JSON list's inside ("12,0,345"), as array("i"); None unless every number is a
    non-negative JSON integer (no sign, no leading zero, no space) that fits an int32."""
    if not text or text.translate(None, _ALLOWED):
        return None  # a byte that is neither a digit nor a comma
    try:
        # text mode (sep): not the deprecated binary one. uint64: numpy reads it with an unsigned strtoul, int64 through
        # the signed strtol wrapped around it (~15% slower over a 4,000-id answer); no sign can be in the text, and a
        # number past 2**64 - 1 reads as 2**64 - 1 (strtoul saturates), which the int32 check below refuses
        values = np.fromstring(text, dtype=np.uint64, sep=",")
    except (ValueError, DeprecationWarning):  # a text it stops short in, under warnings as errors
        return None
    if not values.size or (top := int(values.max())) > _INT32_MAX:
        return None
    # the values written in their fewest digits, one comma between each, are the whole text: so no number
    # is empty or led by a zero, and numpy read to the end
    written: int | np.intp = 2 * values.size - 1  # numpy's counts added on
    power = 10
    while power <= top:
        written += np.count_nonzero(values >= power)
        power *= 10
    if written != len(text):
        return None
    out = array("i")
    out.frombytes(values.astype(np.int32).tobytes())
    return out
