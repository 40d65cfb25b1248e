"""The token rows of a shard as exported: the shard's exact ids and loss_mask, cut at max_length, checked.

Before anything is taken, every row's loss_mask is checked to be exactly [0] * prompt_len + [1] *
output_len (engine.store.stats_columns.check_mask over the whole column); the exported ids and mask are then the
shard's own values, gathered (and cut) with numpy, never re-tokenized.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from engine.export.filters import ShardFilter
from engine.export.source import ExportError, ShardBatch
from engine.store.stats_columns import check_mask

TOKEN_COLUMNS = ["sample_id", "conversation_id", "turn", "source", "origin", "input_ids", "loss_mask", "prompt_len",
                 "output_len", "reasoning_tokens", "finish_reason", "text"]


@dataclass
class TokenRows:
    """The kept rows of one shard, flat: row i is ids[offsets[i]:offsets[i + 1]] (and mask the same)."""
    rows: np.ndarray  # indices into the shard table
    offsets: np.ndarray  # int64, len(rows) + 1
    ids: np.ndarray  # int32
    mask: np.ndarray  # uint8
    supervised: np.ndarray  # per kept row
    length: np.ndarray  # per kept row

    def labels(self) -> np.ndarray:
        return np.where(self.mask.astype(bool), self.ids, np.int32(-100)).astype(np.int32)


def token_rows(batch: ShardBatch, filt: ShardFilter) -> TokenRows:
    table = batch.table
    prompt_len = table.column("prompt_len").to_numpy().astype(np.int64)
    output_len = table.column("output_len").to_numpy().astype(np.int64)
    mask_col = _list(table.column("loss_mask"))
    mismatches, errors = check_mask(mask_col, prompt_len, output_len, f"shard {batch.shard_id}")
    if mismatches:
        raise ExportError(f"shard {batch.shard_id}: {mismatches} sample(s) whose loss_mask is not [0]*prompt_len + "
                          f"[1]*output_len, e.g. {errors[0].detail} (sample "
                          f"{table.column('sample_id')[int(errors[0].detail.split()[1].rstrip(':'))].as_py()!r}); "
                          "nothing was exported: run `regen stats` on the run dir to see every integrity error")
    ids_col = _list(table.column("input_ids"))
    ids_flat, ids_off = _flat(ids_col)
    mask_flat, mask_off = _flat(mask_col)
    if not np.array_equal(ids_off, mask_off):
        raise ExportError(f"shard {batch.shard_id}: input_ids and loss_mask lengths differ in some rows; "
                          "run `regen stats` on the run dir to see which")
    rows = np.flatnonzero(filt.keep)
    length = filt.length[rows]
    starts = ids_off[:-1][rows]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(length, out=offsets[1:])
    gather = np.repeat(starts - offsets[:-1], length) + np.arange(offsets[-1], dtype=np.int64)
    ids, mask = ids_flat[gather], mask_flat[gather]
    supervised = filt.supervised[rows]
    # the rows as exported keep the shard's layout: (length - supervised) zeros, then supervised ones
    ones = np.add.reduceat(mask.astype(np.int64), offsets[:-1]) if len(rows) and offsets[-1] else np.zeros(len(rows))
    ones = np.where(length > 0, ones, 0)
    if not np.array_equal(ones, supervised):
        i = int(np.flatnonzero(ones != supervised)[0])
        raise ExportError(f"sample {table.column('sample_id')[int(rows[i])].as_py()!r}: {int(ones[i])} supervised "
                          f"tokens after the cut, expected {int(supervised[i])}; nothing was exported")
    return TokenRows(rows, offsets, ids.astype(np.int32, copy=False), mask.astype(np.uint8, copy=False),
                     supervised, length)


def _list(col) -> pa.ListArray:
    return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _flat(arr: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets rebased to 0) of a list array, zero-copy where Arrow allows."""
    raw = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.slice(int(raw[0]), int(raw[-1] - raw[0])).to_numpy(zero_copy_only=False)
    return values, raw - raw[0]
