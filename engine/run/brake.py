"""The data-quality brake: the shares of bad answers over the run's last committed samples, and the decision to pause
dispatch run-wide when one is over its level ([brake]). The window holds committed samples only, so a restart rebuilds
it from the store; a brake is recorded in state.sqlite until `regen resume --all` (or a changed [brake]) lifts it.
A new kind of bad answer is one entry in REASONS, its title in engine.api.brake and its level in [brake].
Light on purpose (no store import): the status builder reads it."""
from __future__ import annotations

import collections
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from engine.text.answer_shape import SampleShape
from engine.api.reports import BrakeLevel, BrakePlan
from engine.config.load import Brake, RunConfig
from engine.api.brake import HOST_PLACEHOLDER, BrakeShare, BrakeStatus
from engine.api.wire import FinishReason


@dataclass(frozen=True)
class Reason:
    """One kind of bad answer the brake watches."""
    name: str
    level_key: str  # its level in [brake] (and its alert level in [alerts], where there is one)
    judge: Callable[[SampleShape], bool]
    causes: tuple[str, ...]  # the likely causes, said to the operator when it brakes
    applies: Callable[[RunConfig], bool] = lambda cfg: True


REASONS: tuple[Reason, ...] = (
    Reason("empty", "empty_share", lambda s: s.empty,
           ("chat template: not the model's own (regen renders every prompt with the tokenizer's chat template: "
            "check `tokenizer` and `model`)",
            "enable_thinking: a template that closes the think block at once, or a model that does not think",
            "prompt extraction: the user messages came out empty or wrong (prompt_format, the message fields; "
            "see rejects.jsonl and `regen stats`)",
            "sampling: max_new_tokens or stop settings that end answers at once")),
    Reason("truncated", "truncated_share", lambda s: s.finish_reason == FinishReason.LENGTH,
           ("sampling: max_new_tokens too small for the model's answers (Qwen3 thinking needs 32768), or greedy / "
            "low-temperature decoding that loops",
            "chat template: no end-of-turn token the model stops on",
            "enable_thinking: reasoning longer than max_new_tokens allows")),
    Reason("thinking_missing", "thinking_missing_share",
           # a runaway the guard stopped inside its reasoning is unclosed because regen cut it: repetition says it
           lambda s: s.think == "missing" or (s.think == "unterminated" and s.finish_reason != FinishReason.REPETITION),
           ("enable_thinking: the template ignores it, or the model does not think",
            "chat template: not the model's own, so the reasoning block is not opened or closed as the model expects",
            "sampling: max_new_tokens cuts the reasoning before </think>"),
           applies=lambda cfg: cfg.enable_thinking),
    Reason("repetition", "repetition_share", lambda s: s.finish_reason == FinishReason.REPETITION,
           ("sampling: greedy or low-temperature decoding (temperature 0 loops most; Qwen3 thinking wants 0.6), "
            "or a repetition/presence penalty left at a value the model was not tuned for",
            "chat template: not the model's own, so the model never sees where its turn ends",
            "model: weights or quantization that degrade long generations"),
           applies=lambda cfg: cfg.runaway.enabled),
    Reason("refused", "refused_share", lambda s: s.finish_reason == "refused",
           ("sampling: a value this SGLang version refuses (the server's words are in rejects.jsonl and the alert)",
            "context_length / max_new_tokens: prompts longer than the servers take",
            "the servers: crashing or timing out (workers/<name>/server.log)")),
)
REASON_BY_NAME = {r.name: r for r in REASONS}
# a sample the servers refused or failed: in the window beside the committed answers (live only: a start rebuilds
# the window from committed samples, and the failed ones are generated again)
REFUSED_SHAPE = SampleShape(empty=False, finish_reason="refused", think=None)


def settings_of(b: Brake) -> str:
    """[brake] as canonical JSON: a recorded brake is kept by a start under the same settings only."""
    return json.dumps(b.model_dump(), sort_keys=True)


class BrakeWindow:
    """The last `size` committed samples, each as the set of REASONS it is (a bitmask), and the count of each."""

    def __init__(self, size: int):
        self._flags: collections.deque[int] = collections.deque()
        self._size = size
        self._counts = [0] * len(REASONS)

    def __len__(self) -> int:
        return len(self._flags)

    def add(self, shapes: Iterable[SampleShape]) -> None:
        for shape in shapes:
            bits = 0
            for i, reason in enumerate(REASONS):
                if reason.judge(shape):
                    bits |= 1 << i
                    self._counts[i] += 1
            self._flags.append(bits)
            if len(self._flags) > self._size:
                old = self._flags.popleft()
                for i in range(len(REASONS)):
                    if old >> i & 1:
                        self._counts[i] -= 1

    def clear(self) -> None:
        self._flags.clear()
        self._counts = [0] * len(REASONS)

    def count(self, reason: str) -> int:
        return self._counts[REASONS.index(REASON_BY_NAME[reason])]


class RunBrake:
    """The window and the decision under one run config; engaged state included (the ledger keeps it, the store
    records it)."""

    def __init__(self, cfg: RunConfig, run_dir: str = ""):
        self.settings = cfg.brake
        self.reasons = [r for r in REASONS if r.applies(cfg)]
        self.window = BrakeWindow(cfg.brake.window)
        self.run_dir = run_dir
        self.engaged: BrakeStatus | None = None

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def shares(self) -> list[BrakeShare]:
        n = len(self.window)
        out = []
        for r in self.reasons:
            count = self.window.count(r.name)
            out.append(BrakeShare(r.name, count, n, count / n if n else 0.0, getattr(self.settings, r.level_key)))
        return out

    def crossed(self) -> list[BrakeShare]:
        """The shares over their level (none while disabled or under min_samples)."""
        if not self.enabled or len(self.window) < self.settings.min_samples:
            return []
        return [s for s in self.shares() if s.over]

    # -- moves ------------------------------------------------------------------------------------
    def load(self, record: str | None, shapes: Iterable[SampleShape]) -> str:
        """A start: the window rebuilt from the store's last committed samples, and the recorded brake kept (same
        [brake]) or lifted (another one). Returns a log line for what it found ("" when nothing was recorded)."""
        self.window.add(shapes)
        if record is None:
            return ""
        try:
            recorded = BrakeStatus.from_dict(json.loads(record))
        except (ValueError, TypeError, AttributeError) as exc:
            recorded = BrakeStatus(engaged=True, text=f"(the record could not be read: {exc})",
                                   settings=settings_of(self.settings))
        if recorded.settings == settings_of(self.settings) and self.enabled:
            self.engaged = recorded
            return f"the run stays braked (since {_when(recorded.since)}): {recorded.text}"
        return (f"the brake recorded at {_when(recorded.since)} ({recorded.text}) is lifted: [brake] changed since "
                f"(was {recorded.settings}, now {settings_of(self.settings)}); the same window is judged again")

    def judge(self, now: float | None = None) -> BrakeStatus | None:
        """Brake when a share is over its level (and not braked yet): the new brake, else None."""
        if self.engaged is not None:
            return None
        crossed = self.crossed()
        if not crossed:
            return None
        names = [s.reason for s in crossed]
        causes = list(dict.fromkeys(c for n in names for c in REASON_BY_NAME[n].causes))
        run_dir = self.run_dir or "RUN_DIR"
        self.engaged = BrakeStatus(
            enabled=True, engaged=True, since=time.time() if now is None else now, text=crossed[0].text(),
            crossed=crossed, causes=causes,
            remedy=(f"fix the cause (regen stats {run_dir} shows the answers), then `regen resume {HOST_PLACEHOLDER} --run-dir "
                    f"{run_dir} --all` (the window starts over); or change [brake] in the run config and start again; "
                    "brake.enabled = false turns it off"),
            settings=settings_of(self.settings))
        return self.engaged

    def release(self) -> BrakeStatus | None:
        """`regen resume --all`: the brake released (the one it was, or None) and the window started over."""
        was, self.engaged = self.engaged, None
        if was is not None:
            self.window.clear()
        return was

    def record(self) -> str | None:
        return json.dumps(self.engaged.to_dict(), sort_keys=True) if self.engaged is not None else None

    def status(self) -> BrakeStatus:
        base = self.engaged or BrakeStatus(enabled=self.enabled, settings=settings_of(self.settings))
        return dataclasses.replace(base, enabled=self.enabled, window=self.shares(), samples=len(self.window),
                                   window_size=self.settings.window, min_samples=self.settings.min_samples)


def plan_of(cfg: RunConfig) -> BrakePlan:
    b = cfg.brake
    return BrakePlan(b.enabled, b.window, b.min_samples,
                     [BrakeLevel(r.name, getattr(b, r.level_key), getattr(cfg.alerts, r.level_key, None), r.applies(cfg))
                      for r in REASONS])


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts)) if ts else "an unknown time"
