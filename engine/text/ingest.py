"""Stream prompt files into normalized conversations or rejects, in a deterministic order: files sorted by path, rows
in file order; `Conversation.index` counts the good conversations in that order, so it is stable across restarts. A
duplicate id is a reject naming where it was first seen."""
from __future__ import annotations

import errno
import glob
import json
import os
import re
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.text.normalize import normalize_row, row_id
from engine.text.prompt_readers import (
    RowItem,
    detect_format,
    json_array_rows,
    jsonl_rows,
    parquet_rows,
    row_text,
)
from engine.text.row_errors import PromptFileError, Reject, RowError, excerpt

_GLOB_CHARS = re.compile(r"[*?\[]")
_POS_MASK = (1 << 40) - 1


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
        text = excerpt(json.dumps(list(self.messages), ensure_ascii=False))
        return Reject(self.file, self.line, self.row, reason, text, self.conversation_id, kind)


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
            "jsonl": jsonl_rows, "json": json_array_rows, "parquet": parquet_rows}.get(kind)
        if reader is None:
            raise PromptFileError(str(path), None, f"unknown prompt format {kind!r}")
        name = names[path]
        skipped = (skip or {}).get(file_no) or ()
        if start is not None and file_no == start.file_no:
            rows = (jsonl_rows(path, start.position, start.line or 1) if kind == "jsonl"
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
                messages, conv_id, source = normalize_row(obj)
            except RowError as exc:
                yield Reject(str(path), line, row, exc.reason, excerpt(text or row_text(obj)), row_id(obj),
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
                             excerpt(text or row_text(obj)), conv_id, "duplicate_id")
                continue
            seen[conv_id] = file_no << 40 | pos
            yield Conversation(conv_id, source or str(path), origin, index, messages, str(path), line, row, offset)
            index += 1


# ---------------------------------------------------------------------------------------------
# normalization


