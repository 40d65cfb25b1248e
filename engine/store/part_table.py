"""Rows -> a part's Arrow table (SHARD_SCHEMA), validating every sample's token / loss-mask invariants, and the
per-row figures the store keeps in state.sqlite (empty answer, reasoning state).
"""
from __future__ import annotations

import re
from array import array
from typing import Any

import numpy as np
import pyarrow as pa

from engine.store.shard_schema import SHARD_SCHEMA
from engine.text.answer_shape import THINK_CLOSE, THINK_OPEN, THINK_STATES, is_empty_answer, think_state

_NON_SPACE = re.compile(r"\S")


def build_table(rows: list[dict]) -> pa.Table:
    """Rows -> a SHARD_SCHEMA table, validating the token/mask invariants of every sample.

    The usual row (loss_mask exactly `[0] * prompt_len + [1] * output_len`, checked per row with
    list.count/index at C speed) gets its loss_mask column built from the lengths with numpy
    instead of converting ~10^6 Python ints per part; any other row takes the general path, which
    converts every value and names the first bad sample and position."""
    names = SHARD_SCHEMA.names
    for i, r in enumerate(rows):
        missing = [n for n in names if n not in r]
        if missing:
            raise ValueError(f"sample {r.get('sample_id', f'#{i}')!r}: missing field(s) {', '.join(missing)}")
    masks_from_lengths = _standard_masks(rows)
    arrays: list[Any] = []  # pyarrow arrays (pyarrow is untyped); None: loss_mask, until built from the lengths
    for fld in SHARD_SCHEMA:
        if fld.name == "loss_mask" and masks_from_lengths:
            arrays.append(None)  # built below from the (validated) prompt/output lengths
            continue
        if fld.name == "input_ids" and _INT32_ARRAYS and all(
                type(v) is array and v.typecode == "i" for v in (r["input_ids"] for r in rows)):
            arrays.append(_int32_lists([r["input_ids"] for r in rows]))  # int32 already: one copy
            continue
        values = [r[fld.name] for r in rows]
        if fld.name == "loss_mask":  # the general path: a compacted row's mask written out again
            values = [[0] * r["prompt_len"] + [1] * r["output_len"] if v is STANDARD_MASK else v
                      for r, v in zip(rows, values)]
        try:
            arrays.append(pa.array(values, type=fld.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
            bad = _first_bad(values, fld.type)
            sid = rows[bad].get("sample_id") if bad is not None else None
            raise ValueError(f"sample {sid!r}: field {fld.name} is not {fld.type}: {exc}") from exc
        if arrays[-1].null_count:
            bad = next(i for i, v in enumerate(values) if v is None)
            raise ValueError(f"sample {rows[bad].get('sample_id')!r}: field {fld.name} is null")
    if masks_from_lengths:
        prompt_len = arrays[names.index("prompt_len")].to_numpy()
        output_len = arrays[names.index("output_len")].to_numpy()
        ids = arrays[names.index("input_ids")]
        n_ids = np.diff(ids.offsets.to_numpy())
        n_mask = prompt_len + output_len
        mismatched = np.flatnonzero(n_ids != n_mask)  # the masks are right by construction; the ids' lengths are not
        if mismatched.size:
            i = int(mismatched[0])
            raise ValueError(f"sample {rows[i]['sample_id']!r}: len(input_ids)={n_ids[i]} != len(loss_mask)={n_mask[i]}")
        arrays[names.index("loss_mask")] = _masks_array(prompt_len, output_len)
        return pa.Table.from_arrays(arrays, schema=SHARD_SCHEMA)
    table = pa.Table.from_arrays(arrays, schema=SHARD_SCHEMA)
    _validate_masks(table)
    return table


_INT32_ARRAYS = array("i").itemsize == 4


class _StandardMask:
    """Stands for a loss_mask already checked to be [0] * prompt_len + [1] * output_len (compact_row)."""
    __slots__ = ()

    def __repr__(self) -> str:
        return "STANDARD_MASK"


STANDARD_MASK = _StandardMask()


def compact_row(row: dict) -> dict:
    """The same row, smaller while it waits in memory for its commit (in place): input_ids as an
    int32 array, a standard loss_mask (checked here) as STANDARD_MASK. Neither is a container the
    garbage collector scans: ~8000 fewer references per 4000-token answer each time it walks
    the young generations. A value that does not convert is left as it is, so build_table names
    it in its error exactly as before."""
    ids = row.get("input_ids")
    if _INT32_ARRAYS and type(ids) is list:
        try:
            row["input_ids"] = array("i", ids)
        except (TypeError, OverflowError):
            pass
    if "loss_mask" in row and "prompt_len" in row and "output_len" in row and _standard_mask(row):
        row["loss_mask"] = STANDARD_MASK
    return row


def _int32_lists(values: list[array]) -> pa.ListArray:
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum([len(v) for v in values], out=offsets[1:])
    flat = np.frombuffer(b"".join(values), dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), pa.array(flat, type=pa.int32()))


def _standard_masks(rows: list[dict]) -> bool:
    """True when every row's loss_mask is STANDARD_MASK or a list equal to [0] * prompt_len +
    [1] * output_len (non-negative int lengths)."""
    return all(r["loss_mask"] is STANDARD_MASK or _standard_mask(r) for r in rows)


def _standard_mask(r: dict) -> bool:
    """Exactly p zeros and o ones, the first 1 at position p (list.count / index run at C speed)."""
    mask, p, o = r["loss_mask"], r["prompt_len"], r["output_len"]
    if type(mask) is not list or type(p) is not int or type(o) is not int or p < 0 or o < 0:
        return False
    return len(mask) == p + o and mask.count(0) == p and mask.count(1) == o and (not o or mask.index(1) == p)


def _masks_array(prompt_len: np.ndarray, output_len: np.ndarray) -> pa.ListArray:
    n = len(prompt_len)
    lengths = np.column_stack([prompt_len, output_len]).ravel()
    values = np.repeat(np.tile(np.array([0, 1], dtype=np.uint8), n), lengths)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(prompt_len + output_len, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), pa.array(values, type=pa.uint8()))


def _first_bad(values: list, typ: pa.DataType) -> int | None:
    for i, v in enumerate(values):
        try:
            pa.array([v], type=typ)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError):
            return i
    return None


def _validate_masks(table: pa.Table) -> None:
    ids = table.column("input_ids").combine_chunks()
    mask = table.column("loss_mask").combine_chunks()
    n_ids = np.diff(ids.offsets.to_numpy())
    n_mask = np.diff(mask.offsets.to_numpy())
    prompt_len = table.column("prompt_len").to_numpy()
    output_len = table.column("output_len").to_numpy()
    sample_ids = table.column("sample_id")

    def fail(i: int, what: str):
        raise ValueError(f"sample {sample_ids[int(i)].as_py()!r}: {what}")

    bad = np.flatnonzero(n_ids != n_mask)
    if bad.size:
        i = bad[0]
        fail(i, f"len(input_ids)={n_ids[i]} != len(loss_mask)={n_mask[i]}")
    bad = np.flatnonzero((prompt_len < 0) | (output_len < 0) | (prompt_len + output_len != n_ids))
    if bad.size:
        i = bad[0]
        fail(i, f"prompt_len {prompt_len[i]} + output_len {output_len[i]} != len(input_ids) {n_ids[i]}")
    values = mask.flatten().to_numpy(zero_copy_only=False)
    offsets = mask.offsets.to_numpy()
    cumulative = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
    sums = cumulative[offsets[1:]] - cumulative[offsets[:-1]]
    bad = np.flatnonzero(sums != output_len)
    if bad.size:
        i = bad[0]
        fail(i, f"sum(loss_mask)={int(sums[i])} != output_len={output_len[i]}")
    expected = np.repeat(np.tile(np.array([0, 1], dtype=values.dtype), len(n_mask)),
                         np.column_stack([prompt_len, output_len]).ravel())
    wrong = np.flatnonzero(values != expected)
    if wrong.size:
        row = int(np.searchsorted(offsets, wrong[0], side="right") - 1)
        pos = int(wrong[0] - offsets[row])
        fail(row, f"loss_mask[{pos}]={int(values[wrong[0]])}: must be 0 on the prompt "
                  f"(first {prompt_len[row]} tokens) and 1 on the output")


def is_empty(text: str, prompt_opened: bool) -> bool:
    """is_empty_answer(text, prompt_opened), without copying a long answer: a reasoning block with any
    non-space character is never empty (the common case, decided by two searches)."""
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        opened = text.find(THINK_OPEN, 0, close)
        if _NON_SPACE.search(text, opened + len(THINK_OPEN) if opened >= 0 else 0, close):
            return False
    return is_empty_answer(text, prompt_opened)


def think_code(text: str, prompt_opened: bool) -> int:
    """think_state(text, prompt_opened) as its index in THINK_STATES (the samples table's `think` column)."""
    return THINK_STATES.index(think_state(text, prompt_opened))
