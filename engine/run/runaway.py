"""The runaway detector: follows one answer's output ids as they stream in and says when its tail is degenerate
repetition (the two signals and their defaults: engine.config.Runaway).

Incremental, and numpy per chunk rather than Python per token: for every period p <= max_period it keeps
`run[p]`, how many of the latest tokens equal the token p before them; the tail is one cycle of period p
repeated when run[p] + p covers max(min_span, min_repeats x p) tokens. A chunk of c new tokens updates every
run at once from a c x max_period comparison of the chunk against the tokens before it. The n-gram signal
hashes the last ngram_window n-grams (64-bit) every check_every tokens and counts the
share of the informative ones that occurred earlier in the window. The detector reads the caller's id array
(it never copies the whole answer) and keeps O(max_period) state.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.config import Runaway

BLOCK = 1024  # tokens compared at once: bounds the comparison matrix (BLOCK x max_period booleans)
_PAD = -1  # before the first token: equal to no token id
LOCAL = 4  # a token equal to one of the 4 before it is part of a short run, not of a sentence


@dataclass(frozen=True, slots=True)
class Repetition:
    """Why an answer was judged a runaway, at `at` output tokens."""
    signal: str  # "cycle" | "ngram"
    at: int  # output tokens seen when it fired
    period: int = 0  # cycle: the cycle's length in tokens
    span: int = 0  # cycle: the tokens the repeated cycle covers (ending at `at`)
    share: float = 0.0  # ngram: the repeated n-gram share of the window

    def describe(self) -> str:
        if self.signal == "cycle":
            return (f"a {self.period}-token cycle repeated {self.span / self.period:.1f} times over the last "
                    f"{self.span} of {self.at} tokens")
        return f"{self.share:.0%} of the last window's n-grams repeated, at {self.at} tokens"


class RunawayDetector:
    """One per streamed answer: `feed(ids, start)` after each chunk (ids[start:] new), a Repetition once."""

    __slots__ = ("cfg", "seen", "_run", "_need", "_mult", "_next_check", "_ngram_on")

    def __init__(self, cfg: Runaway):
        self.cfg = cfg
        self.seen = 0  # output tokens fed so far
        periods = np.arange(1, cfg.max_period + 1, dtype=np.int64)
        self._run = np.zeros(cfg.max_period, dtype=np.int64)
        # run[p] needed: the periodic tail (run + p tokens) covers max(min_span, min_repeats x p)
        self._need = np.maximum(cfg.min_span, cfg.min_repeats * periods) - periods
        self._ngram_on = cfg.ngram_share < 1.0
        rng = np.random.default_rng(0x5EED)
        self._mult = rng.integers(1, 2**63, size=cfg.ngram, dtype=np.uint64) | np.uint64(1)
        self._next_check = cfg.ngram_window + cfg.ngram - 1 + LOCAL  # the first check: a full window

    def feed(self, ids: array | list, start: int) -> Repetition | None:
        """ids: every output id so far; ids[start:] arrived since the last call (start == tokens fed before)."""
        if start != self.seen:
            raise ValueError(f"runaway detector fed from token {start}, but it has seen {self.seen}")
        end = len(ids)
        while self.seen < end:
            stop = min(end, self.seen + BLOCK)
            found = self._cycle(ids, self.seen, stop)
            self.seen = stop
            if found is not None:
                return found
            if self._ngram_on and self.seen >= self._next_check:
                found = self._share(ids)
                if found is not None:
                    return found
        return None

    # -- the cycle signal ------------------------------------------------------------------------------------
    def _cycle(self, ids, lo: int, hi: int) -> Repetition | None:
        p_max = self.cfg.max_period
        back = max(0, lo - p_max)
        buf = _ints(ids, back, hi)
        if lo - back < p_max:  # fewer than max_period tokens before the chunk: pad
            buf = np.concatenate([np.full(p_max - (lo - back), _PAD, dtype=np.int64), buf])
        win = sliding_window_view(buf, p_max + 1)  # row j: the p_max tokens before new token j, then it
        eq = win[:, p_max - 1::-1] == win[:, p_max:]  # eq[j, p - 1]: new token j equals the token p before it
        c = hi - lo
        trailing = np.argmin(eq[::-1], axis=0)  # trues at the chunk's end (0 when every one is true: fixed below)
        self._run = np.where(eq.all(axis=0), self._run + c, trailing)
        hit = np.flatnonzero(self._run >= self._need)
        if not hit.size:
            return None
        p = int(hit[0]) + 1
        return Repetition("cycle", hi, period=p, span=int(self._run[p - 1]) + p)

    # -- the n-gram signal -----------------------------------------------------------------------------------
    def _share(self, ids) -> Repetition | None:
        """The repeated share of the informative n-grams among the last ngram_window (hashed from the caller's ids
        at each check: no state kept between checks, and nothing at all for the many answers shorter than the
        window). An n-gram is informative when most of its tokens differ from the 4 tokens before them: the runs
        of a zero matrix or a ruler line ("0 & 0 & 0", "-----") repeat without being a loop."""
        cfg = self.cfg
        self._next_check = self.seen + cfg.check_every
        n, w = cfg.ngram, cfg.ngram_window
        tokens = _ints(ids, self.seen - w - n + 1 - LOCAL, self.seen)
        low = np.zeros(len(tokens), dtype=np.int32)
        for k in range(1, LOCAL + 1):
            low[k:] |= tokens[k:] == tokens[:-k]
        tokens, low = tokens[LOCAL:], low[LOCAL:]
        grams = sliding_window_view(tokens.astype(np.uint64), n)
        lows = np.concatenate([[0], np.cumsum(low)])
        informative = (lows[n:] - lows[:-n]) * 2 < n
        hashes = grams[informative] @ self._mult  # wraps modulo 2**64
        if len(hashes) < w // 4:
            return None  # mostly runs of a few tokens: judged by the cycle signal alone
        ordered = np.sort(hashes)  # a sort and a compare: np.unique costs ten times more
        share = float(np.count_nonzero(ordered[1:] == ordered[:-1])) / len(hashes)
        if share >= cfg.ngram_share:
            return Repetition("ngram", self.seen, share=share)
        return None


def _ints(ids, lo: int, hi: int) -> np.ndarray:
    """ids[lo:hi] as int64 (an array('i') slice is one memcpy; numpy reads its buffer)."""
    part = ids[lo:hi]
    if isinstance(part, array):
        return np.frombuffer(part, dtype=np.int32).astype(np.int64) if part.itemsize == 4 else np.array(part, np.int64)
    return np.asarray(part, dtype=np.int64)
