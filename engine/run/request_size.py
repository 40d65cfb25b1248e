"""What one request is expected to hold in a server's KV pool: its prompt plus its expected output.

The output is expected from the answers of this run so far (their mean, once MIN_ANSWERS came back), else as
SGLang's own scheduler first guesses it (`min(max_new_tokens, 4096) x 0.7`, its initial new-token ratio):
before any answer regen knows no better than the server, and no worse.
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
        if self.measured:
            return self.output_tokens / self.answers
        return min(max_new_tokens, FIRST_GUESS_CLIP) * FIRST_GUESS_RATIO

    def tokens(self, max_new_tokens: int) -> float:
        """Prompt plus expected output of one request (the prompts sent so far; 0 before the first)."""
        prompt = self.prompt_tokens / self.prompts if self.prompts else 0.0
        return prompt + self.expected_output(max(max_new_tokens, self.max_new_tokens))
