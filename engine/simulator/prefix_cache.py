"""A cheap stand-in for SGLang's radix cache: block hashes of prompt prefixes, LRU-evicted.

cached_tokens = the longest prefix (in whole blocks) already seen in an earlier prompt, never
the last prompt token (SGLang always computes at least one token of the prompt).
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Sequence

BLOCK = 32


class PrefixCache:
    def __init__(self, capacity_tokens: int):
        self.capacity_blocks = max(1, capacity_tokens // BLOCK)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks) * BLOCK

    def match_and_insert(self, ids: Sequence[int]) -> int:
        raw = array("i", ids).tobytes()
        step = 4 * BLOCK
        n_blocks = (len(ids) - 1) // BLOCK
        h = 0
        cached = 0
        hit = True
        blocks = self._blocks
        for b in range(n_blocks):
            h = hash((h, raw[b * step:(b + 1) * step]))
            if hit and h in blocks:
                cached += BLOCK
                blocks.move_to_end(h)
            else:
                hit = False
                blocks[h] = None
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
        return cached

    def clear(self) -> None:
        self._blocks.clear()
