"""The data-quality brake: the shares of bad answers over the run's last committed samples, and the decision to pause
dispatch run-wide when one is over its level ([brake]: engine.config.load.Brake).

Its inputs are committed state only: the row shapes of each part the ledger settles (`Committed`, PartInfo.shapes)
and, at a start, the store's last committed samples (ShardStore.recent_shapes: rowid order is commit order). So the
window is rebuilt, not started empty, by a restart: a run killed and restarted every few hundred samples is judged
on the same samples as one that was not, and a brake the last supervisor took but could not record is taken again.
A brake is recorded in state.sqlite (ShardStore.set_brake) and stays until `regen resume --all` releases it; the
window then starts over (the store keeps the rowid it starts after), so the same samples do not brake the run again.
A start under a changed [brake] (levels, window, the off switch: operational, not in the content hash) lifts a
recorded brake and judges the same window again under the new settings.

A new kind of bad answer is one entry in REASONS (its judge of a SampleShape, the [brake] / [alerts] key of its
level, its likely causes) and its level in engine.config.load.Brake.

Light on purpose: the console reads BrakeStatus (engine.observe.status), so nothing here imports the store.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import shlex
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

from engine.text.answer_shape import SampleShape
from engine.api.reports import BrakeLevel, BrakePlan
from engine.config.load import Brake, RunConfig


BRAKE_ALERT_KEY = "brake"  # the alert key of a brake and of its release (engine.notify always sends a brake)


@dataclass(frozen=True)
class Reason:
    """One kind of bad answer the brake watches."""
    name: str
    level_key: str  # its level in [brake] (and its alert level in [alerts], where there is one)
    title: str
    judge: Callable[[SampleShape], bool]
    causes: tuple[str, ...]  # the likely causes, said to the operator when it brakes
    applies: Callable[[RunConfig], bool] = lambda cfg: True


REASONS: tuple[Reason, ...] = (
    Reason("empty", "empty_share", "empty answers", lambda s: s.empty,
           ("chat template: not the model's own (regen renders every prompt with the tokenizer's chat template: "
            "check `tokenizer` and `model`)",
            "enable_thinking: a template that closes the think block at once, or a model that does not think",
            "prompt extraction: the user messages came out empty or wrong (prompt_format, the message fields; "
            "see rejects.jsonl and `regen stats`)",
            "sampling: max_new_tokens or stop settings that end answers at once")),
    Reason("truncated", "truncated_share", "truncated answers (finish_reason length)",
           lambda s: s.finish_reason == "length",
           ("sampling: max_new_tokens too small for the model's answers (Qwen3 thinking needs 32768), or greedy / "
            "low-temperature decoding that loops",
            "chat template: no end-of-turn token the model stops on",
            "enable_thinking: reasoning longer than max_new_tokens allows")),
    Reason("thinking_missing", "thinking_missing_share", "reasoning missing or unclosed",
           # a runaway the guard stopped inside its reasoning is unclosed because regen cut it: repetition says it
           lambda s: s.think == "missing" or (s.think == "unterminated" and s.finish_reason != "repetition"),
           ("enable_thinking: the template ignores it, or the model does not think",
            "chat template: not the model's own, so the reasoning block is not opened or closed as the model expects",
            "sampling: max_new_tokens cuts the reasoning before </think>"),
           applies=lambda cfg: cfg.enable_thinking),
    Reason("repetition", "repetition_share", "runaway answers stopped (finish_reason repetition)",
           lambda s: s.finish_reason == "repetition",
           ("sampling: greedy or low-temperature decoding (temperature 0 loops most; Qwen3 thinking wants 0.6), "
            "or a repetition/presence penalty left at a value the model was not tuned for",
            "chat template: not the model's own, so the model never sees where its turn ends",
            "model: weights or quantization that degrade long generations"),
           applies=lambda cfg: cfg.runaway.enabled),
    Reason("refused", "refused_share", "samples refused or failed by the servers",
           lambda s: s.finish_reason == "refused",
           ("sampling: a value this SGLang version refuses (the server's words are in rejects.jsonl and the alert)",
            "context_length / max_new_tokens: prompts longer than the servers take",
            "the servers: crashing or timing out (workers/<name>/server.log)")),
)
REASON_BY_NAME = {r.name: r for r in REASONS}
# a sample the servers refused or failed: in the window beside the committed answers (live only: a start rebuilds
# the window from committed samples, and the failed ones are generated again)
REFUSED_SHAPE = SampleShape(empty=False, finish_reason="refused", think=None)


@dataclass
class BrakeShare:
    """One kind of bad answer over the window: how many, the share, and the level it brakes at."""
    reason: str
    count: int
    samples: int
    share: float
    level: float

    @property
    def over(self) -> bool:
        return self.share > self.level

    def text(self) -> str:
        title = REASON_BY_NAME[self.reason].title if self.reason in REASON_BY_NAME else self.reason
        return (f"{title}: {self.share:.1%} ({self.count} of the last {self.samples} committed samples; "
                f"brake level {self.level:.0%})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


HOST_PLACEHOLDER = "HOST"  # the remedy's host: the engine does not know the name the operator's console uses


@dataclass
class BrakeStatus:
    """The brake in a status reply (RunStatus.brake) and its record in state.sqlite (engaged only).

    enabled      [brake] enabled
    engaged      dispatch is paused run-wide by the brake until `regen resume --all`
    since        when it braked (unix time), null when not engaged
    text         the cause in one line (the first share over its level)
    crossed      each share over its level when it braked
    causes       the likely causes of those
    remedy       what the operator does
    window       the shares over the window now (live; offline: rebuilt from the store the same way)
    samples      committed samples in the window now; window_size, min_samples: [brake]'s
    settings     the [brake] section it braked under (a start under another one lifts it)"""
    enabled: bool = True
    engaged: bool = False
    since: float | None = None
    text: str = ""
    crossed: list[BrakeShare] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)
    remedy: str = ""
    window: list[BrakeShare] = field(default_factory=list)
    samples: int = 0
    window_size: int = 0
    min_samples: int = 0
    settings: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def remedy_for(self, host: str) -> str:
        """The remedy with the console's host name (an ssh alias, user@host, `local`) in place of HOST."""
        if not host:
            return self.remedy
        return self.remedy.replace(f"regen resume {HOST_PLACEHOLDER} ", f"regen resume {shlex.quote(host)} ")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BrakeStatus:
        """A reply or a record read back; fields this version does not know are dropped."""
        names = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in data.items() if k in names and k not in ("crossed", "window")}

        def shares(key: str) -> list[BrakeShare]:
            return [_share(x) for x in data.get(key) or [] if isinstance(x, dict)]

        return cls(**given, crossed=shares("crossed"), window=shares("window"))

    def evidence(self) -> str:
        """The alert's evidence: the numbers, the likely causes, the remedy."""
        lines = [s.text() for s in self.crossed]
        lines += ["likely causes:"] + [f"  - {c}" for c in self.causes]
        lines.append(self.remedy)
        return "\n".join(lines)


def _share(data: dict[str, Any]) -> BrakeShare:
    return BrakeShare(reason=str(data.get("reason", "")), count=int(data.get("count", 0)),
                      samples=int(data.get("samples", 0)), share=float(data.get("share", 0.0)),
                      level=float(data.get("level", 0.0)))


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
