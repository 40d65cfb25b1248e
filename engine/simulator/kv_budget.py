"""SGLang's KV admission arithmetic: the new-token ratio, what a request reserves, what a retraction resets.

Every formula cites the SGLang file:line it models (0.5.5.post3 / 0.5.10 / 0.5.23); values are SGLang's defaults.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# SGLang's environment variable -> the SchedulingDefaults field it sets (0.5.23 srt/environ.py:646-650; 0.5.10
# :223-227; 0.5.5 :165-168, its clip read straight from os.environ in managers/schedule_policy.py:41-42)
ENV_FIELDS = {
    "SGLANG_INIT_NEW_TOKEN_RATIO": "init_new_token_ratio",
    "SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR": "min_new_token_ratio_factor",
    "SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS": "new_token_ratio_decay_steps",
    "SGLANG_RETRACT_DECODE_STEPS": "retract_decode_steps",
    "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "clip_max_new_tokens",
}


@dataclass(frozen=True)
class SchedulingDefaults:
    """The scheduler's tunables, each an SGLANG_* environment variable with this default."""
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    retract_decode_steps: int = 20
    clip_max_new_tokens: int = 4096

    def with_env(self, environ: Mapping[str, str]) -> SchedulingDefaults:
        """These defaults, each overridden by its SGLANG_* variable when set (as SGLang reads them)."""
        changes: dict[str, Any] = {}
        for name, attr in ENV_FIELDS.items():
            if environ.get(name):
                kind = type(getattr(self, attr))
                changes[attr] = kind(environ[name])
        return dataclasses.replace(self, **changes)


@dataclass
class TokenRatio:
    """The share of a running request's remaining max_new_tokens admission still counts on
    (0.5.23 managers/scheduler_components/new_token_ratio_tracker.py:13-49; 0.5.5 managers/scheduler.py:481-493)."""
    init: float
    min: float
    decay: float
    current: float

    @classmethod
    def from_defaults(cls, defaults: SchedulingDefaults, conservativeness: float = 1.0) -> TokenRatio:
        """init = min(INIT x --schedule-conservativeness, 1); min = min(init x FACTOR, 1) (tracker.py:20-32)."""
        init = min(defaults.init_new_token_ratio * conservativeness, 1.0)
        floor = min(init * defaults.min_new_token_ratio_factor, 1.0)
        return cls(init=init, min=floor, decay=(init - floor) / defaults.new_token_ratio_decay_steps, current=init)

    def decay_step(self) -> None:
        """After a decode step that retracted nothing (0.5.23 scheduler.py:4541-4542; 0.5.5 :1966-1970)."""
        self.current = max(self.current - self.decay, self.min)

    def reset(self) -> None:
        """When the server goes idle (0.5.23 scheduler.py:5318; 0.5.5 scheduler_runtime_checker_mixin.py:251)."""
        self.current = self.init

    @staticmethod
    def after_retract(decoded: int, max_new_unclipped: int, kept: int, retract_decode_steps: int) -> float:
        """min(1, (sum output + STEPS x kept) / (sum max_new_tokens + 1)) over the requests kept
        (0.5.23 new_token_ratio_tracker.py:40-49; 0.5.10 schedule_batch.py:2009-2016; 0.5.5 :1562-1570)."""
        return min(1.0, (decoded + retract_decode_steps * kept) / (max_new_unclipped + 1))


@dataclass(frozen=True)
class AdmissionRules:
    """What admitting a request costs the KV budget. `page_in_check` / `page_in_reserve`: whether a page of
    allocator overhead is added to the fit check / the reservation (profiles.py says per version)."""
    clip: int = 4096
    page_size: int = 1
    page_in_check: bool = True
    page_in_reserve: bool = True

    def running_reserve(self, max_new: int, generated: int, ratio: float) -> float:
        """A running request's expected rest: min(max_new - generated, CLIP) x ratio, subtracting before clipping
        (0.5.23 schedule_policy.py:785-795; 0.5.5 :367-374)."""
        return min(max_new - generated, self.clip) * ratio

    def need(self, extend: int, max_new: int, generated: int) -> int:
        """A new request fits iff this is < the remaining budget: extend + min(max(max_new - generated, 0), CLIP),
        plus a page from 0.5.23 (0.5.23 schedule_policy.py:1404-1412, mem_cache/prefill_budget.py:128;
        0.5.5 schedule_policy.py:570-580)."""
        page = self.page_size if self.page_in_check else 0
        return extend + min(max(max_new - generated, 0), self.clip) + page

    def reservation(self, extend: int, max_new: int) -> int:
        """What an admitted request takes off the budget: its clipped max_new_tokens in full, undiscounted,
        plus a page from 0.5.10 (0.5.23 schedule_policy.py:1344-1348, :1636, prefill_budget.py:156-167;
        0.5.10 schedule_policy.py:518-527; 0.5.5 :434-440, :548)."""
        page = self.page_size if self.page_in_reserve else 0
        return math.ceil(extend / self.page_size) * self.page_size + page + min(max_new, self.clip)
