"""The shape of a generated answer: is there a reasoning block, and is the answer only boilerplate.

One rule for the shard store (the `empty` column) and the stats, on the decoded output text; `prompt_opened` (the
rendered prompt ended inside an opened `<think>`, stored per sample) is never re-guessed from the output.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
EMPTY_MAX_VISIBLE_TOKENS = 3

_SPECIAL_TOKEN = re.compile(r"<\|[^|<>\s]{1,64}\|>")
_VISIBLE_TOKEN = re.compile(r"\w+|[^\w\s]")

ThinkState = Literal["present", "missing", "unterminated"]


THINK_STATES: tuple[ThinkState, ...] = ("present", "missing", "unterminated")  # the store's `think` column codes


@dataclass(frozen=True, slots=True)
class SampleShape:
    """What the store records of one committed answer's shape (the samples table's empty, finish_reason and think
    columns), judged by the data-quality brake (engine.run.brake). think is None for a sample committed before the
    store kept it."""
    empty: bool
    finish_reason: str
    think: ThinkState | None

    @property
    def reasoning_unclosed(self) -> bool:
        """The reasoning block was opened and never closed, and not because regen's runaway guard cut the answer
        (the store counts the same in SQL: engine.store.state_db.UNCLOSED_SQL)."""
        return self.think == "unterminated" and self.finish_reason != "repetition"


def prompt_opens_think(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an opened, unclosed think block (`...<think>\\n`)."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def think_state(text: str, prompt_opened: bool = False) -> ThinkState:
    """"present": a closing `</think>` exists; "unterminated": a block is open and never closed (`<think>` in the
    output, or the prompt opened it); "missing": neither tag, and the prompt did not open a block."""
    # rfind, not `in`: a long answer's </think> is near its end (4x faster on 20 KB answers; the store runs it per row)
    if text.rfind(THINK_CLOSE) >= 0:
        return "present"
    if prompt_opened or THINK_OPEN in text:
        return "unterminated"
    return "missing"


def split_reasoning(text: str, prompt_opened: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a decoded output; special tokens are left in the answer."""
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        head = text[:close]
        opened = head.find(THINK_OPEN)
        reasoning = head[opened + len(THINK_OPEN):] if opened >= 0 else head
        return reasoning, text[close + len(THINK_CLOSE):]
    opened = text.find(THINK_OPEN)
    if opened >= 0:
        return text[opened + len(THINK_OPEN):], ""
    if prompt_opened:
        return text, ""  # cut inside the block the prompt opened: all of it is reasoning
    return "", text


def visible_tokens(answer: str, limit: int | None = None) -> int:
    """Visible tokens of an answer (special tokens removed); stops counting past `limit`."""
    cleaned = _SPECIAL_TOKEN.sub(" ", answer)
    count = 0
    for _ in _VISIBLE_TOKEN.finditer(cleaned):
        count += 1
        if limit is not None and count > limit:
            break
    return count


def is_empty_answer(text: str, prompt_opened: bool = False) -> bool:
    """True when the reasoning is empty or whitespace AND the visible answer (after the last `</think>`, special
    tokens removed) has at most 3 visible tokens (a run of word characters, or one other non-space character):
    `<think>\n\n</think>\n\nOK.<|im_end|>` is empty."""
    reasoning, answer = split_reasoning(text, prompt_opened)
    if reasoning.strip():
        return False
    return visible_tokens(answer, limit=EMPTY_MAX_VISIBLE_TOKENS) <= EMPTY_MAX_VISIBLE_TOKENS
