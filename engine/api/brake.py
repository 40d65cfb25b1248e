"""The data-quality brake as a status carries it (RunStatus.brake) and the store records it: BrakeStatus, its shares,
the reasons' titles. Types only: engine.run.brake judges and builds them."""
from __future__ import annotations

import dataclasses
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

BRAKE_ALERT_KEY = "brake"  # the alert key of a brake and of its release (engine.notify always sends a brake)
HOST_PLACEHOLDER = "HOST"  # the remedy's host: the engine does not know the name the operator's console uses
# each kind of bad answer the brake watches (engine.run.brake.REASONS), in the operator's words
REASON_TITLES: dict[str, str] = {
    "empty": "empty answers",
    "truncated": "truncated answers (finish_reason length)",
    "thinking_missing": "reasoning missing or unclosed",
    "repetition": "runaway answers stopped (finish_reason repetition)",
    "refused": "samples refused or failed by the servers",
}


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
        return (f"{REASON_TITLES.get(self.reason, self.reason)}: {self.share:.1%} ({self.count} of the last {self.samples} committed samples; "
                f"brake level {self.level:.0%})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
