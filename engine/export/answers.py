"""A generated answer as the chat messages carry it: reasoning and visible content, end-of-turn tokens removed.

The only place the export splits reasoning from the answer; shapes follow the Qwen3-family templates.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.text.answer_shape import THINK_CLOSE, THINK_OPEN, split_reasoning, think_state


@dataclass(frozen=True)
class Answer:
    reasoning: str | None  # None: the answer has no reasoning block
    content: str

    def inline(self) -> str:
        """Reasoning inline in the content (ModelOpt, messages formats)."""
        if self.reasoning is None:
            return self.content
        return f"{THINK_OPEN}\n{self.reasoning}\n{THINK_CLOSE}\n\n{self.content}"


def strip_end(text: str, end_tokens: Sequence[str]) -> str:
    """The decoded output without its trailing end-of-turn token(s) (the ids the engine's history drops)."""
    changed = True
    while changed:
        changed = False
        for tok in end_tokens:
            if tok and text.endswith(tok):
                text = text[: -len(tok)]
                changed = True
    return text


def answer_of(text: str, end_tokens: Sequence[str], prompt_opened: bool = False) -> Answer:
    """`prompt_opened`: the prompt ended inside `<think>` (Qwen3.5-style templates), so the text only closes it."""
    text = strip_end(text, end_tokens)
    if think_state(text, prompt_opened) == "missing":
        return Answer(None, text)
    reasoning, content = split_reasoning(text, prompt_opened)
    return Answer(reasoning.strip("\n"), content.lstrip("\n"))
