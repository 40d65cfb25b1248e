"""SGLang's prompt-length rule: which prompts a server refuses, and how long their answer may run.

max_req_len = min(context_len - 1, max_total_num_tokens - 1); a prompt of max_req_len - 5 tokens or more is refused
(HTTP 400) and max_new_tokens is capped at max_req_len - len(prompt) - 1 (0.5.5 tp_worker.py:294-298, contract 7.4):
the feed applies it first, so such a turn is a reject with its reason, not a request that comes back as a 400.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.servers.capacity import ServerCapacity

INPUT_MARGIN = 5  # max_req_input_len = max_req_len - 5


@dataclass(frozen=True)
class PromptLimit:
    max_req_len: int  # min(context_len - 1, max_total_num_tokens - 1): prompt plus answer
    source: str  # the figure that bounds it and where it was read, for the reject reason

    @property
    def max_input_len(self) -> int:
        """A prompt of this many tokens or more is refused."""
        return self.max_req_len - INPUT_MARGIN

    def fits(self, prompt_len: int) -> bool:
        return prompt_len < self.max_input_len

    def room(self, prompt_len: int) -> int:
        """The most new tokens SGLang lets this prompt generate (its max_new_tokens cap)."""
        return self.max_req_len - prompt_len - 1

    def reason(self, prompt_len: int) -> str:
        return (f"prompt of {prompt_len} tokens is over SGLang's input limit: prompts of {self.max_input_len} tokens"
                f" or more are refused (min(context_len - 1, max_total_num_tokens - 1) - {INPUT_MARGIN}; the bound"
                f" here: {self.source})")


def from_context(context_length: int, where: str) -> PromptLimit:
    """The limit a context length alone sets (before any server has said its KV pool size)."""
    return PromptLimit(context_length - 1, f"context_length {context_length} ({where})")


def tightest(current: PromptLimit, servers: Iterable[tuple[str, ServerCapacity]]) -> PromptLimit:
    """The smallest limit over `current` and what each named server reported (ties keep `current`)."""
    limits = [current]
    for name, cap in servers:
        if cap.context_length:
            limits.append(PromptLimit(cap.context_length - 1, f"context_length {cap.context_length} of {name}"))
        if cap.max_total_num_tokens:
            limits.append(PromptLimit(cap.max_total_num_tokens - 1,
                                      f"max_total_num_tokens {cap.max_total_num_tokens} of {name}"))
        if cap.max_req_input_len:
            limits.append(PromptLimit(cap.max_req_input_len + INPUT_MARGIN,
                                      f"max_req_input_len {cap.max_req_input_len} reported by {name}"))
    return min(limits, key=lambda limit: limit.max_req_len)
