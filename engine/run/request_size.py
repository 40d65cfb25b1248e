"""What one request is expected to hold in a server's KV pool: its prompt plus its expected output.

The output as SGLang's scheduler first reserves it (its clipped max_new_tokens x its initial new-token ratio), or
the mean answer of this run so far (after MIN_ANSWERS) when that is more; the gauges correct it (batch_feedback).
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_ANSWERS = 16
FIRST_GUESS_CLIP = 4096  # SGLang's CLIP_MAX_NEW_TOKENS
FIRST_GUESS_RATIO = 0.7  # SGLang's initial new-token ratio


@dataclass
class RequestSize:
    prompts: int = 0  # requests sent
    prompt_tokens: int = 0
    answers: int = 0  # answers back
    output_tokens: int = 0
    max_new_tokens: int = 0  # the largest asked

    def sent(self, prompt_len: int, max_new_tokens: int) -> None:
        self.prompts += 1
        self.prompt_tokens += prompt_len
        self.max_new_tokens = max(self.max_new_tokens, max_new_tokens)

    def answered(self, output_len: int) -> None:
        self.answers += 1
        self.output_tokens += output_len

    @property
    def measured(self) -> bool:
        return self.answers >= MIN_ANSWERS

    def expected_output(self, max_new_tokens: int) -> float:
        first = min(max_new_tokens, FIRST_GUESS_CLIP) * FIRST_GUESS_RATIO
        return max(first, self.output_tokens / self.answers) if self.measured else first

    def tokens(self, max_new_tokens: int) -> float:
        """Prompt plus expected output of one request (the prompts sent so far; 0 before the first)."""
        prompt = self.prompt_tokens / self.prompts if self.prompts else 0.0
        return prompt + self.expected_output(max(max_new_tokens, self.max_new_tokens))
