"""Reading one prompt file row by row, whatever its format (JSONL, a JSON array, Parquet; gzip'd or not): nothing
is loaded whole, and a malformed row is one Reject, the reading going on at the next one.
"""
from __future__ import annotations

import codecs
import gzip
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from engine.text.normalize import ID_FIELDS
from engine.text.row_errors import (
    EXCERPT_CHARS,
    PromptFileError,
    Reject,
    RowError,
    excerpt,
)

PARQUET_COLUMNS = frozenset(
    ID_FIELDS + ("messages", "conversations", "conversation", "prompt", "instruction", "input", "system", "source"))
FORMAT_BY_SUFFIX = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of an invalid byte
_STRUCTURAL = re.compile(r'[\[\]{}",]')
_JSON_STRING_TAIL = re.compile(r'[^"\\]*+(?:\\.[^"\\]*+)*+"', re.S)  # from just after an opening quote
_NON_WS = re.compile(r"\S")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800-\udfff escapes: checked by _loads
_DECODER = json.JSONDecoder()


def detect_format(path: Path, fmt: str = "auto") -> str:
    if fmt != "auto":
        return fmt
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    suffix = os.path.splitext(name)[1]
    guess = FORMAT_BY_SUFFIX.get(suffix)
    head = _read_head(path)
    if head.startswith(b"PAR1"):
        return "parquet"
    first = _NON_WS.search(head.decode("utf-8", "replace").lstrip("\ufeff"))
    char = first.group(0) if first else ""
    if guess in ("json", None) and char == "{":
        return "jsonl"  # many ".json" files are JSON lines
    if guess is None:
        if char == "[":
            return "json"
        raise PromptFileError(str(path), None, "unknown format (expected .jsonl, .json or .parquet, or set prompt_format)")
    return guess


def _read_head(path: Path, n: int = 4096) -> bytes:
    try:
        with open_binary(path) as f:
            return f.read(n)
    except OSError as exc:
        raise PromptFileError(str(path), str(exc)) from exc


def open_binary(path: Path):
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _loads(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        pass  # orjson refuses some valid JSON (integers over 64 bits); json.loads decides and names the error
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RowError("malformed_json", f"malformed JSON: {exc}") from None
    bad = _lone_surrogate(obj)
    if bad is not None:
        raise RowError("invalid_utf8", f"lone surrogate escape in JSON string: {bad!r} is not valid Unicode")
    return obj


def _lone_surrogate(value: Any) -> str | None:
    """The first string (key or value) holding a lone surrogate, which UTF-8 cannot encode."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return v[:40]
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


RowItem = tuple[int | None, int | None, Any, str, int | None]  # (line, row, parsed object, raw text, offset)


def jsonl_rows(path: Path, first_offset: int = 0, first_line: int = 1) -> Iterator[RowItem | Reject]:
    try:
        f = open_binary(path)
    except OSError as exc:
        raise PromptFileError(str(path), str(exc)) from exc
    offset = first_offset
    with f:
        if first_offset:
            try:
                f.seek(first_offset)
            except OSError as exc:
                raise PromptFileError(str(path), str(exc), f"cannot seek to byte {first_offset}") from exc
        for line_no, raw in enumerate(f, start=first_line):
            start = line_start = offset
            offset += len(raw)
            if line_no == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
                start += len(codecs.BOM_UTF8)
            if not raw.strip():
                continue  # blank lines are not rows
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield Reject(str(path), line_no, None,
                             f"invalid UTF-8 at byte {exc.start} of the line (file offset {start + exc.start}): {exc.reason}"
                             f" (byte 0x{raw[exc.start]:02x})",
                             excerpt(raw.decode("utf-8", "replace")), None, "invalid_utf8")
                continue
            try:
                obj = _loads(text)
            except RowError as exc:
                yield Reject(str(path), line_no, None, exc.reason, excerpt(text), None, exc.kind)
                continue
            yield line_no, None, obj, text, line_start


def json_array_rows(path: Path, chunk_size: int = 1 << 20, first_row: int = 0) -> Iterator[RowItem | Reject]:
    """Elements of a top-level JSON array, found by a structural scan over a sliding buffer."""
    try:
        f = open_binary(path)
    except OSError as exc:
        raise PromptFileError(str(path), str(exc)) from exc
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    with f:
        buf = ""
        eof = False

        def fill() -> bool:
            nonlocal buf, eof
            if eof:
                return False
            data = f.read(chunk_size)
            if not data:
                eof = True
                buf += decoder.decode(b"", final=True)
                return False
            buf += decoder.decode(data)
            return True

        fill()
        buf = buf.lstrip("\ufeff")
        pos = 0
        # the opening bracket
        while True:
            m = _NON_WS.search(buf, pos)
            if m or not fill():
                break
        if not m:
            return  # empty file: no rows
        if m.group(0) != "[":
            yield Reject(str(path), None, 0, f"not a JSON array: the file starts with {m.group(0)!r} (expected '[')",
                         excerpt(buf[m.start():m.start() + EXCERPT_CHARS]), None, "malformed_json")
            return
        pos = m.end()
        row = 0
        closed: str | None  # the delimiter after an element; None: the file ends inside it
        while True:
            # the next element start (or the closing bracket)
            while True:
                m = _NON_WS.search(buf, pos)
                if m or not fill():
                    break
            if not m:
                yield Reject(str(path), None, row, "malformed JSON: the array is not closed (file truncated?)", "",
                             None, "malformed_json")
                return
            if m.group(0) == "]":
                after = m.end()
                while True:
                    tail = _NON_WS.search(buf, after)
                    if tail or not fill():
                        break
                if tail:
                    yield Reject(str(path), None, row, "malformed JSON: extra data after the closing ']'",
                                 excerpt(buf[tail.start():tail.start() + EXCERPT_CHARS]), None, "malformed_json")
                return
            start = m.start()
            fast = _decode_element(buf, start)
            if row < first_row:  # before the start of a partial stream: only find the element's end
                if fast is not None:
                    end, closed = fast[1], fast[2]
                else:
                    end, closed = _scan_element(buf, start, fill_more=fill, get_buf=lambda: buf)
                row += 1
                if closed is None:
                    return
                pos = end + 1 if closed == "," else end
                if pos > chunk_size:
                    buf = buf[pos:]
                    pos = 0
                continue
            if fast is not None:
                obj, end, closed = fast
            else:  # malformed, or not complete in the buffer: the structural scan finds its extent
                obj = None
                end, closed = _scan_element(buf, start, fill_more=fill, get_buf=lambda: buf)
            text = buf[start:end]
            bad = _ESCAPED_BYTE.search(text)
            if bad:
                at = len(text[:bad.start()].encode("utf-8", "surrogateescape"))
                byte = ord(text[bad.start()]) - 0xDC00
                yield Reject(str(path), None, row, f"invalid UTF-8 at byte {at} of the row (byte 0x{byte:02x})",
                             excerpt(text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")),
                             None, "invalid_utf8")
            else:
                try:
                    if obj is None or _SURROGATE_ESCAPE.search(text):
                        obj = _loads(text)
                    yield None, row, obj, text, None
                except RowError as exc:
                    yield Reject(str(path), None, row, exc.reason, excerpt(text), None, exc.kind)
            row += 1
            if closed is None:
                return  # end of file inside an element: reported above as malformed
            pos = end + 1 if closed == "," else end
            # drop consumed text so the buffer stays small
            if pos > chunk_size:
                buf = buf[pos:]
                pos = 0


def _decode_element(buf: str, start: int) -> tuple[Any, int, str] | None:
    """Fast path: the C JSON scanner decodes one element; (obj, delimiter index, delimiter) when it
    is complete and followed by ',' or ']', else None (the caller falls back to the scan)."""
    try:
        obj, end = _DECODER.raw_decode(buf, start)
    except json.JSONDecodeError:
        return None
    m = _NON_WS.search(buf, end)
    if m is None or m.group(0) not in ",]":
        return None
    return obj, m.start(), m.group(0)


def _scan_element(buf: str, start: int, *, fill_more, get_buf) -> tuple[int, str | None]:
    """End of the element starting at `start`: the index of the ',' or ']' at array depth that
    follows it (returned with that char), or (len(buf), None) at end of file."""
    depth = 0
    pos = start
    while True:
        buf = get_buf()
        m = _STRUCTURAL.search(buf, pos)
        if not m:
            if fill_more():
                continue
            return len(get_buf()), None
        ch = m.group(0)
        if ch == '"':
            while True:
                buf = get_buf()
                s = _JSON_STRING_TAIL.match(buf, m.end())
                if s:
                    pos = s.end()
                    break
                if not fill_more():
                    return len(get_buf()), None
            continue
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            if depth == 0:
                if ch == "]":
                    return m.start(), "]"
                # a stray '}' stays in this element, which then fails to parse
            else:
                depth -= 1
        elif ch == "," and depth == 0:
            return m.start(), ","
        pos = m.end()


def parquet_rows(path: Path, batch_size: int = 2048, first_row: int = 0) -> Iterator[RowItem | Reject]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except OSError as exc:  # pyarrow raises ArrowInvalid (an OSError? no: ValueError) for corrupt files
        raise PromptFileError(str(path), str(exc)) from exc
    except (pa.ArrowInvalid, ValueError) as exc:
        raise PromptFileError(str(path), None, f"not a readable Parquet file: {exc}") from exc
    # read only the columns a row can use (datasets often carry large unrelated columns)
    names = pf.schema_arrow.names
    wanted = [n for n in names if n in PARQUET_COLUMNS]
    columns = wanted if wanted else None  # none known: read all, so the reject lists the row's keys
    row = 0
    groups: list[int] | None = None
    if first_row:  # a partial stream: start at the row group holding first_row, slice off the rest
        meta = pf.metadata
        groups = []
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            if row + n <= first_row and not groups:
                row += n
                continue
            groups.append(g)
    try:
        batches = (pf.iter_batches(batch_size=batch_size, columns=columns) if groups is None
                   else pf.iter_batches(batch_size=batch_size, columns=columns, row_groups=groups))
        for batch in batches:
            if row < first_row:
                if row + batch.num_rows <= first_row:
                    row += batch.num_rows
                    continue
                batch = batch.slice(first_row - row)
                row = first_row
            try:
                objs = batch.to_pylist()
            except UnicodeDecodeError:  # a string column with invalid UTF-8: find the rows, one by one
                objs = None
            for i in range(batch.num_rows):
                if objs is not None:
                    yield None, row, objs[i], "", None  # excerpt text is made only for a reject
                else:
                    try:
                        (obj,) = batch.slice(i, 1).to_pylist()
                        yield None, row, obj, "", None
                    except UnicodeDecodeError as exc:
                        yield Reject(str(path), None, row, f"invalid UTF-8 in a string column at byte {exc.start}: "
                                     f"{exc.reason}", excerpt(exc.object[:EXCERPT_CHARS].decode("utf-8", "replace")),
                                     None, "invalid_utf8")
                row += 1
    except (OSError, pa.ArrowInvalid) as exc:
        raise PromptFileError(str(path), str(exc), f"read failed at row {row}") from exc


def row_text(obj: Any) -> str:
    try:
        return json.dumps(obj, ensure_ascii=False, default=str)[: EXCERPT_CHARS * 2]
    except (TypeError, ValueError) as exc:
        return f"<row not printable: {exc}>"
