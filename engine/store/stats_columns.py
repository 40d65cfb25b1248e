"""The column kernels of the stats and the export: empty answers, the reasoning block and the loss-mask check, each
over a whole pyarrow column. The empty-answer rule is engine.text.answer_shape.is_empty_answer in RE2 (pyarrow's
regex engine); tests/test_stats.py checks both agree on a battery of texts.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine.api.reports import IntegrityError
from engine.text.answer_shape import EMPTY_MAX_VISIBLE_TOKENS, THINK_CLOSE, THINK_OPEN

OPENED_COLUMN = "prompt_opened"  # whether the prompt opened the think block (parts written before it lack it: False)

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
    candidates = np.flatnonzero(np_bool(blank))
    if candidates.size:
        idx = pa.array(candidates)
        sub, sub_close, sub_open = text.take(idx), has_close.take(idx), has_open.take(idx)
        # answer: after the last </think>; "" for an unterminated block; the whole text without tags
        answer_closed = pc.replace_substring_regex(sub, r"(?s)^.*" + _CLOSE, "")
        answer = pc.if_else(sub_close, answer_closed, pc.if_else(sub_open, pa.scalar("", pa.string()), sub))
        cleaned = pc.replace_substring_regex(answer, _SPECIAL_TOKEN_RE2, " ")
        result[candidates] = np_bool(pc.match_substring_regex(cleaned, _AT_MOST_N_VISIBLE))
    return pa.array(result)


THINK_PRESENT, THINK_MISSING, THINK_UNTERMINATED = 0, 1, 2
THINK_NAMES = ("present", "missing", "unterminated")
FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_OTHER, FINISH_REPETITION = 0, 1, 2, 3, 4


def think_codes(text: pa.Array | pa.ChunkedArray, prompt_opened: np.ndarray | None = None) -> np.ndarray:
    """think_state(text, prompt_opened) for a whole column: 0 present, 1 missing, 2 unterminated."""
    has_close = np_bool(pc.match_substring(text, THINK_CLOSE))
    has_open = np_bool(pc.match_substring(text, THINK_OPEN))
    if prompt_opened is not None:
        has_open = has_open | prompt_opened
    return np.where(has_close, THINK_PRESENT, np.where(has_open, THINK_UNTERMINATED, THINK_MISSING)).astype(np.int8)


def np_bool(arr) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    return arr.fill_null(False).to_numpy(zero_copy_only=False)


def np_int(arr) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    return arr.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)



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

