"""Data-quality statistics of a run's shards, vectorized over the Parquet parts.

Reads only committed parts (the `parts` table of run_dir/state.sqlite, opened read-only), so a
run in progress can be inspected at any time: a part file a writer is still producing (or an
orphan a crash left behind) is not in the table and is ignored; a part compacted away between the
listing and its read (engine.store.shard_store) makes the listing be read again. Without state.sqlite, the
files are found by globbing shards/**/part-*.parquet and shards/**/shard.parquet, and the report says so.

What is read: source, worker, prompt_len, output_len, reasoning_tokens, finish_reason, text and
prompt_opened (whether the prompt opened the think block; parts written before it existed lack it:
False) of every part (never input_ids). Everything is computed with pyarrow.compute kernels and numpy over
whole columns; there is no per-row Python loop.

Loss-mask sums: sum(loss_mask) equals output_len by construction (engine.store.shard_store validates
it at commit), so the distribution is computed from output_len. That identity is checked, not
assumed: the loss_mask column is read for every row of runs up to MASK_CHECK_FULL_ROWS samples
(or with mask_check="full"); for larger runs, for the first MASK_CHECK_HEAD_ROWS rows of a
spread sample of the parts (5%, at least 8: decoding list<uint8> is by far the costliest read).
For every row checked we verify
  len(loss_mask) == prompt_len + output_len, sum(loss_mask) == output_len,
  and no 1 within the first prompt_len positions
which together prove the mask is exactly 0^prompt_len 1^output_len -- the layout the cut
computation clamp(N - prompt_len, 0, output_len) relies on. Any mismatch is an integrity error.

Empty answers use the rule of engine.text.answer_shape.is_empty_answer, translated to RE2 patterns
(pyarrow's regex engine); tests/test_stats.py checks both agree on a battery of texts.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sqlite3
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engine.text.answer_shape import EMPTY_MAX_VISIBLE_TOKENS, THINK_CLOSE, THINK_OPEN
from engine.store.shard_store import REPETITION, SHARD_FILE, SHARDS_DIR, STATE_DB, read_committed
from engine.api.events import AlertEvent
from engine.api.wire import AlertKind, Severity

SCHEMA = "regen.stats/1"
DEFAULT_TRAIN_MAX_LENGTH = 4096
DEFAULT_EMPTY_THRESHOLD = 0.05
DEFAULT_TRUNCATED_THRESHOLD = 0.10
DEFAULT_REPETITION_THRESHOLD = 0.05  # as runaway.alert_share (engine.config.load.Runaway)
MASK_CHECK_FULL_ROWS = 100_000  # up to this many samples every mask is checked (mask_check="auto")
MASK_CHECK_SAMPLE_SHARE = 0.05  # otherwise this share of the parts (at least MASK_CHECK_MIN_PARTS)
MASK_CHECK_MIN_PARTS = 8
MASK_CHECK_HEAD_ROWS = 4096  # sampled parts have their first rows checked (decoding the mask is the cost)
MAX_ERROR_EXAMPLES = 20
LIST_ATTEMPTS = 5  # listings read again when parts vanished under the reader (each time: a shard compacted)

STAT_COLUMNS = ["source", "worker", "prompt_len", "output_len", "reasoning_tokens", "finish_reason", "text"]
OPENED_COLUMN = "prompt_opened"

# --- the shared empty-answer rule, in RE2 ----------------------------------------------------
# Python's str.isspace() set (what str.strip() and `\s` in a str pattern use); RE2's \s is ASCII only.
_WS = r"[\t\n\x0b\x0c\r\x1c-\x1f \x{85}\x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}]"
_WS_INNER = _WS[1:-1]
# Python's `\w` on str: letters, digits/numerics and underscore.
_W = r"[\pL\pN_]"
_SPECIAL_TOKEN_RE2 = r"<\|[^|<>" + _WS_INNER + r"]{1,64}\|>"
_VISIBLE_TOKEN_RE2 = r"(?:" + _W + r"+|[^\pL\pN_" + _WS_INNER + r"])"
_AT_MOST_N_VISIBLE = r"^" + _WS + r"*(?:" + _VISIBLE_TOKEN_RE2 + _WS + r"*){0," + str(EMPTY_MAX_VISIBLE_TOKENS) + r"}$"
_ONLY_WS = r"^" + _WS + r"*$"
_CLOSE = THINK_CLOSE.replace("/", r"\/")
_CLOSE_REVERSED = THINK_CLOSE[::-1].replace("/", r"\/")


class StatsReadError(OSError):
    """The run dir (or a committed part in it) cannot be read; the message names the path and the OS error."""


# --- result types ----------------------------------------------------------------------------


@dataclass
class Count:
    count: int
    share: float  # of the samples it is counted over (0.0 when there are none)


@dataclass
class Distribution:
    count: int
    mean: float | None
    min: int | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: int | None


@dataclass
class HistogramBin:
    label: str  # "0", "1", "2-3", "4-7", ...
    low: int  # inclusive
    high: int  # inclusive
    count: int
    share: float


@dataclass
class LossMaskStats:
    distribution: Distribution
    histogram: list[HistogramBin]
    computed_from: str  # "output_len (checked against loss_mask, see integrity.mask_check)"


@dataclass
class CutStats:
    train_max_length: int
    supervised_tokens_total: int
    supervised_tokens_kept: int
    supervised_tokens_cut: int
    cut_share: float
    samples_cut: int  # samples with prompt_len + output_len > N (lose some supervision)
    samples_cut_share: float
    samples_unsupervised: int  # prompt_len >= N: lose all supervision
    samples_unsupervised_share: float


@dataclass
class GroupStats:
    name: str
    samples: int
    empty: Count
    truncated: Count
    aborted: Count
    mean_output: float | None
    output_tokens: int
    flagged: list[str] = field(default_factory=list)  # "empty", "truncated", "repetition" above the thresholds
    repetition: Count = field(default_factory=lambda: Count(0, 0.0))  # stopped by the runaway guard


@dataclass
class ShardStats(GroupStats):
    parts: int = 0
    total_conversations: int | None = None  # planned (shards table), None without state.sqlite
    paused: bool | None = None


@dataclass
class MaskCheck:
    mode: str  # full | sample | off
    parts_checked: int
    rows_checked: int
    mismatches: int


@dataclass
class IntegrityError:
    kind: str  # mask_sum | mask_length | mask_layout | mask_values | rows | sqlite_counts | missing_part | unreadable_part
    path: str
    detail: str


@dataclass
class Flag:
    key: str  # stable: "empty_share", "truncated_share", "integrity", "worker:<name>:empty_share", ...
    severity: Severity  # warning | error
    text: str
    value: float
    threshold: float | None


@dataclass
class PartsRead:
    listed_from: str  # "state.sqlite" | "glob"
    committed: int
    read: int
    rows: int
    uncommitted_ignored: int  # part files on disk that are not committed (in progress or crash leftovers)
    missing: list[str]


@dataclass
class RunStats:
    run_dir: str
    generated_at: float
    elapsed_s: float
    parts: PartsRead
    notes: list[str]
    thresholds: dict[str, float]
    samples: int
    empty: Count
    truncated: Count
    aborted: Count
    repetition: Count  # finish_reason "repetition": stopped by the runaway guard
    reasoning: dict[str, Count]  # present | missing | unterminated
    loss_mask: LossMaskStats
    lengths: dict[str, Distribution]  # output | reasoning | prompt
    cut: CutStats
    by_source: list[GroupStats]
    by_worker: list[GroupStats]
    by_shard: list[ShardStats]
    mask_check: MaskCheck
    integrity_errors: list[IntegrityError]
    integrity_error_count: int
    flags: list[Flag]
    # samples planned and settled without a row (state.sqlite outcomes): rejected, failed, and of the rejected
    # after_cut (later turns not generated after a cut turn, turns_after_cut = "stop"); {} without state.sqlite
    not_generated: dict[str, int] = field(default_factory=dict)

    @property
    def quality_flagged(self) -> bool:
        return bool(self.flags)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d = {"schema": SCHEMA, **d}
        return d


# --- vectorized per-part computation ---------------------------------------------------------


def empty_answer_mask(text: pa.Array | pa.ChunkedArray, prompt_opened: np.ndarray | None = None) -> pa.Array:
    """is_empty_answer(text, prompt_opened) for a whole column (boolean array), with RE2 string kernels;
    `prompt_opened` is a numpy bool per row (None: no prompt opened a block).

    Only rows whose reasoning is blank go through the answer kernels (most rows have reasoning).
    RE2 is slow with capture groups, so "text before the last </think>" is taken on the reversed
    string (leftmost lazy match), never with `^(.*)</think>`."""
    if isinstance(text, pa.ChunkedArray):
        text = text.combine_chunks()
    text = text.fill_null("")
    has_close = pc.match_substring(text, THINK_CLOSE)
    has_open = pc.match_substring(text, THINK_OPEN)
    if prompt_opened is not None and prompt_opened.any():
        has_open = pc.or_(has_open, pa.array(prompt_opened))  # a block is open from the output's first token
    # head: up to the last </think>; else the whole text when a block is open; else ""
    reversed_tail_cut = pc.replace_substring_regex(pc.utf8_reverse(text), "(?s)^.*?" + _CLOSE_REVERSED, "",
                                                   max_replacements=1)
    head_closed = pc.utf8_reverse(reversed_tail_cut)
    head = pc.if_else(has_close, head_closed, pc.if_else(has_open, text, pa.scalar("", pa.string())))
    # reasoning: head after its first <think> (when it has one)
    reasoning = pc.replace_substring_regex(head, "(?s)^.*?<think>", "", max_replacements=1)
    blank = pc.match_substring_regex(reasoning, _ONLY_WS)
    result = np.zeros(len(text), dtype=bool)
    candidates = np.flatnonzero(_np_bool(blank))
    if candidates.size:
        idx = pa.array(candidates)
        sub, sub_close, sub_open = text.take(idx), has_close.take(idx), has_open.take(idx)
        # answer: after the last </think>; "" for an unterminated block; the whole text without tags
        answer_closed = pc.replace_substring_regex(sub, r"(?s)^.*" + _CLOSE, "")
        answer = pc.if_else(sub_close, answer_closed, pc.if_else(sub_open, pa.scalar("", pa.string()), sub))
        cleaned = pc.replace_substring_regex(answer, _SPECIAL_TOKEN_RE2, " ")
        result[candidates] = _np_bool(pc.match_substring_regex(cleaned, _AT_MOST_N_VISIBLE))
    return pa.array(result)


THINK_PRESENT, THINK_MISSING, THINK_UNTERMINATED = 0, 1, 2
THINK_NAMES = ("present", "missing", "unterminated")
FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_OTHER, FINISH_REPETITION = 0, 1, 2, 3, 4


def think_codes(text: pa.Array | pa.ChunkedArray, prompt_opened: np.ndarray | None = None) -> np.ndarray:
    """think_state(text, prompt_opened) for a whole column: 0 present, 1 missing, 2 unterminated."""
    has_close = _np_bool(pc.match_substring(text, THINK_CLOSE))
    has_open = _np_bool(pc.match_substring(text, THINK_OPEN))
    if prompt_opened is not None:
        has_open = has_open | prompt_opened
    return np.where(has_close, THINK_PRESENT, np.where(has_open, THINK_UNTERMINATED, THINK_MISSING)).astype(np.int8)


def _np_bool(arr) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    return arr.fill_null(False).to_numpy(zero_copy_only=False)


def _np_int(arr) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    return arr.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


@dataclass
class _PartResult:
    path: str
    shard_id: str
    rows: int
    prompt_len: np.ndarray
    output_len: np.ndarray
    reasoning_tokens: np.ndarray
    finish: np.ndarray
    empty: np.ndarray
    think: np.ndarray
    source_values: list[str]
    source_codes: np.ndarray
    worker_values: list[str]
    worker_codes: np.ndarray
    mask_rows_checked: int
    mask_mismatches: int
    errors: list[IntegrityError]


def _dictionary(col) -> tuple[list[str], np.ndarray]:
    enc = pc.dictionary_encode(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
    return enc.dictionary.to_pylist(), enc.indices.to_numpy(zero_copy_only=False).astype(np.int32)


def check_mask(mask, prompt_len: np.ndarray, output_len: np.ndarray, path: str) -> tuple[int, list[IntegrityError]]:
    """Rows where loss_mask is not exactly 0^prompt_len 1^output_len; returns (mismatching rows, errors)."""
    if isinstance(mask, pa.ChunkedArray):
        mask = mask.combine_chunks()
    raw = mask.offsets.to_numpy().astype(np.int64)  # a sliced array keeps its parent's offsets: rebase
    values = mask.values.slice(int(raw[0]), int(raw[-1] - raw[0])).to_numpy(zero_copy_only=False)
    offsets = raw - raw[0]
    lengths = np.diff(offsets)
    # ones before flat position k = searchsorted(positions of the ones, k): cheaper than a cumsum
    ones = np.flatnonzero(values)
    before = np.searchsorted(ones, offsets)
    sums = before[1:] - before[:-1]
    bad_len = lengths != prompt_len + output_len
    bad_sum = sums != output_len
    prompt_end = offsets[:-1] + np.minimum(prompt_len, lengths)
    bad_layout = (np.searchsorted(ones, prompt_end) - before[:-1]) != 0
    bad_values = np.zeros(len(lengths), dtype=bool)
    if values.size and values.max(initial=0) > 1:
        big = np.searchsorted(np.flatnonzero(values > 1), offsets)
        bad_values = (big[1:] - big[:-1]) != 0
    errors: list[IntegrityError] = []
    for kind, bad, what in (
        ("mask_length", bad_len, lambda i: f"row {i}: len(loss_mask)={lengths[i]} != prompt_len {prompt_len[i]} + output_len {output_len[i]}"),
        ("mask_sum", bad_sum, lambda i: f"row {i}: sum(loss_mask)={sums[i]} != output_len={output_len[i]}"),
        ("mask_layout", bad_layout, lambda i: f"row {i}: loss_mask has 1s within the prompt (first {prompt_len[i]} positions)"),
        ("mask_values", bad_values, lambda i: f"row {i}: loss_mask has values other than 0/1"),
    ):
        for i in np.flatnonzero(bad)[:3]:
            errors.append(IntegrityError(kind, path, what(int(i))))
    mismatching = int(np.count_nonzero(bad_len | bad_sum | bad_layout | bad_values))
    return mismatching, errors


def _read_mask_head(path: Path, rows: int) -> pa.Array:
    """The loss_mask of the first `rows` rows: the reader decodes pages as it goes, so stopping
    early skips decoding the rest of the column."""
    with pq.ParquetFile(path) as f:
        for batch in f.iter_batches(batch_size=rows, columns=["loss_mask"], use_threads=False):
            return batch.column(0)
    return pa.array([], type=pa.list_(pa.uint8()))


def _read_part(run_dir: Path, rel: str, shard_id: str, expected_rows: int | None, mask: str) -> _PartResult:
    """mask: "all" (check every row's loss_mask), "head" (the first MASK_CHECK_HEAD_ROWS) or "none"."""
    path = run_dir / rel
    columns = STAT_COLUMNS + (["loss_mask"] if mask == "all" else [])
    try:
        with pq.ParquetFile(path) as f:
            if OPENED_COLUMN in f.schema_arrow.names:
                columns = columns + [OPENED_COLUMN]
            table = f.read(columns=columns, use_threads=False)
        mask_column = (table.column("loss_mask") if mask == "all"
                       else _read_mask_head(path, MASK_CHECK_HEAD_ROWS) if mask == "head" else None)
    except FileNotFoundError as exc:
        raise _MissingPart(rel, str(exc)) from exc
    except (OSError, pa.ArrowException) as exc:
        raise _UnreadablePart(rel, f"{type(exc).__name__}: {exc}") from exc
    text = table.column("text")
    prompt_len = _np_int(table.column("prompt_len"))
    output_len = _np_int(table.column("output_len"))
    fr = table.column("finish_reason")
    finish = np.full(table.num_rows, FINISH_OTHER, dtype=np.int8)
    finish[_np_bool(pc.equal(fr, "stop"))] = FINISH_STOP
    finish[_np_bool(pc.equal(fr, "length"))] = FINISH_LENGTH
    finish[_np_bool(pc.equal(fr, "abort"))] = FINISH_ABORT
    finish[_np_bool(pc.equal(fr, REPETITION))] = FINISH_REPETITION
    errors: list[IntegrityError] = []
    if expected_rows is not None and expected_rows != table.num_rows:
        errors.append(IntegrityError("rows", rel, f"state.sqlite says {expected_rows} rows, the file has {table.num_rows}"))
    mask_rows = mismatches = 0
    if mask_column is not None:
        n = len(mask_column)
        mismatches, mask_errors = check_mask(mask_column, prompt_len[:n], output_len[:n], rel)
        errors += mask_errors
        mask_rows = n
    opened = _np_bool(table.column(OPENED_COLUMN)) if OPENED_COLUMN in table.column_names else None
    sources, source_codes = _dictionary(table.column("source"))
    workers, worker_codes = _dictionary(table.column("worker"))
    return _PartResult(
        path=rel, shard_id=shard_id, rows=table.num_rows, prompt_len=prompt_len, output_len=output_len,
        reasoning_tokens=_np_int(table.column("reasoning_tokens")), finish=finish,
        empty=_np_bool(empty_answer_mask(text, opened)), think=think_codes(text, opened),
        source_values=sources, source_codes=source_codes, worker_values=workers, worker_codes=worker_codes,
        mask_rows_checked=mask_rows, mask_mismatches=mismatches, errors=errors)


class _MissingPart(Exception):
    def __init__(self, rel: str, detail: str):
        super().__init__(detail)
        self.rel, self.detail = rel, detail


class _UnreadablePart(_MissingPart):
    pass


# --- listing parts ---------------------------------------------------------------------------


@dataclass
class _Listing:
    listed_from: str
    parts: Sequence[tuple[str, str, int | None]]  # (relative path, shard_id, rows; None: not recorded, "glob")
    shards: Mapping[str, tuple[int | None, bool | None]]  # shard_id -> (total conversations, paused)
    uncommitted: int
    notes: list[str]
    # part path -> (samples, empty, truncated) as the store recorded them at commit (samples table)
    recorded: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    not_generated: dict[str, int] = field(default_factory=dict)  # engine.store.shard_store.CommittedParts.not_generated


def _part_files_on_disk(run_dir: Path) -> list[str]:
    """Part files and compacted shard files (shards/<id>/part-*.parquet, shards/<id>/shard.parquet)."""
    found = []
    for name in ("part-*.parquet", SHARD_FILE):
        found += glob.glob(str(run_dir / SHARDS_DIR / "**" / name), recursive=True)
    return sorted(Path(p).relative_to(run_dir).as_posix() for p in found)


def _list_parts(run_dir: Path) -> _Listing:
    try:
        entries = os.listdir(run_dir)
    except OSError as exc:
        raise StatsReadError(f"cannot read run dir {run_dir}: {exc.strerror or exc}") from exc
    if not (run_dir / SHARDS_DIR).is_dir() and STATE_DB not in entries:
        raise StatsReadError(f"{run_dir} is not a run dir: it has neither {STATE_DB} nor {SHARDS_DIR}/ "
                             f"(found: {', '.join(sorted(entries)[:10]) or 'nothing'})")
    on_disk = _part_files_on_disk(run_dir)
    db_path = run_dir / STATE_DB
    if STATE_DB not in entries:
        shard_of = {p: Path(p).parent.name for p in on_disk}
        return _Listing("glob", [(p, shard_of[p], None) for p in on_disk], {}, 0,
                        [f"no {STATE_DB} in {run_dir}: read every part file found under {SHARDS_DIR}/ "
                         "(committed or not: an interrupted write could be counted)"])
    try:
        committed_parts = read_committed(run_dir)
    except sqlite3.Error as exc:
        raise StatsReadError(f"cannot read {db_path} (opened read-only): {exc}") from exc
    parts, recorded, shards = committed_parts.parts, committed_parts.recorded, committed_parts.shards
    committed = {p for p, _, _ in parts}
    uncommitted = sum(1 for p in on_disk if p not in committed)
    notes = []
    if uncommitted:
        notes.append(f"{uncommitted} part file(s) under {SHARDS_DIR}/ are not committed in {STATE_DB} "
                     "(being written, or left by a crash): ignored")
    return _Listing(STATE_DB, parts, shards, uncommitted, notes, recorded, committed_parts.not_generated)


def _mask_check_mode(requested: str, total_rows: int | None) -> str:
    if requested != "auto":
        return requested
    return "full" if total_rows is not None and total_rows <= MASK_CHECK_FULL_ROWS else "sample"


def _mask_check_parts(n_parts: int, mode: str) -> set[int]:
    if mode == "off" or n_parts == 0:
        return set()
    if mode == "full":
        return set(range(n_parts))
    want = min(n_parts, max(MASK_CHECK_MIN_PARTS, math.ceil(n_parts * MASK_CHECK_SAMPLE_SHARE)))
    # spread evenly over the run (first and last part included), deterministic
    return {int(round(i)) for i in np.linspace(0, n_parts - 1, want)}


# --- aggregation -----------------------------------------------------------------------------


def _count(n: int, of: int) -> Count:
    return Count(int(n), (n / of) if of else 0.0)


def distribution(values: np.ndarray) -> Distribution:
    """Percentiles with numpy's default (linear interpolation; = statistics.quantiles(method='inclusive'))."""
    if values.size == 0:
        return Distribution(0, None, None, None, None, None, None)
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return Distribution(int(values.size), float(values.mean()), int(values.min()), float(p50), float(p90),
                        float(p99), int(values.max()))


def log2_histogram(values: np.ndarray) -> list[HistogramBin]:
    """Bins 0, 1, 2-3, 4-7, ..., [2^k, 2^(k+1)-1] up to the bin holding the max."""
    if values.size == 0:
        return []
    v = values.astype(np.int64)
    _, exponent = np.frexp(np.maximum(v, 1).astype(np.float64))  # v = m * 2^e, m in [0.5, 1): floor(log2 v) = e-1
    index = np.where(v <= 0, 0, exponent)  # 0 -> bin 0, [2^(e-1), 2^e - 1] -> bin e
    counts = np.bincount(index, minlength=int(index.max()) + 1)
    bins = []
    total = int(v.size)
    for i, c in enumerate(counts):
        low, high = (0, 0) if i == 0 else (1 << (i - 1), (1 << i) - 1)
        label = str(low) if low == high else f"{low}-{high}"
        bins.append(HistogramBin(label, low, high, int(c), int(c) / total))
    return bins


def _groups(names: list[str], codes: np.ndarray, empty, finish, output_len, thresholds) -> list[GroupStats]:
    n = len(names)
    samples = np.bincount(codes, minlength=n)
    empties = np.bincount(codes, weights=empty, minlength=n)
    truncated = np.bincount(codes, weights=finish == FINISH_LENGTH, minlength=n)
    aborted = np.bincount(codes, weights=finish == FINISH_ABORT, minlength=n)
    repetition = np.bincount(codes, weights=finish == FINISH_REPETITION, minlength=n)
    tokens = np.bincount(codes, weights=output_len, minlength=n)
    out = []
    for i, name in enumerate(names):
        s = int(samples[i])
        if s == 0:
            continue
        g = GroupStats(name, s, _count(int(empties[i]), s), _count(int(truncated[i]), s),
                       _count(int(aborted[i]), s), float(tokens[i]) / s, int(tokens[i]),
                       repetition=_count(int(repetition[i]), s))
        g.flagged = _group_flags(g, thresholds)
        out.append(g)
    return out


def _group_flags(g: GroupStats, thresholds: dict[str, float]) -> list[str]:
    flags = []
    if g.empty.share > thresholds["empty_share"]:
        flags.append("empty")
    if g.truncated.share > thresholds["truncated_share"]:
        flags.append("truncated")
    if g.repetition.share > thresholds["repetition_share"]:
        flags.append("repetition")
    return flags


def _merge_codes(parts: list[_PartResult], attr: str) -> tuple[list[str], np.ndarray]:
    names: dict[str, int] = {}
    chunks = []
    for p in parts:
        local = getattr(p, f"{attr}_values")
        mapping = np.array([names.setdefault(v, len(names)) for v in local], dtype=np.int32)
        codes = getattr(p, f"{attr}_codes")
        chunks.append(mapping[codes] if codes.size else codes)
    codes = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    ordered = sorted(names, key=names.__getitem__)
    return ordered, codes


def compute_stats(run_dir: Path, *, train_max_length: int = DEFAULT_TRAIN_MAX_LENGTH,
                  empty_threshold: float = DEFAULT_EMPTY_THRESHOLD,
                  truncated_threshold: float = DEFAULT_TRUNCATED_THRESHOLD,
                  repetition_threshold: float = DEFAULT_REPETITION_THRESHOLD,
                  mask_check: str = "auto", threads: int | None = None) -> RunStats:
    """Statistics of the committed shards of `run_dir`. Raises StatsReadError when the run dir
    cannot be read; a committed part that is missing or unreadable is an integrity error."""
    if mask_check not in ("auto", "full", "sample", "off"):
        raise ValueError(f"mask_check={mask_check!r}: must be auto, full, sample or off")
    if train_max_length < 1:
        raise ValueError(f"train_max_length={train_max_length}: must be >= 1")
    started = time.perf_counter()
    run_dir = Path(run_dir).expanduser()
    for attempt in range(LIST_ATTEMPTS):
        listing = _list_parts(run_dir)
        mode, check_idx, errors, missing, results = _read_listing(run_dir, listing, mask_check, threads)
        if not missing or listing.listed_from == "glob" or attempt == LIST_ATTEMPTS - 1:
            break
        # a part listed, then gone: compacted into its shard's file in between (engine.store.shard_store), unless
        # it is still committed (then it is missing for real, an integrity error): read a fresh listing
        if set(missing) <= {p for p, _, _ in _list_parts(run_dir).parts}:
            break

    if listing.recorded:
        # the store counted empties with engine.text.answer_shape at commit; the vectorized rule must agree
        for p in results:
            rec = listing.recorded.get(p.path)
            got = (p.rows, int(p.empty.sum()), int(np.count_nonzero(p.finish == FINISH_LENGTH)))
            if rec is None:
                errors.append(IntegrityError("sqlite_counts", p.path, f"no samples of this part in {STATE_DB}"))
            elif rec != got:
                errors.append(IntegrityError(
                    "sqlite_counts", p.path, f"{STATE_DB} samples table says (samples, empty, truncated) = {rec}, "
                    f"the part file gives {got}"))

    cat = (lambda attr, dtype: np.concatenate([getattr(p, attr) for p in results]).astype(dtype, copy=False)
           if results else np.zeros(0, dtype=dtype))
    prompt_len = cat("prompt_len", np.int64)
    output_len = cat("output_len", np.int64)
    reasoning = cat("reasoning_tokens", np.int64)
    finish = cat("finish", np.int8)
    empty = cat("empty", bool)
    think = cat("think", np.int8)
    n = int(output_len.size)

    thresholds = {"empty_share": float(empty_threshold), "truncated_share": float(truncated_threshold),
                  "repetition_share": float(repetition_threshold)}
    mask_rows = sum(p.mask_rows_checked for p in results)
    mismatches = sum(p.mask_mismatches for p in results)
    mask = MaskCheck(mode, sum(1 for p in results if p.mask_rows_checked), mask_rows, mismatches)

    kept = np.clip(train_max_length - prompt_len, 0, output_len)
    total_sup = int(output_len.sum())
    kept_sum = int(kept.sum())
    samples_cut = int(np.count_nonzero(prompt_len + output_len > train_max_length))
    unsupervised = int(np.count_nonzero(prompt_len >= train_max_length))
    cut = CutStats(train_max_length, total_sup, kept_sum, total_sup - kept_sum,
                   (total_sup - kept_sum) / total_sup if total_sup else 0.0,
                   samples_cut, samples_cut / n if n else 0.0, unsupervised, unsupervised / n if n else 0.0)

    sources, source_codes = _merge_codes(results, "source")
    worker_names, worker_codes = _merge_codes(results, "worker")
    shard_ids = sorted({s for _, s, _ in listing.parts} | set(listing.shards))
    shard_index = {s: i for i, s in enumerate(shard_ids)}
    shard_codes = (np.concatenate([np.full(p.rows, shard_index[p.shard_id], dtype=np.int32) for p in results])
                   if results else np.zeros(0, dtype=np.int32))
    by_source = _groups(sources, source_codes, empty, finish, output_len, thresholds)
    by_worker = _groups(worker_names, worker_codes, empty, finish, output_len, thresholds)
    shard_groups = {g.name: g for g in _groups(shard_ids, shard_codes, empty, finish, output_len, thresholds)}
    parts_per_shard: dict[str, int] = {}
    for p in results:
        parts_per_shard[p.shard_id] = parts_per_shard.get(p.shard_id, 0) + 1
    by_shard = []
    for sid in shard_ids:
        g = shard_groups.get(sid) or GroupStats(sid, 0, _count(0, 0), _count(0, 0), _count(0, 0), None, 0)
        total, paused = listing.shards.get(sid, (None, None))
        by_shard.append(ShardStats(g.name, g.samples, g.empty, g.truncated, g.aborted, g.mean_output, g.output_tokens,
                                   g.flagged, repetition=g.repetition, parts=parts_per_shard.get(sid, 0), total_conversations=total,
                                   paused=paused))

    stats = RunStats(
        run_dir=str(run_dir), generated_at=time.time(), elapsed_s=0.0,
        parts=PartsRead(listing.listed_from, len(listing.parts), len(results), n, listing.uncommitted, missing),
        notes=list(listing.notes), thresholds=thresholds, samples=n,
        empty=_count(int(empty.sum()), n),
        truncated=_count(int(np.count_nonzero(finish == FINISH_LENGTH)), n),
        aborted=_count(int(np.count_nonzero(finish == FINISH_ABORT)), n),
        repetition=_count(int(np.count_nonzero(finish == FINISH_REPETITION)), n),
        reasoning={name: _count(int(np.count_nonzero(think == code)), n) for code, name in enumerate(THINK_NAMES)},
        loss_mask=LossMaskStats(distribution(output_len), log2_histogram(output_len),
                                "output_len, checked against loss_mask (see mask_check)"),
        lengths={"output": distribution(output_len), "reasoning": distribution(reasoning), "prompt": distribution(prompt_len)},
        cut=cut, by_source=by_source, by_worker=by_worker, by_shard=by_shard, mask_check=mask,
        integrity_errors=errors[:MAX_ERROR_EXAMPLES], integrity_error_count=len(errors), flags=[],
        not_generated=dict(listing.not_generated))
    if mode == "sample":
        stats.notes.append(f"loss_mask checked on the first {MASK_CHECK_HEAD_ROWS} rows of {mask.parts_checked} of "
                           f"{len(listing.parts)} parts spread over the run ({mask_rows} samples); "
                           "--mask-check full checks every row")
    stats.flags = _flags(stats)
    stats.elapsed_s = time.perf_counter() - started
    return stats


def _read_listing(run_dir: Path, listing: _Listing, mask_check: str, threads: int | None):
    """Read every listed part (threads): (mask mode, parts mask-checked, errors, missing parts, results)."""
    known_rows: int | None = None
    if listing.listed_from != "glob":  # the store records every committed part's rows
        known_rows = 0
        for rel, _, rows in listing.parts:
            if rows is None:
                raise RuntimeError(f"{rel}: listed from {listing.listed_from} without its row count")
            known_rows += rows
    mode = _mask_check_mode(mask_check, known_rows)
    check_idx = _mask_check_parts(len(listing.parts), mode)
    errors: list[IntegrityError] = []
    missing: list[str] = []
    results: list[_PartResult] = []

    def job(i: int):
        rel, shard_id, rows = listing.parts[i]
        try:
            how = "none" if i not in check_idx else "all" if mode == "full" else "head"
            return _read_part(run_dir, rel, shard_id, rows, how)
        except _MissingPart as exc:
            return exc

    workers = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for outcome in pool.map(job, range(len(listing.parts))):
            if isinstance(outcome, _UnreadablePart):
                errors.append(IntegrityError("unreadable_part", outcome.rel, outcome.detail))
            elif isinstance(outcome, _MissingPart):
                missing.append(outcome.rel)
                errors.append(IntegrityError("missing_part", outcome.rel, f"committed in {STATE_DB} but {outcome.detail}"))
            else:
                results.append(outcome)
                errors += outcome.errors
    return mode, check_idx, errors, missing, results


def _flags(s: RunStats) -> list[Flag]:
    flags: list[Flag] = []
    t = s.thresholds
    if s.empty.share > t["empty_share"]:
        flags.append(Flag("empty_share", Severity.ERROR,
                          f"{s.empty.count} of {s.samples} samples ({s.empty.share:.1%}) are empty answers "
                          f"(only the template boilerplate); threshold {t['empty_share']:.1%}",
                          s.empty.share, t["empty_share"]))
    if s.truncated.share > t["truncated_share"]:
        flags.append(Flag("truncated_share", Severity.WARNING,
                          f"{s.truncated.count} of {s.samples} samples ({s.truncated.share:.1%}) hit max_new_tokens "
                          f"(finish_reason=length); threshold {t['truncated_share']:.1%}",
                          s.truncated.share, t["truncated_share"]))
    if s.repetition.share > t["repetition_share"]:
        flags.append(Flag("repetition_share", Severity.WARNING,
                          f"{s.repetition.count} of {s.samples} samples ({s.repetition.share:.1%}) were stopped as "
                          f"runaway repetition (finish_reason=repetition); threshold {t['repetition_share']:.1%}",
                          s.repetition.share, t["repetition_share"]))
    for kind, groups in (("worker", s.by_worker), ("source", s.by_source)):
        if len(groups) < 2 or s.empty.share > t["empty_share"]:
            continue  # the run-wide flag already says it; a group is flagged when it stands out
        for g in groups:
            if "empty" in g.flagged:
                flags.append(Flag(f"{kind}:{g.name}:empty_share", Severity.WARNING,
                                  f"{kind} {g.name}: {g.empty.count} of {g.samples} samples ({g.empty.share:.1%}) "
                                  "are empty answers", g.empty.share, t["empty_share"]))
    if s.integrity_error_count or s.mask_check.mismatches:
        kinds = sorted({e.kind for e in s.integrity_errors})
        flags.append(Flag("integrity", Severity.ERROR,
                          f"{s.integrity_error_count} integrity error(s) ({', '.join(kinds)}); "
                          f"{s.mask_check.mismatches} sample(s) whose loss_mask disagrees with prompt_len/output_len",
                          float(s.integrity_error_count), None))
    return flags


STATS_ALERT_PREFIX = "stats."


def stats_alerts(stats: RunStats, raised: Iterable[str] = ()) -> list[AlertEvent]:
    """The quality flags as telemetry alerts: each flag a condition raised under a stable key (`stats.<flag key>`:
    telemetry's record of raised alerts says it once, engine.store.alert_record), and, for each key of `raised` (the alerts
    raised now) of a flag these stats no longer have, its `cleared` alert."""
    alerts = []
    for f in stats.flags:
        evidence: dict[str, Any] = {"value": f.value, "threshold": f.threshold, "samples": stats.samples, "run_dir": stats.run_dir}
        if f.key == "integrity":
            evidence["errors"] = [asdict(e) for e in stats.integrity_errors[:5]]
        alerts.append(AlertEvent(severity=Severity(f.severity), text=f.text, evidence=json.dumps(evidence),
                                 key=f"{STATS_ALERT_PREFIX}{f.key}", kind=AlertKind.RAISED))
    flagged = {a.key for a in alerts}
    for key in raised:
        if key.startswith(STATS_ALERT_PREFIX) and key not in flagged:
            alerts.append(AlertEvent(severity=Severity.INFO, key=key, kind=AlertKind.CLEARED,
                                     text=f"cleared: {key[len(STATS_ALERT_PREFIX):]}: not flagged by the stats of "
                                          f"{stats.samples} samples",
                                     evidence=json.dumps({"samples": stats.samples, "run_dir": stats.run_dir})))
    return alerts


# --- command line (host side) ----------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.store.stats", description="shard statistics of a run dir (JSON)")
    parser.add_argument("run_dir")
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format; kept for symmetry)")
    parser.add_argument("--train-max-length", type=int, default=DEFAULT_TRAIN_MAX_LENGTH)
    parser.add_argument("--empty-threshold", type=float, default=DEFAULT_EMPTY_THRESHOLD)
    parser.add_argument("--truncated-threshold", type=float, default=DEFAULT_TRUNCATED_THRESHOLD)
    parser.add_argument("--repetition-threshold", type=float, default=DEFAULT_REPETITION_THRESHOLD)
    parser.add_argument("--mask-check", choices=("auto", "full", "sample", "off"), default="auto")
    args = parser.parse_args(argv)
    try:
        stats = compute_stats(Path(args.run_dir), train_max_length=args.train_max_length,
                              empty_threshold=args.empty_threshold, truncated_threshold=args.truncated_threshold,
                              repetition_threshold=args.repetition_threshold, mask_check=args.mask_check)
    except StatsReadError as exc:
        print(json.dumps({"schema": SCHEMA, "error": str(exc), "run_dir": args.run_dir}))
        print(f"regen stats: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(stats.to_dict()))
    return 1 if stats.quality_flagged else 0


if __name__ == "__main__":
    sys.exit(main())
