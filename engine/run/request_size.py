"""What one request is expected to hold in a server's KV pool: its prompt plus its expected output.

The output is expected as SGLang's own scheduler first reserves it (`min(max_new_tokens, 4096) x 0.7`, its initial
new-token ratio: what a server just started admits, whatever the answers turn out to be), or as the answers of
this run so far say (their mean, once MIN_ANSWERS came back) when that is more: long thinking answers fill a pool
sooner than SGLang's first guess. Shorter answers let a server run more as its own estimate decays; the gauges
find that (engine.run.batch_feedback), never this estimate alone.
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
