"""Which samples of a shard an export keeps: one vectorized pass, each dropped sample counted under its first reason.

Empty answers and the reasoning block use engine.store.stats_columns' kernels, the same rules `regen stats`
reports (engine.text.answer_shape translated to RE2), so an export's counts match what the operator saw.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.export.options import (ABORTED, EMPTY, LENGTH, MIN_SUPERVISED, NOT_LAST_TURN, OVER_MAX_LENGTH, REASONS,
                                   REPETITION, THINKING_MISSING, THINKING_UNTERMINATED, TRAINER_MIN_SUPERVISED, ExportOptions)
from engine.store.stats_columns import OPENED_COLUMN, THINK_MISSING, THINK_UNTERMINATED, empty_answer_mask, think_codes

FILTER_COLUMNS = ["conversation_id", "turn", "prompt_len", "output_len", "finish_reason", "text", OPENED_COLUMN]


@dataclass
class ShardFilter:
    keep: np.ndarray  # bool per row
    length: np.ndarray  # tokens per row as exported (after a cut)
    supervised: np.ndarray  # supervised tokens per row as exported
    dropped: dict[str, int]

    def slice(self, start: int, stop: int) -> ShardFilter:
        return ShardFilter(self.keep[start:stop], self.length[start:stop], self.supervised[start:stop], {})


@dataclass
class FilterTotals:
    samples: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: {r: 0 for r in REASONS})
    rows_cut: int = 0  # kept rows cut at max_length
    supervised_lost: int = 0  # supervised tokens those cuts removed
    trainer_would_drop: int = 0  # kept rows with < 2 supervised tokens (min_supervised below 2)
    prompt_tokens: int = 0  # of the kept rows, as exported
    supervised_tokens: int = 0

    def add(self, f: ShardFilter, prompt_len: np.ndarray, output_len: np.ndarray, cut: bool) -> None:
        k = f.keep
        self.samples += len(k)
        self.kept += int(k.sum())
        for reason, n in f.dropped.items():
            self.dropped[reason] += n
        if cut:
            self.rows_cut += int(np.count_nonzero(k & (prompt_len + output_len > f.length)))
            self.supervised_lost += int((output_len[k] - f.supervised[k]).sum())
        self.trainer_would_drop += int(np.count_nonzero(k & (f.supervised < TRAINER_MIN_SUPERVISED)))
        self.prompt_tokens += int((f.length[k] - f.supervised[k]).sum())
        self.supervised_tokens += int(f.supervised[k].sum())


def filter_shard(table: pa.Table, opts: ExportOptions, thinking_expected: bool) -> ShardFilter:
    n = table.num_rows
    prompt_len = table.column("prompt_len").to_numpy().astype(np.int64)
    output_len = table.column("output_len").to_numpy().astype(np.int64)
    length = prompt_len + output_len
    if opts.cuts and opts.max_length is not None:  # cuts implies a max_length
        length = np.minimum(length, opts.max_length)
    supervised = np.clip(length - prompt_len, 0, output_len)
    drop_default = set(opts.dropped_by_default(thinking_expected))
    reason = np.full(n, -1, dtype=np.int8)

    def mark(name: str, hit: np.ndarray) -> None:
        reason[(reason < 0) & hit] = REASONS.index(name)

    finish = table.column("finish_reason")
    if ABORTED in drop_default:
        mark(ABORTED, _bool(pc.equal(finish, "abort")))
    if LENGTH in drop_default:
        mark(LENGTH, _bool(pc.equal(finish, "length")))
    if REPETITION in drop_default:
        mark(REPETITION, _bool(pc.equal(finish, REPETITION)))
    text = table.column("text")
    opened = _bool(table.column(OPENED_COLUMN))
    if EMPTY in drop_default:
        mark(EMPTY, empty_answer_mask(text, opened).to_numpy(zero_copy_only=False))
    if THINKING_MISSING in drop_default or THINKING_UNTERMINATED in drop_default:
        codes = think_codes(text, opened)
        if THINKING_MISSING in drop_default:
            mark(THINKING_MISSING, codes == THINK_MISSING)
        if THINKING_UNTERMINATED in drop_default:
            mark(THINKING_UNTERMINATED, codes == THINK_UNTERMINATED)
    if opts.last_turn_only:
        mark(NOT_LAST_TURN, ~_last_turn(table))
    if opts.max_length is not None and not opts.cuts:
        mark(OVER_MAX_LENGTH, prompt_len + output_len > opts.max_length)
    if opts.min_supervised:
        mark(MIN_SUPERVISED, supervised < opts.min_supervised)
    dropped = {name: int(np.count_nonzero(reason == i)) for i, name in enumerate(REASONS)}
    return ShardFilter(reason < 0, length, supervised, dropped)


def _last_turn(table: pa.Table) -> np.ndarray:
    """True on each conversation's last committed turn (rows sorted by conversation, then turn)."""
    conv = table.column("conversation_id").to_pylist()
    last = np.ones(len(conv), dtype=bool)
    for i in range(len(conv) - 1):
        if conv[i] == conv[i + 1]:
            last[i] = False
    return last


def _bool(arr) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    return arr.fill_null(False).to_numpy(zero_copy_only=False)
