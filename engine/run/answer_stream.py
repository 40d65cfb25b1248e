"""One streamed /generate answer read as it arrives: SSE events to exact output ids, text and finish, with the
runaway detector fed on every chunk.

A chunk carries new ids (0.5.5, --incremental-streaming-output) or all so far (0.5.10+; contract 2.4, 7.6):
meta_info.completion_tokens says which; a chunk that fits neither is an error, never a guess.
"""
from __future__ import annotations

import functools
import struct
from array import array
from collections.abc import Sequence
from typing import Any

import orjson

from engine.run import reply_json
from engine.run.runaway import Repetition, RunawayDetector


class StreamError(ValueError):
    """A stream that cannot be read as SGLang writes it (the message says what was wrong)."""


class AnswerStream:
    """Feed it the response body as it arrives (`feed`); it keeps the exact ids and says when the guard fires."""

    __slots__ = ("ids", "meta", "finish", "error", "done", "verdict", "chunks", "_detector", "_buf", "_scan",
                 "_cumulative_ids", "_last_text", "_pieces", "_text_cumulative")

    def __init__(self, detector: RunawayDetector | None):
        self.ids = array("i")  # every output id delivered, exactly as the server generated them
        self.meta: dict[str, Any] = {}  # the latest chunk's meta_info (JSON)
        self.finish: dict[str, Any] | None = None  # the final chunk's finish_reason (None: no final chunk seen)
        self.error: str | None = None  # an error event's message
        self.done = False  # [DONE] seen
        self.verdict: Repetition | None = None  # set once, when the detector fires
        self.chunks = 0
        self._detector = detector
        self._buf = bytearray()  # the start of an event the network cut (empty between whole events)
        self._scan = 0  # where to look for the next event end in _buf
        self._cumulative_ids: bool | None = None
        self._last_text = ""
        # the texts as deltas: (suffix past the previous chunk's text, whether the text began with that one); a
        # cumulative text keeps only its suffixes, a delta text whole (see text)
        self._pieces: list[tuple[str, bool]] = []
        self._text_cumulative = True

    # -- input -------------------------------------------------------------------------------------------------
    def feed(self, data: bytes) -> Repetition | None:
        """Bytes of the response body; the detector's verdict the first time it fires, else None."""
        if self._buf:  # an event the network cut: completed here, then read from one bytes object
            self._buf += data
            if _event_end(self._buf, self._scan) < 0:
                self._scan = len(self._buf) - 1
                return None
            data = bytes(self._buf)
            self._buf.clear()
        fired = None
        start = 0
        size = len(data)
        while (end := data.find(b"\n", start)) >= 0:
            if end + 1 >= size:
                break  # the blank line that ends the event has not arrived
            if data[end + 1] == 10 and data.startswith(b"data: ", start):  # SGLang's one-line event
                verdict = self._payload(data[start + 6:end])
            else:
                if data[end + 1] != 10 and (end := _event_end(data, end + 1)) < 0:
                    break
                verdict = self._event(data[start:end])
            fired = fired or verdict
            start = end + 2
        if start < size:
            self._buf += data[start:] if start else data
            self._scan = len(self._buf) - 1
        return fired

    def _event(self, event: bytes) -> Repetition | None:
        """An event of several lines, or comments: its data lines' values joined (the SSE rules)."""
        return self._payload(b"".join(line[5:].lstrip(b" ") for line in event.split(b"\n")
                                      if line.startswith(b"data:")))

    def _payload(self, payload: bytes) -> Repetition | None:
        if not payload:
            return None  # an SSE comment or keep-alive
        if payload == b"[DONE]":
            self.done = True
            return None
        if self.done:
            raise StreamError("an event after data: [DONE]")
        try:
            chunk = reply_json.loads(payload)  # output_ids as array("i") when long (reply_json says why)
        except orjson.JSONDecodeError as exc:
            raise StreamError(f"an event that is not JSON ({exc}): {payload[:200]!r}") from None
        if not isinstance(chunk, dict):
            raise StreamError(f"an event that is not a JSON object: {payload[:200]!r}")
        if "error" in chunk:
            err = chunk["error"]
            self.error = str(err.get("message", err)) if isinstance(err, dict) else str(err)
            return None
        if self.finish is not None:
            raise StreamError("a chunk after the final one (finish_reason set)")
        self.chunks += 1
        meta = chunk.get("meta_info")
        self.meta = meta if isinstance(meta, dict) else {}
        before = len(self.ids)
        self._merge_ids(chunk.get("output_ids"))
        self._merge_text(chunk.get("text"))
        finish = self.meta.get("finish_reason")
        if finish is not None:
            self.finish = finish if isinstance(finish, dict) else {"type": str(finish)}
            return None
        if self._detector is None or self.verdict is not None or len(self.ids) == before:
            return None
        self.verdict = self._detector.feed(self.ids, before)
        return self.verdict

    def _merge_ids(self, ids: object) -> None:
        if type(ids) is not array and not isinstance(ids, list):
            raise StreamError(f"output_ids is {type(ids).__name__}, not a list")
        have = len(self.ids)
        total = self.meta.get("completion_tokens")
        if not isinstance(total, int) or isinstance(total, bool):
            total = None
        if total is not None and total == have + len(ids) and (have == 0 or total != len(ids)):
            cumulative = False
        elif total is not None and total == len(ids):
            cumulative = True
        elif total is None and self._cumulative_ids is not None:
            cumulative = self._cumulative_ids
        elif total is None:
            cumulative = have > 0 and len(ids) >= have and ids[:have] == (self.ids if type(ids) is array
                                                                              else self.ids.tolist())
        else:
            raise StreamError(f"chunk {self.chunks}: {len(ids)} output_ids with completion_tokens={total} after "
                              f"{have} ids: neither the new ids nor all of them")
        if have and self._cumulative_ids is not None and cumulative != self._cumulative_ids:
            raise StreamError(f"chunk {self.chunks}: output_ids switched from "
                              f"{'cumulative' if self._cumulative_ids else 'new'} ids to the other kind")
        if have:
            self._cumulative_ids = cumulative
        try:
            if cumulative:
                if (ids[:have] if type(ids) is array else array("i", ids[:have])) != self.ids:
                    raise StreamError(f"chunk {self.chunks}: cumulative output_ids differ from the {have} ids "
                                      "streamed before")
                self.ids.extend(ids[have:])
            else:
                self.ids.extend(ids if type(ids) is array else int32_array(ids))
        except (TypeError, OverflowError) as exc:
            raise StreamError(f"chunk {self.chunks}: output_ids are not int32 token ids: {exc}") from None

    def _merge_text(self, text: object) -> None:
        if not isinstance(text, str):
            return
        follows = text.startswith(self._last_text)
        self._pieces.append((text[len(self._last_text):], True) if follows else (text, False))
        self._text_cumulative = self._text_cumulative and follows
        self._last_text = text

    # -- output ------------------------------------------------------------------------------------------------
    @property
    def text(self) -> str | None:
        """The server's text of the ids: the last chunk's when every text began with the one before (cumulative),
        else the texts joined (deltas). None when no chunk had a text."""
        if not self._pieces:
            return None
        if self._text_cumulative:
            return self._last_text
        raw: list[str] = []  # each chunk's own text, rebuilt from its suffix
        for suffix, follows in self._pieces:
            raw.append(raw[-1] + suffix if follows and raw else suffix)
        return "".join(raw)

    @property
    def cumulative_ids(self) -> bool | None:
        """What the server streams: True all ids so far, False only the new ones, None not yet known."""
        return self._cumulative_ids


def _event_end(buf: bytes | bytearray, pos: int) -> int:
    """Where the event going on at `pos` ends (the first newline of the blank line after it), or -1 when its end has
    not arrived. Searched newline by newline: a one-byte find is memchr, a search for b"\\n\\n" scans ~70x slower
    (35 us over a 4,000-id chunk)."""
    while (nl := buf.find(b"\n", pos)) >= 0:
        if nl + 1 >= len(buf):
            return -1
        if buf[nl + 1] == 10:  # b"\n"
            return nl
        pos = nl + 1
    return -1


def int32_array(values: Sequence[int]) -> array[int]:
    """array("i", values), about twice as fast: struct packs the list in one C loop, array() checks and
    converts item by item. A value that is no int32 makes struct refuse it; array() then raises its own
    TypeError / OverflowError, so a bad reply gets the same error text as before."""
    out = array("i")
    try:
        out.frombytes(_int32_packer(len(values)).pack(*values))
    except struct.error:
        return array("i", values)
    return out


@functools.lru_cache(maxsize=4096)
def _int32_packer(n: int) -> struct.Struct:
    # struct's own cache of compiled formats holds 100: answer lengths vary over thousands of values
    return struct.Struct(f"{n}i")
