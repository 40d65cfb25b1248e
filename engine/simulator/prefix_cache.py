"""SGLang's radix cache, as `meta_info.cached_tokens` sees it: a radix tree of token ids per server, LRU-evicted.

cached_tokens is the longest prefix of prompt[:-1] the tree holds, in whole pages; a prompt is in the tree once
prefilled, and prompt plus output (less the last id) once it leaves; the tree holds at most the KV pool, least
recently used leaves going first (srt/mem_cache/radix_cache.py). Not modelled: nodes locked by running requests.
"""
from __future__ import annotations

import heapq
import itertools
from array import array
from typing import Sequence


REBUILD_MIN = 4096


class _Node:
    __slots__ = ("key", "children", "parent", "last")

    def __init__(self, key: bytes, parent: _Node | None, last: int):
        self.key = key  # the edge's token ids, int32 bytes
        self.children: dict[bytes, _Node] = {}  # by the first page of their key
        self.parent = parent
        self.last = last  # access tick


def _common(a: bytes, b: bytes, unit: int) -> int:
    """Bytes of the longest common prefix of a and b, in whole units (memcmp by bisection)."""
    n = min(len(a), len(b)) // unit
    if a[:n * unit] == b[:n * unit]:
        return n * unit
    lo, hi = 0, n  # a[:lo] equal, a[:hi] not (in units)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid * unit] == b[:mid * unit]:
            lo = mid
        else:
            hi = mid
    return lo * unit


class PrefixCache:
    def __init__(self, capacity_tokens: int, page_size: int = 1):
        self.capacity = max(0, capacity_tokens)
        self.page = max(1, page_size)
        self._unit = 4 * self.page
        self._tick = itertools.count(1)
        self.root = _Node(b"", None, 0)
        self.tokens = 0  # held in the tree
        self._order = itertools.count()  # ties between leaves touched at the same tick: the earlier entry first
        # a heap of the leaves by access tick rather than a walk of the whole tree at each insert: a full tree
        # inserts at every admission and finish, and walking thousands of leaves (~2 ms) stalled the steps
        self._leaves: list[tuple[int, int, _Node]] = []  # (last, order, leaf) per touch; stale entries skipped
        self._rebuild_at = REBUILD_MIN  # entries past which the heap is rebuilt from the live leaves

    def __len__(self) -> int:
        return self.tokens

    def match(self, ids: Sequence[int]) -> int:
        """cached_tokens for a prompt (the tree's access times move; nothing is inserted)."""
        raw = self._aligned(ids, len(ids) - 1)
        tick = next(self._tick)
        node, pos = self.root, 0
        while pos < len(raw):
            child = node.children.get(raw[pos:pos + self._unit])
            if child is None:
                break
            n = _common(child.key, raw[pos:pos + len(child.key)], self._unit)
            self._touch(child, tick)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos // 4

    def insert(self, ids: Sequence[int]) -> None:
        """The ids' KV is in the pool now (whole pages of it): in the tree, then the pool bound is kept."""
        if not self.capacity:
            return
        raw = self._aligned(ids, len(ids))
        tick = next(self._tick)
        node, pos = self.root, 0
        while pos < len(raw):
            head = raw[pos:pos + self._unit]
            child = node.children.get(head)
            if child is None:
                leaf = _Node(raw[pos:], node, tick)
                node.children[head] = leaf
                self._touch(leaf, tick)
                self.tokens += (len(raw) - pos) // 4
                break
            n = _common(child.key, raw[pos:pos + len(child.key)], self._unit)
            self._touch(child, tick)
            if n < len(child.key):  # split the edge where the ids leave it
                mid = _Node(child.key[:n], node, tick)
                node.children[head] = mid
                child.key = child.key[n:]
                child.parent = mid
                mid.children[child.key[:self._unit]] = child
                child = mid
            pos += n
            node = child
        self._evict()

    def match_and_insert(self, ids: Sequence[int]) -> int:
        """A request admitted: its cached_tokens, and its prompt in the tree from this prefill on."""
        cached = self.match(ids)
        self.insert(ids)
        return cached

    def clear(self) -> None:
        self.root = _Node(b"", None, 0)
        self.tokens = 0
        self._leaves = []
        self._rebuild_at = REBUILD_MIN

    def _aligned(self, ids: Sequence[int], n: int) -> bytes:
        n = max(0, n) // self.page * self.page
        return array("i", ids[:n] if len(ids) > n else ids).tobytes()

    def _touch(self, node: _Node, tick: int) -> None:
        node.last = tick
        if not node.children:
            heapq.heappush(self._leaves, (tick, next(self._order), node))
            if len(self._leaves) > self._rebuild_at:
                # mostly stale entries (each touch adds one): rebuilt from the live leaves, amortized over the touches
                self._leaves = [(n.last, next(self._order), n) for n in self._nodes()
                                if not n.children and n is not self.root]
                heapq.heapify(self._leaves)
                self._rebuild_at = max(REBUILD_MIN, 4 * len(self._leaves))

    def _evict(self) -> None:
        """The least recently used leaves go (a parent left childless becomes a leaf) until the bound holds."""
        if self.tokens <= self.capacity:
            return
        heap = self._leaves
        while self.tokens > self.capacity and heap:
            last, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None or leaf.children or leaf.last != last:
                continue  # evicted already, no longer a leaf, or touched since (a newer entry stands for it)
            del parent.children[leaf.key[:self._unit]]
            leaf.parent = None
            self.tokens -= len(leaf.key) // 4
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last, next(self._order), parent))

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
