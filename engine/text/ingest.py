"""Stream prompt files (JSONL, JSON array, Parquet) into normalized conversations or rejects.

Nothing is loaded whole: JSONL is read line by line (bytes, decoded per line, so invalid
UTF-8 rejects one line), a JSON array is split into its elements by a small structural
scanner over a sliding buffer (each element then parsed on its own, so one malformed element
is one reject and the scan resynchronizes on the next one), Parquet is read in record batches.

Order is deterministic: files sorted by path, rows in file order. `Conversation.index`
counts good conversations in that order, so it depends only on the file contents and is
stable across restarts.

Duplicate ids are detected with an in-memory dict id -> first origin (one entry per good
conversation, the origin packed in one int: measured ~150 MB peak growth for 10^6 uuid ids).
"""
from __future__ import annotations

import codecs
import errno
import glob
import gzip
import json
import os
import re
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from probes.host.candidates import Search, describe, find_candidates

EXCERPT_CHARS = 200
ID_FIELDS = ("id", "conversation_id", "uuid", "sample_id")
ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "system": "system",
}
PARQUET_COLUMNS = frozenset(
    ID_FIELDS + ("messages", "conversations", "conversation", "prompt", "instruction", "input", "system", "source"))
FORMAT_BY_SUFFIX = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".pq": "parquet"}
_GLOB_CHARS = re.compile(r"[*?\[]")
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # what surrogateescape makes of an invalid byte
_STRUCTURAL = re.compile(r'[\[\]{}",]')
_JSON_STRING_TAIL = re.compile(r'[^"\\]*+(?:\\.[^"\\]*+)*+"', re.S)  # from just after an opening quote
_NON_WS = re.compile(r"\S")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800-\udfff escapes: checked by _loads
_DECODER = json.JSONDecoder()
_POS_MASK = (1 << 40) - 1


@dataclass(frozen=True)
class Reject:
    file: str
    line: int | None
    row: int | None
    reason: str  # human text, e.g. "malformed JSON: Expecting ',' delimiter: line 1 column 9 (char 8)"
    excerpt: str
    conversation_id: str | None = None
    kind: str = ""  # stable category for counting: malformed_json, unknown_role, duplicate_id, ...

    @property
    def category(self) -> str:
        return self.kind or self.reason

    def to_dict(self) -> dict:
        return {
            "file": self.file,
            "line": self.line,
            "row": self.row,
            "reason": self.reason,
            "kind": self.category,
            "excerpt": self.excerpt,
            "conversation_id": self.conversation_id,
        }


@dataclass(frozen=True)
class Conversation:
    conversation_id: str
    source: str
    origin: str
    index: int
    messages: tuple[dict, ...]
    file: str = ""  # the prompt file path this row came from
    line: int | None = None  # JSONL line (1-based)
    row: int | None = None  # JSON array / Parquet row (0-based)
    offset: int | None = None  # JSONL: byte offset of the line in the (decompressed) file, for seeking

    def reject(self, reason: str, kind: str = "") -> Reject:
        """A reject for this conversation found after ingest (e.g. prompt longer than the context)."""
        excerpt = _excerpt(json.dumps(list(self.messages), ensure_ascii=False))
        return Reject(self.file, self.line, self.row, reason, excerpt, self.conversation_id, kind)


class PromptFileError(Exception):
    """A prompt path that cannot be read: names the path and carries the OS error text; for a path that is
    not there, where it looked for the file and what it found (the same finder as `regen probe`'s)."""

    def __init__(self, path: str, os_error: str | None, detail: str = "", candidates: Search | None = None):
        self.path = str(path)
        self.os_error = os_error
        self.detail = detail
        self.candidates = candidates
        parts = [f"prompt file {self.path}"]
        if detail:
            parts.append(detail)
        if os_error:
            parts.append(os_error)
        lines = [": ".join(parts)]
        if candidates is not None:
            lines += ["  " + line for line in describe(candidates)]
        super().__init__("\n".join(lines))

    @classmethod
    def not_found(cls, pattern: str, os_error: str | None, detail: str = "") -> PromptFileError:
        """For a path or glob that names no file: searches for candidates (bounded: 2 s)."""
        return cls(pattern, os_error, detail, candidates=find_candidates(pattern))


class _RowError(Exception):
    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


# ---------------------------------------------------------------------------------------------
# files


def resolve_prompt_files(patterns: Sequence[str]) -> list[Path]:
    """Expand globs (`**` allowed), check plain paths exist; sorted, de-duplicated."""
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [str(patterns)]
    if not patterns:
        raise PromptFileError("(none)", None, "no prompt paths given")
    found: dict[str, Path] = {}
    for pattern in patterns:
        pattern = os.path.expanduser(str(pattern))
        if _GLOB_CHARS.search(pattern):
            matches = [m for m in glob.glob(pattern, recursive=True) if os.path.isfile(m)]
            if not matches:
                raise PromptFileError.not_found(pattern, _glob_miss_text(pattern), "glob matched no files")
        else:
            try:
                st = os.stat(pattern)
            except OSError as exc:
                raise PromptFileError.not_found(pattern, str(exc)) from exc
            if os.path.isdir(pattern):
                err = IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), pattern)
                raise PromptFileError(pattern, str(err), f"is a directory (use a glob such as {pattern}/*.jsonl)")
            if not stat.S_ISREG(st.st_mode):
                raise PromptFileError(pattern, None, "not a regular file")
            matches = [pattern]
        for m in matches:
            found.setdefault(os.path.realpath(m), Path(m))
    return sorted(found.values(), key=str)


def _glob_miss_text(pattern: str) -> str:
    """The OS error for the deepest literal directory of a glob, or ENOENT for the pattern itself."""
    literal = []
    for part in Path(pattern).parts:
        if _GLOB_CHARS.search(part):
            break
        literal.append(part)
    base = Path(*literal) if literal else Path(".")
    try:
        entries = os.listdir(base)
    except OSError as exc:
        return str(exc)
    err = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), pattern)
    return f"{err} (looked in {base}/, which has {len(entries)} entries)"


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
        with _open_binary(path) as f:
            return f.read(n)
    except OSError as exc:
        raise PromptFileError(str(path), str(exc)) from exc


def _open_binary(path: Path):
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def display_names(files: Sequence[Path]) -> dict[Path, str]:
    """The name used in fallback ids and origins: the file name, or a longer relative path where
    two files share a name (so `a/train.jsonl:1` and `b/train.jsonl:1` stay distinct)."""
    by_name: dict[str, list[Path]] = {}
    for p in files:
        by_name.setdefault(p.name, []).append(p)
    out = {}
    for name, group in by_name.items():
        if len(group) == 1:
            out[group[0]] = name
            continue
        common = os.path.commonpath([str(p.resolve().parent) for p in group])
        for p in group:
            out[p] = os.path.relpath(p.resolve(), common)
    return out


# ---------------------------------------------------------------------------------------------
# iteration


@dataclass(frozen=True)
class StreamStart:
    """Where a stream over the same files can start without reading what comes before: the
    position of one good conversation (saved by a full pass, see engine.run.feed's count cache)."""
    file_no: int  # index into the sorted resolved files
    position: int  # JSONL: byte offset of the line; JSON array / Parquet: row number
    line: int | None  # JSONL: that line's number (1-based); None for row-based files
    index: int  # that conversation's index


def iter_prompts(patterns: Sequence[str], fmt: str = "auto", *, files: Sequence[Path] | None = None,
                 start: StreamStart | None = None,
                 skip: Mapping[int, frozenset[int] | set[int]] | None = None) -> Iterator[Conversation | Reject]:
    """Every row of the prompt files, in order: a Conversation or a Reject.

    `files`: the resolved files (default: resolve `patterns`). `start`: begin at that position
    (files before it are not opened, rows before it not read); a partial stream then needs
    `skip`, the positions (per file number: JSONL line, or row) that the FULL stream rejected,
    so that rows rejected as duplicates of ids seen before `start` are skipped too and every
    conversation gets the same index as in the full stream. Skipped rows yield nothing."""
    files = resolve_prompt_files(patterns) if files is None else list(files)
    names = display_names(files)
    seen: dict[str, int] = {}  # conversation id -> first origin, packed as file number << 40 | line or row
    row_based: list[bool] = []  # per file: positions are 0-based rows (JSON array, Parquet), not lines
    index = start.index if start is not None else 0
    for file_no, path in enumerate(files):
        kind = detect_format(path, fmt) if start is None or file_no >= start.file_no else "jsonl"
        row_based.append(kind != "jsonl")
        if start is not None and file_no < start.file_no:
            continue
        # the readers' arguments differ (jsonl resumes at a byte offset and line, the others at a row)
        reader: Callable[..., Iterator[RowItem | Reject]] | None = {
            "jsonl": _jsonl_rows, "json": _json_array_rows, "parquet": _parquet_rows}.get(kind)
        if reader is None:
            raise PromptFileError(str(path), None, f"unknown prompt format {kind!r}")
        name = names[path]
        skipped = (skip or {}).get(file_no) or ()
        if start is not None and file_no == start.file_no:
            rows = (_jsonl_rows(path, start.position, start.line or 1) if kind == "jsonl"
                    else reader(path, first_row=start.position))
        else:
            rows = reader(path)
        for item in rows:
            if isinstance(item, Reject):
                if skipped and (item.line if item.line is not None else item.row) in skipped:
                    continue
                yield item
                continue
            line, row, obj, text, offset = item
            pos = line if line is not None else row
            if pos is None:  # every reader numbers its rows by line or by row
                raise ValueError(f"{path}: a row read with neither a line nor a row number")
            if skipped and pos in skipped:
                continue
            origin = f"{name}:{line}" if line is not None else f"{name}:row{row}"
            try:
                messages, conv_id, source = _normalize(obj)
            except _RowError as exc:
                yield Reject(str(path), line, row, exc.reason, _excerpt(text or _row_text(obj)), _row_id(obj),
                             exc.kind)
                continue
            if conv_id is None:
                conv_id = origin
            first = seen.get(conv_id)
            if first is not None:
                f_no, f_pos = first >> 40, first & _POS_MASK
                f_name = names[files[f_no]]
                first_origin = f"{f_name}:row{f_pos}" if row_based[f_no] else f"{f_name}:{f_pos}"
                yield Reject(str(path), line, row, f"duplicate id {conv_id!r} (first seen at {first_origin})",
                             _excerpt(text or _row_text(obj)), conv_id, "duplicate_id")
                continue
            seen[conv_id] = file_no << 40 | pos
            yield Conversation(conv_id, source or str(path), origin, index, messages, str(path), line, row, offset)
            index += 1


def _excerpt(text: str) -> str:
    text = " ".join(text[: EXCERPT_CHARS * 4].split())  # one line, whatever the file's layout
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "…"


def _loads(text: str) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        pass  # orjson refuses some valid JSON (integers over 64 bits); json.loads decides and names the error
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _RowError("malformed_json", f"malformed JSON: {exc}") from None
    bad = _lone_surrogate(obj)
    if bad is not None:
        raise _RowError("invalid_utf8", f"lone surrogate escape in JSON string: {bad!r} is not valid Unicode")
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


def _jsonl_rows(path: Path, first_offset: int = 0, first_line: int = 1) -> Iterator[RowItem | Reject]:
    try:
        f = _open_binary(path)
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
                             _excerpt(raw.decode("utf-8", "replace")), None, "invalid_utf8")
                continue
            try:
                obj = _loads(text)
            except _RowError as exc:
                yield Reject(str(path), line_no, None, exc.reason, _excerpt(text), None, exc.kind)
                continue
            yield line_no, None, obj, text, line_start


def _json_array_rows(path: Path, chunk_size: int = 1 << 20, first_row: int = 0) -> Iterator[RowItem | Reject]:
    """Elements of a top-level JSON array, found by a structural scan over a sliding buffer."""
    try:
        f = _open_binary(path)
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
                         _excerpt(buf[m.start():m.start() + EXCERPT_CHARS]), None, "malformed_json")
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
                                 _excerpt(buf[tail.start():tail.start() + EXCERPT_CHARS]), None, "malformed_json")
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
                             _excerpt(text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")),
                             None, "invalid_utf8")
            else:
                try:
                    if obj is None or _SURROGATE_ESCAPE.search(text):
                        obj = _loads(text)
                    yield None, row, obj, text, None
                except _RowError as exc:
                    yield Reject(str(path), None, row, exc.reason, _excerpt(text), None, exc.kind)
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


def _parquet_rows(path: Path, batch_size: int = 2048, first_row: int = 0) -> Iterator[RowItem | Reject]:
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
                                     f"{exc.reason}", _excerpt(exc.object[:EXCERPT_CHARS].decode("utf-8", "replace")),
                                     None, "invalid_utf8")
                row += 1
    except (OSError, pa.ArrowInvalid) as exc:
        raise PromptFileError(str(path), str(exc), f"read failed at row {row}") from exc


def _row_text(obj: Any) -> str:
    try:
        return json.dumps(obj, ensure_ascii=False, default=str)[: EXCERPT_CHARS * 2]
    except (TypeError, ValueError) as exc:
        return f"<row not printable: {exc}>"


# ---------------------------------------------------------------------------------------------
# normalization


def _row_id(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return None
    for key in ID_FIELDS:
        value = obj.get(key)
        if value is None or value == "":
            continue
        if isinstance(value, (dict, list)):
            continue
        return str(value)
    return None


def _normalize(obj: Any) -> tuple[tuple[dict, ...], str | None, str | None]:
    if not isinstance(obj, dict):
        raise _RowError("not_object", f"not an object (a JSON {_json_type(obj)})")
    turns = None
    for key in ("messages", "conversations", "conversation"):
        if obj.get(key) is not None:
            turns = obj[key]
            field_name = key
            break
    if turns is None and isinstance(obj.get("prompt"), list):
        turns, field_name = obj["prompt"], "prompt"
    if turns is not None:
        messages = _normalize_turns(turns, field_name)
    elif "prompt" in obj:
        messages = _single_turn(obj, _require_text(obj["prompt"], "prompt"))
    elif "instruction" in obj:
        instruction = _require_text(obj["instruction"], "instruction")
        extra = obj.get("input")
        extra = "" if extra is None else _require_text(extra, "input")
        messages = _single_turn(obj, f"{instruction}\n\n{extra}" if extra.strip() else instruction)
    else:
        keys = ", ".join(sorted(map(str, obj))[:12]) or "none"
        raise _RowError("no_conversation",
                        f"no conversation: expected 'messages', 'conversations', 'prompt' or 'instruction' (keys: {keys})")
    if not messages:
        raise _RowError("empty_conversation", "empty conversation")
    if not any(m["role"] == "user" for m in messages):
        raise _RowError("no_user_turn", "no user turn (roles: " + ", ".join(m["role"] for m in messages) + ")")
    source = obj.get("source")
    return tuple(messages), _row_id(obj), source if isinstance(source, str) and source else None


def _single_turn(obj: dict, text: str) -> list[dict]:
    if not text.strip():
        raise _RowError("empty_conversation", "empty conversation (the prompt text is empty)")
    messages = []
    system = obj.get("system")
    if system is not None:
        system = _require_text(system, "system")
        if system.strip():
            messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": text})
    return messages


def _normalize_turns(turns: Any, field_name: str) -> list[dict]:
    if not isinstance(turns, list):
        raise _RowError("bad_conversation", f"'{field_name}' is not a list (a JSON {_json_type(turns)})")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _RowError("bad_conversation", f"{field_name}[{i}] is not an object (a JSON {_json_type(turn)})")
        role = turn.get("role", turn.get("from"))
        if not isinstance(role, str):
            raise _RowError("unknown_role", f"{field_name}[{i}] has no role (expected 'role' or 'from')")
        norm = ROLE_ALIASES.get(role.strip().lower())
        if norm is None:
            raise _RowError("unknown_role", f"unknown role {role!r} in {field_name}[{i}]"
                                            " (known: user/human, assistant/gpt/bot/model, system)")
        content = turn["content"] if "content" in turn else turn.get("value")
        messages.append({"role": norm, "content": _content_text(content, f"{field_name}[{i}]")})
    return messages


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                what = part.get("type") if isinstance(part, dict) else _json_type(part)
                raise _RowError("non_string_content", f"non-string content in {where}: part {j} is {what!r}, not text")
        return "\n".join(texts)
    raise _RowError("non_string_content", f"non-string content in {where} (a JSON {_json_type(content)})")


def _require_text(value: Any, where: str) -> str:
    return _content_text(value, f"'{where}'")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
