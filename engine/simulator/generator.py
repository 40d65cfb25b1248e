"""Deterministic Qwen3-style outputs built from the real tokenizer's ids.

A request's key (sim seed plus its rid, else a hash of its prompt ids) fixes its output: length (lognormal, capped by
max_new_tokens), empty or aborted, and content, sliced from a token stream encoded once at startup (no tokenizer call
per plan). The output continues the prompt as a real model would, in one of three modes (`Mode`).
"""
from __future__ import annotations

import hashlib
import itertools
import math
import random
from array import array
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Sequence, cast

from engine.text.tiny_model import corpus

REASONING_SHARE = 0.8
NO_THINK_SUFFIX = "<think>\n\n</think>\n\n"
OPENED_SUFFIX = "<think>\n"  # a generation prompt that opens the think block
EMPTY_ANSWER = "<think>\n\n</think>\n\nOK."
EMPTY_ANSWER_OPENED = "\n</think>\n\nOK."
# What the prompt's tail says the output is:
#   "think"  (Qwen3: the prompt ends with the assistant header)
#            `<think>\n{reasoning}\n</think>\n\n{answer}<|im_end|>`, the reasoning ~80% of the tokens;
#            the empty answer is `<think>\n\n</think>\n\nOK.<|im_end|>`.
#   "opened" (Qwen3.5/3.6, Thinking-2507, DeepSeek-R1 templates: the prompt ends with `<think>\n`) the block is
#            already open: `{reasoning}\n</think>\n\n{answer}<|im_end|>`; empty: `\n</think>\n\nOK.<|im_end|>`.
#   "plain"  (the prompt ends with `<think>\n\n</think>\n\n`: thinking disabled) `{answer}<|im_end|>`;
#            empty: `OK.<|im_end|>`.
Mode = Literal["think", "opened", "plain"]
MODES: tuple[Mode, ...] = ("think", "opened", "plain")
STREAM_TOKENS = 1 << 16


class Tokenizer(Protocol):
    """What the simulator uses of a Hugging Face tokenizer (duck-typed: any HF tokenizer class, or a test's)."""
    @property
    def all_special_ids(self) -> list[int]: ...

    @property
    def unk_token_id(self) -> int | None: ...

    def __call__(self, text: list[str], *, add_special_tokens: bool = ...) -> Any: ...  # a BatchEncoding

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = ...) -> list[str]: ...

    def convert_tokens_to_ids(self, token: str) -> int | None: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...

    def apply_chat_template(self, conversation: list[dict], **kwargs: Any) -> Any: ...


_TOKENIZERS: dict[str, Tokenizer] = {}


def load_tokenizer(path: str) -> Tokenizer:
    """The real tokenizer of the model folder, loaded once per process (several servers may share it)."""
    tok = _TOKENIZERS.get(path)
    if tok is None:
        from transformers import AutoTokenizer

        # transformers annotates convert_tokens_to_ids / convert_ids_to_tokens as unions over one-or-many (no
        # overloads); Tokenizer names the one form of each that the simulator calls
        tok = cast(Tokenizer, AutoTokenizer.from_pretrained(path))
        _TOKENIZERS[path] = tok
    return tok


def request_key(seed: int, rid: str | None, input_ids: Sequence[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(str(seed).encode())
    if rid is not None:
        h.update(b"rid:" + rid.encode())
    else:
        h.update(b"ids:" + array("i", input_ids).tobytes())
    return h.digest()


def attempt_draw(key: bytes, attempt: int, what: bytes) -> float:
    """A uniform [0, 1) draw for (request key, attempt): retries of the same rid draw anew."""
    d = hashlib.blake2b(key + what + attempt.to_bytes(4, "little"), digest_size=8).digest()
    return int.from_bytes(d, "little") / 2**64


@dataclass(frozen=True)
class OutputPlan:
    output_ids: list[int]  # exactly what the request will return (already cut at max_new_tokens / abort)
    finish_reason: dict
    reasoning_tokens: int  # tokens inside <think>...</think> (to the end if unclosed)
    text: str | None = None  # prebuilt text (instant path) for the requested skip_special_tokens
    prompt_opened: bool = False  # the prompt opened the think block: reasoning counts from the first output token
    # what the answer is, for tests and benchmarks that recompute a plan: "answer" | "empty" | "loop" (falls into a
    # token cycle repeated to max_new_tokens, --sim-loop-share) | "repetitive" (a long, legitimately repetitive
    # answer, --sim-repetitive-share)
    kind: str = "answer"
    loop_onset: int = 0  # "loop": the output tokens before the cycle starts
    loop_period: int = 0  # "loop": the cycle's length


@dataclass(frozen=True)
class _Prebuilt:
    ids: list[int]
    text_plain: str  # skip_special_tokens=True
    text_special: str  # skip_special_tokens=False
    offsets: list[int] | None  # char end offset of each token in text_special; None: decode on truncation
    reasoning_tokens: int


class OutputGenerator:
    def __init__(self, tokenizer: Tokenizer, *, seed: int, mean: float, sigma: float, empty_share: float,
                 abort_rate: float, loop_share: float = 0.0, repetitive_share: float = 0.0):
        self.tok = tokenizer
        self.seed = seed
        self.mean = mean
        self.sigma = sigma
        self.mu = math.log(mean) - sigma * sigma / 2  # so that E[length] == mean
        self.empty_share = empty_share
        self.abort_rate = abort_rate
        self.loop_share = loop_share
        self.repetitive_share = repetitive_share

        enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if im_end is None or im_end == tokenizer.unk_token_id:
            raise ValueError("tokenizer has no <|im_end|> token; the simulator needs a Qwen-style chat tokenizer")
        self.im_end: int = im_end
        self.think_head = enc("<think>\n")
        self.think_mid = enc("\n</think>\n\n")
        self.no_think_suffix = enc(NO_THINK_SUFFIX)
        self.opened_suffix = enc(OPENED_SUFFIX)
        self.empty = {"think": enc(EMPTY_ANSWER) + [self.im_end], "opened": enc(EMPTY_ANSWER_OPENED) + [self.im_end],
                      "plain": enc("OK.") + [self.im_end]}
        self.think_close = tokenizer.convert_tokens_to_ids("</think>")
        self._build_stream(enc)
        self._documents = self._build_documents() if repetitive_share > 0 else []
        self._instant: dict[str, list[_Prebuilt]] = {}
        self._instant_empty: dict[str, _Prebuilt] = {}

    # --- content stream -------------------------------------------------------------------------
    def _build_stream(self, enc) -> None:
        sentences = [s for s in corpus(800, seed=self.seed + 1) if s[:1].isalpha()]
        starters = self.tok(sentences, add_special_tokens=False)["input_ids"]
        conts = self.tok([" " + s for s in sentences], add_special_tokens=False)["input_ids"]
        para = enc("\n\n")
        rng = random.Random(self.seed)
        stream: list[int] = []
        starts: list[int] = []
        while len(stream) < STREAM_TOKENS:
            if stream:
                stream.extend(para)
            starts.append(len(stream))
            stream.extend(starters[rng.randrange(len(starters))])
            for _ in range(rng.randint(2, 8)):
                stream.extend(conts[rng.randrange(len(conts))])
        self._stream = stream
        self._starts = starts

    def _content(self, rng: random.Random, n: int) -> list[int]:
        """n tokens of prose starting at a paragraph start."""
        if n <= 0:
            return []
        pos = self._starts[rng.randrange(len(self._starts))]
        out = self._stream[pos:pos + n]
        while len(out) < n:
            out.extend(self._stream[: n - len(out)])
        return out

    def _build_documents(self) -> list[list[int]]:
        """Long answers with repeated structure that are no loop (--sim-repetitive-share), encoded once: a numbered
        list, a markdown table, code with a method per field, a multiplication table. Every line changes tokens
        (a number, a name, a cell), as a real list or table does."""
        rng = random.Random(self.seed + 2)
        sentences = [s for s in corpus(600, seed=self.seed + 3) if s[:1].isalpha()]
        words = sorted({w.strip(".,").lower() for s in sentences for w in s.split() if w.strip(".,").isalpha()})
        docs = [
            "Here is the full list:\n\n" + "".join(f"{i}. **Item {i}**: {rng.choice(sentences)}\n" for i in range(1, 1500)),
            "| name | score | passed | date |\n|---|---|---|---|\n" + "".join(
                f"| {rng.choice(words)} | {rng.randint(0, 100)}.{rng.randint(0, 9)} | {rng.choice(['yes', 'no'])} |"
                f" 2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} |\n" for _ in range(1500)),
            "```python\nclass Record:\n" + "".join(
                f"    @property\n    def {w}_{i}(self) -> int:\n        return self._data[\"{w}_{i}\"]\n\n"
                for i, w in enumerate(rng.choice(words) for _ in range(1200))) + "```\n",
            "".join(f"{a} x {b} = {a * b}\n" for a in range(1, 400) for b in range(1, 13)),
        ]
        return [self.tok.encode(d, add_special_tokens=False) for d in docs]

    # --- planning ---------------------------------------------------------------------------------
    def mode(self, prompt_ids: Sequence[int]) -> Mode:
        """How the output continues this prompt (the module docstring's three modes)."""
        if _ends_with(prompt_ids, self.no_think_suffix):
            return "plain"
        return "opened" if _ends_with(prompt_ids, self.opened_suffix) else "think"

    def draw_length(self, rng: random.Random) -> int:
        if self.sigma == 0:
            return max(1, round(math.exp(self.mu)))
        return max(1, round(rng.lognormvariate(self.mu, self.sigma)))

    def _full(self, rng: random.Random, length: int, mode: Mode, limit: int) -> tuple[list[int], int]:
        """The first `limit` tokens of a complete answer of `length` tokens, and its reasoning token count."""
        if mode == "plain":
            length = max(length, 2)
            ids = self._content(rng, min(length - 1, limit)) + [self.im_end]
            return ids[:limit], 0
        head = self.think_head if mode == "think" else []
        overhead = len(head) + len(self.think_mid) + 1
        length = max(length, overhead + 2)
        content = length - overhead
        n_reason = max(1, round(content * REASONING_SHARE))
        n_answer = max(1, content - n_reason)
        ids = list(head)
        ids += self._content(rng, min(n_reason, max(0, limit - len(ids))))
        if len(ids) < limit:
            ids += self.think_mid
            ids += self._content(rng, min(n_answer, max(0, limit - len(ids))))
            ids.append(self.im_end)
        ids = ids[:limit]
        return ids, self._reasoning_count(ids, mode == "opened")

    def _reasoning_count(self, ids: Sequence[int], prompt_opened: bool = False) -> int:
        """Tokens inside the think block (to the end, eos excluded, when unclosed), as engine.text.render counts:
        after the output's <think>, or from the first token when the prompt opened the block."""
        if prompt_opened:
            start = 0
        elif ids and ids[0] == self.think_head[0]:
            start = 1
        else:
            return 0
        try:
            return ids.index(self.think_close, start) - start
        except ValueError:
            return len(ids) - start - (bool(ids) and ids[-1] == self.im_end)

    reasoning_count = _reasoning_count  # public name for the HTTP layer

    def plan(self, key: bytes, prompt_ids: Sequence[int], max_new_tokens: int, *,
             min_new_tokens: int = 0, ignore_eos: bool = False) -> OutputPlan:
        rng = random.Random(key)
        u_empty, u_abort = rng.random(), rng.random()
        mode = self.mode(prompt_ids)
        opened = mode == "opened"
        if self.loop_share or self.repetitive_share:
            # drawn apart from the other choices, so a run without loops plans every answer as before
            u_kind = attempt_draw(key, 0, b"kind")
            if u_kind < self.loop_share and not u_empty < self.empty_share:
                return self._plan_loop(key, mode, max_new_tokens)
            if u_kind >= 1.0 - self.repetitive_share and not u_empty < self.empty_share:
                return self._plan_repetitive(key, mode, max_new_tokens)
        kind = "answer"
        if u_empty < self.empty_share and not ignore_eos:
            ids = list(self.empty[mode])
            reasoning = self._reasoning_count(ids, opened)
            kind = "empty"
        else:
            length = max(self.draw_length(rng), min_new_tokens)
            if ignore_eos:
                length = max_new_tokens + 1
            ids, reasoning = self._full(rng, length, mode, max_new_tokens + 1)
        if len(ids) > max_new_tokens:
            ids = ids[:max_new_tokens]
            reasoning = self._reasoning_count(ids, opened)
            finish = {"type": "length", "length": max_new_tokens}
        else:
            finish = {"type": "stop", "matched": self.im_end}
        if u_abort < self.abort_rate:
            ids = ids[: max(1, len(ids) // 2)]
            reasoning = self._reasoning_count(ids, opened)
            finish = abort_finish()
        return OutputPlan(ids, finish, reasoning, prompt_opened=opened, kind=kind)

    def _plan_loop(self, key: bytes, mode: Mode, max_new_tokens: int) -> OutputPlan:
        """A thinking model stuck in a loop: the answer starts as usual, then one token cycle (a sentence or a
        paragraph of the prose, or a single token) repeats until max_new_tokens (finish_reason length)."""
        rng = random.Random(key + b"loop")
        onset = max(8, round(self.draw_length(rng) / 2))  # where the answer would have been half-way through
        period = max(1, round(math.exp(rng.uniform(0.0, math.log(400)))))  # log-uniform in 1..400
        head, _ = self._full(rng, 1 << 30, mode, onset)
        cycle = self._content(rng, period)
        ids = head[:max_new_tokens]
        while len(ids) < max_new_tokens:
            ids.extend(cycle[: max_new_tokens - len(ids)])
        opened = mode == "opened"
        return OutputPlan(ids, {"type": "length", "length": max_new_tokens}, self._reasoning_count(ids, opened),
                          prompt_opened=opened, kind="loop", loop_onset=min(onset, max_new_tokens), loop_period=period)

    def _plan_repetitive(self, key: bytes, mode: Mode, max_new_tokens: int) -> OutputPlan:
        """A long answer with repeated structure (a list, a table, code, a multiplication table), about four times
        the mean length: a short reasoning, then a slice of one prebuilt document, then <|im_end|>."""
        rng = random.Random(key + b"repetitive")
        doc = self._documents[rng.randrange(len(self._documents))]
        length = max(64, round(rng.lognormvariate(math.log(4 * self.mean), 0.3)))
        start = rng.randrange(len(doc) // 4)
        body = doc[start:start + length]
        head = [] if mode == "plain" else (self.think_head if mode == "think" else []) + self._content(rng, 40) + \
            self.think_mid
        ids = head + body + [self.im_end]
        opened = mode == "opened"
        if len(ids) > max_new_tokens:
            ids = ids[:max_new_tokens]
            finish = {"type": "length", "length": max_new_tokens}
        else:
            finish = {"type": "stop", "matched": self.im_end}
        return OutputPlan(ids, finish, self._reasoning_count(ids, opened), prompt_opened=opened, kind="repetitive")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    # --- instant path -------------------------------------------------------------------------------
    def build_instant_pool(self, size: int) -> None:
        """Prebuild `size` outputs per mode with their texts, so a request costs no tokenizer call."""
        raw: dict[str, list[list[int]]] = {}
        for mode in MODES:
            raw[mode] = []
            # the seed string keeps the names of the two modes that came first, so their pools stay as they were
            name = {"think": "True", "plain": "False"}.get(mode, mode)
            for i in range(size):
                rng = random.Random(hashlib.blake2b(f"{self.seed}:pool:{name}:{i}".encode()).digest())
                raw[mode].append(self._full(rng, self.draw_length(rng), mode, 1 << 30)[0])
        every = [ids for group in raw.values() for ids in group] + list(self.empty.values())
        pieces = self._pieces(sorted({t for ids in every for t in ids}))
        # Joining per-token pieces equals decoding when no character spans two tokens; checked on a sample,
        # and each entry's length is checked below, else that entry is decoded whole.
        sample_ok = all("".join(pieces[t] for t in ids) == self.tok.decode(ids, skip_special_tokens=False)
                        for ids in every[:: max(1, len(every) // 16)])
        for mode in MODES:
            opened = mode == "opened"
            self._instant[mode] = [self._prebuilt(ids, pieces, sample_ok, opened) for ids in raw[mode]]
            self._instant_empty[mode] = self._prebuilt(list(self.empty[mode]), pieces, sample_ok, opened)

    def _prebuilt(self, ids: list[int], pieces: dict[int, str], joinable: bool, opened: bool) -> _Prebuilt:
        ends = list(itertools.accumulate(len(pieces[t]) for t in ids))
        offsets: list[int] | None = ends
        if joinable:
            special = "".join(pieces[t] for t in ids)
            plain = special[: ends[-2]] if ids[-1] == self.im_end and len(ids) > 1 else special
            if ids[-1] == self.im_end and len(ids) == 1:
                plain = ""
        else:
            special = self.tok.decode(ids, skip_special_tokens=False)
            plain = self.tok.decode(ids, skip_special_tokens=True)
            offsets = None
        return _Prebuilt(ids, plain, special, offsets, self._reasoning_count(ids, opened))

    def _pieces(self, ids: list[int]) -> dict[int, str]:
        return dict(zip(ids, self.tok.batch_decode([[t] for t in ids], skip_special_tokens=False)))

    def plan_instant(self, key: bytes, prompt_ids: Sequence[int], max_new_tokens: int,
                     skip_special_tokens: bool) -> OutputPlan:
        pick = int.from_bytes(key[:8], "little")
        u_empty = int.from_bytes(key[8:16], "little") / 2**64
        mode = self.mode(prompt_ids)
        opened = mode == "opened"
        pool = self._instant[mode]
        entry = self._instant_empty[mode] if u_empty < self.empty_share else pool[pick % len(pool)]
        if len(entry.ids) <= max_new_tokens:
            text = entry.text_plain if skip_special_tokens else entry.text_special
            return OutputPlan(entry.ids, {"type": "stop", "matched": self.im_end}, entry.reasoning_tokens, text,
                              opened)
        ids = entry.ids[:max_new_tokens]
        if max_new_tokens == 0:
            text = ""
        elif entry.offsets is not None:
            text = entry.text_special[: entry.offsets[max_new_tokens - 1]]  # the cut never keeps <|im_end|>
        else:
            text = self.decode(ids, skip_special_tokens)
        return OutputPlan(ids, {"type": "length", "length": max_new_tokens}, self._reasoning_count(ids, opened), text,
                          opened)


def _ends_with(ids: Sequence[int], tail: list[int]) -> bool:
    k = len(tail)
    return 0 < k <= len(ids) and list(ids[-k:]) == tail


def abort_finish(message: str = "Aborted") -> dict:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}
