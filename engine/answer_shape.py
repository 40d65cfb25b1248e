"""The shape of a generated answer: is there a reasoning block, and is the answer only boilerplate.

Shared by the shard store (the `empty` column of `samples`) and the stats, so both apply
the same rule to the decoded output text (`text` column, special tokens kept).

Rules
-----
think_state(text):
  "present"      a closing `</think>` exists (with or without an opening `<think>`: templates
                 such as Qwen3-Thinking-2507 open the block in the prompt, so the output only closes it)
  "unterminated" `<think>` opened and never closed (typically a `length` finish)
  "missing"      neither tag

is_empty_answer(text): True when the supervised part is only boilerplate, i.e. BOTH
  - the reasoning (inside <think>...</think>, or nothing when there is no block) is empty or
    whitespace only, and
  - the visible answer (after the last `</think>`, with `<|...|>` special tokens such as
    `<|im_end|>` removed) has at most 3 visible tokens, where a visible token is a run of word
    characters (`\\w+`) or one other non-space character.
  `<think>\\n\\n</think>\\n\\nOK.<|im_end|>` is empty ("OK" and "." are 2 visible tokens). An
  unterminated block is never empty unless it is whitespace only and nothing follows it.
"""
from __future__ import annotations

import re
from typing import Literal

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
EMPTY_MAX_VISIBLE_TOKENS = 3

_SPECIAL_TOKEN = re.compile(r"<\|[^|<>\s]{1,64}\|>")
_VISIBLE_TOKEN = re.compile(r"\w+|[^\w\s]")

ThinkState = Literal["present", "missing", "unterminated"]


def think_state(text: str) -> ThinkState:
    if THINK_CLOSE in text:
        return "present"
    if THINK_OPEN in text:
        return "unterminated"
    return "missing"


def split_reasoning(text: str) -> tuple[str, str]:
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


def is_empty_answer(text: str) -> bool:
    reasoning, answer = split_reasoning(text)
    if reasoning.strip():
        return False
    return visible_tokens(answer, limit=EMPTY_MAX_VISIBLE_TOKENS) <= EMPTY_MAX_VISIBLE_TOKENS
