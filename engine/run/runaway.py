"""The runaway detector: follows one answer's output ids as they stream in and says when its tail is degenerate
repetition (the two signals and their defaults: engine.config.load.Runaway).

O(max_period) work and state per chunk, never per token: a byte search finds the candidate periods, which are
checked over their whole span, so it fires at the same chunk end and period as a per-token detector would.
"""
from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass

import numpy as np
import numpy.random  # noqa: F401  imported with the engine, not by the first answer streamed (~0.1 s of its dispatch)

from engine.config.load import Runaway

BLOCK = 1024  # the longest chunk judged at its end: a longer one is judged every BLOCK tokens
TAIL = 16  # the tokens a period must already repeat at the chunk's end to be checked over its span
SAMPLE = 4  # the n-gram share is counted over the hashes in the lowest SAMPLE-th of the hash space
_SAMPLED_BELOW = np.uint64(2**64 // SAMPLE)
_NO_HASHES = np.zeros(0, dtype=np.uint64)  # a detector's first state (shared: only ever replaced, never written)
_NO_FLAGS = np.zeros(0, dtype=bool)
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

    __slots__ = ("cfg", "seen", "_need", "_tail", "_shortest", "_mult", "_next_check", "_ngram_on", "_hashes",
                 "_informative", "_hashed")

    def __init__(self, cfg: Runaway):
        self.cfg = cfg
        self.seen = 0  # output tokens fed so far
        self._need, self._tail, self._shortest, self._mult = _tables(cfg)
        self._ngram_on = cfg.ngram_share < 1.0
        self._next_check = cfg.ngram_window + cfg.ngram - 1 + LOCAL  # the first check: a full window
        self._hashes = _NO_HASHES  # the latest n-grams' hashes (at most ngram_window)
        self._informative = _NO_FLAGS
        self._hashed = 0  # n-grams ending before this token are hashed

    def feed(self, ids: array[int] | list[int], start: int) -> Repetition | None:
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
    def _cycle(self, ids: array[int] | list[int], lo: int, hi: int) -> Repetition | None:
        """Judged at token `hi` (the chunk's end): the smallest period whose tail repeats over its whole need."""
        if hi < self._shortest:
            return None  # no period's need fits yet
        p_max, t = self.cfg.max_period, self._tail
        back = max(0, hi - t - p_max)
        reach = min(p_max, hi - back - t)  # the longest period whose shifts of the tail lie in the window
        raw, w = _raw(ids, back, hi)
        # the periods p whose latest t tokens equal the t before them by p: where those t tokens' bytes occur again
        # in the window, at a whole token (one C search, usually finding nothing in a normal answer's text),
        # the nearest first (the smallest period)
        tail = len(raw) - t * w
        pattern = raw[tail:]
        first, end = tail - reach * w, tail - w + len(pattern)
        while (at := raw.rfind(pattern, first, end)) >= 0:
            end = at + len(pattern) - 1
            if (tail - at) % w:
                continue  # straddles two tokens
            p = (tail - at) // w
            need = self._need[p - 1]
            if hi - p < need:
                continue  # the tail cannot be that long yet
            span, _ = _raw(ids, hi - need - p, hi)
            if span[p * w:] == span[:-p * w]:
                return Repetition("cycle", hi, period=p, span=_periodic_tail(ids, hi, p))
        return None

    # -- the n-gram signal -----------------------------------------------------------------------------------
    def _share(self, ids: array[int] | list[int]) -> Repetition | None:
        """The repeated share of the informative n-grams among the last ngram_window. The n-grams are hashed once
        each, at the first check after they arrived (nothing at all for the many answers shorter than the window),
        and kept for the window. An n-gram is informative when most of its tokens differ from the 4 tokens before
        them: the runs of a zero matrix or a ruler line ("0 & 0 & 0", "-----") repeat without being a loop. The
        share is counted over the informative n-grams whose hash falls in one SAMPLE-th of the hash space: equal
        n-grams are sampled together, so it estimates the share over all of them, at a SAMPLE-th of the sort."""
        cfg = self.cfg
        self._next_check = self.seen + cfg.check_every
        self._hash_upto(ids, self.seen)
        hashes, informative = self._hashes[-cfg.ngram_window:], self._informative[-cfg.ngram_window:]
        if np.count_nonzero(informative) < cfg.ngram_window // 4:
            return None  # mostly runs of a few tokens: judged by the cycle signal alone
        sampled = hashes[informative & (hashes < _SAMPLED_BELOW)]
        if len(sampled) < 2:
            return None
        ordered = np.sort(sampled)  # a sort and a compare: np.unique costs ten times more
        share = float(np.count_nonzero(ordered[1:] == ordered[:-1])) / len(sampled)
        if share >= cfg.ngram_share:
            return Repetition("ngram", self.seen, share=share)
        return None

    def _hash_upto(self, ids: array[int] | list[int], hi: int) -> None:
        """Hash the n-grams ending before token `hi` not hashed yet (the first one ends at ngram - 1 + LOCAL, where
        its tokens have their 4 predecessors); keep the last ngram_window of them."""
        n = self.cfg.ngram
        lo = max(self._hashed, n - 1 + LOCAL)
        if lo >= hi:
            return
        tokens = _ints(ids, lo - n + 1 - LOCAL, hi)
        low = np.zeros(len(tokens), dtype=np.int32)
        for k in range(1, LOCAL + 1):
            low[k:] |= tokens[k:] == tokens[:-k]
        tokens, low = tokens[LOCAL:].astype(np.uint64), low[LOCAL:]
        # each n-gram's sum of token x multiplier (wrapping modulo 2**64), as n whole-array multiply-adds: a matrix
        # product of the n-gram windows, on integers (no BLAS), cost ten times more
        m = len(tokens) - n + 1
        hashes = tokens[:m] * self._mult[0]
        for k in range(1, n):
            hashes += tokens[k:k + m] * self._mult[k]
        lows = np.concatenate([[0], np.cumsum(low)])
        keep = self.cfg.ngram_window
        self._hashes = np.concatenate([self._hashes, hashes])[-keep:]
        self._informative = np.concatenate([self._informative, (lows[n:] - lows[:-n]) * 2 < n])[-keep:]
        self._hashed = hi


@functools.lru_cache(maxsize=8)
def _tables(cfg: Runaway) -> tuple[tuple[int, ...], int, int, np.ndarray]:
    """What every detector of one [runaway] config reads and none changes (built once: one per answer cost more
    than a chunk's judgement): need per period, the tail length, the fewest tokens any period's tail covers, the
    n-gram hash multipliers."""
    periods = np.arange(1, cfg.max_period + 1, dtype=np.int64)
    # need[p - 1]: the latest tokens that must each equal the token p before them (the periodic tail, need + p
    # tokens, covers max(min_span, min_repeats x p))
    need = np.maximum(cfg.min_span, cfg.min_repeats * periods) - periods
    tail = int(min(TAIL, need.min()))
    shortest = int((need + periods).min())
    mult = np.random.default_rng(0x5EED).integers(1, 2**63, size=cfg.ngram, dtype=np.uint64) | np.uint64(1)
    mult.setflags(write=False)
    return tuple(need.tolist()), tail, shortest, mult


def _periodic_tail(ids: array[int] | list[int], hi: int, p: int) -> int:
    """How many of the tokens up to `hi` the period-p tail covers: the trailing tokens equal to the one p before
    them, plus the p they start from (once, when a runaway is found)."""
    a = _ints(ids, 0, hi)
    eq = a[p:] == a[:-p]
    run = len(eq) if eq.all() else int(np.argmin(eq[::-1]))
    return run + p


def _raw(ids: array[int] | list[int], lo: int, hi: int) -> tuple[bytes, int]:
    """ids[lo:hi] as bytes and the bytes per id: equal runs of ids are equal runs of bytes (an array's slice is one
    memcpy; a list is packed as int64)."""
    part = ids[lo:hi]
    if not isinstance(part, array):
        part = array("q", part)
    return part.tobytes(), part.itemsize


def _ints(ids: array[int] | list[int], lo: int, hi: int) -> np.ndarray:
    """ids[lo:hi] as int64 (an array('i') slice is one memcpy; numpy reads its buffer)."""
    part = ids[lo:hi]
    if isinstance(part, array):
        return np.frombuffer(part, dtype=np.int32).astype(np.int64) if part.itemsize == 4 else np.array(part, np.int64)
    return np.asarray(part, dtype=np.int64)
