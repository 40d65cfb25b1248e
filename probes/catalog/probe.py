"""A probe of the catalog and its judge's verdict.

`needs`: probes that must PASS or WARN first (otherwise this one is SKIP, naming them); `uses`: probes whose
data it reads when available; `real_gpus`: SKIP in a rehearsal (the run config launches the SGLang simulator).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from probes.context import (
    ProbeContext,
)
from probes.model import CommandResult, ProbeResult, Status


@dataclass
class Verdict:
    """A judge's answer; the runner adds id, title, command, exit status, output and duration."""

    status: Status
    summary: str
    expected: str = ""
    actual: str = ""
    remedy: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JudgeInput:
    ctx: ProbeContext
    deps: Mapping[str, ProbeResult]  # results of `needs` and `uses` (those that ran)

    def dep_data(self, probe_id: str) -> dict[str, Any]:
        r = self.deps.get(probe_id)
        return r.data if r is not None and r.status in (Status.PASS, Status.WARN) else {}


@dataclass(frozen=True)
class Probe:
    id: str
    title: str
    command: Callable[[ProbeContext], str]
    judge: Callable[[CommandResult, JudgeInput], Verdict]
    needs: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()
    timeout_s: float = 30.0
    script: str | None = None  # the probes/host script embedded in the command (for a short display)
    # what the partial output of a timed-out command tells (e.g. which import hung); None: nothing more
    on_timeout: Callable[[CommandResult], str | None] | None = None
    config: str = "any"  # "any": always; "config": only with --config; "no_config": only without
    when: Callable[[ProbeContext], bool] | None = None  # only for contexts where this holds
    real_gpus: bool = False  # checks what only real SGLang servers need (GPUs, CUDA, weights): SKIP in a rehearsal


class Findings:
    """Issues found by a judge; the verdict's status is the worst of them."""

    ORDER = {Status.PASS: 0, Status.WARN: 1, Status.FAIL: 2, Status.ERROR: 3}

    def __init__(self) -> None:
        self.items: list[tuple[Status, str, str]] = []  # (status, text, remedy)

    def add(self, status: Status, text: str, remedy: str = "") -> None:
        self.items.append((status, text, remedy))

    def fail(self, text: str, remedy: str = "") -> None:
        self.add(Status.FAIL, text, remedy)

    def warn(self, text: str, remedy: str = "") -> None:
        self.add(Status.WARN, text, remedy)

    @property
    def status(self) -> Status:
        worst = Status.PASS
        for status, _, _ in self.items:
            if self.ORDER[status] > self.ORDER[worst]:
                worst = status
        return worst

    def verdict(self, ok_summary: str, *, expected: str = "", actual: str = "", data: dict | None = None) -> Verdict:
        status = self.status
        if status is Status.PASS:
            return Verdict(status, ok_summary, expected, actual, "", data or {})
        worst = [(t, r) for s, t, r in self.items if s is status]
        rest = [t for s, t, _ in self.items if s is not status]
        summary = "; ".join(t for t, _ in worst)
        remedy = " ".join(dict.fromkeys(r for _, r in worst + [(t, r) for s, t, r in self.items if s is not status] if r))
        if rest:
            actual = (actual + "\n" if actual else "") + "also: " + "; ".join(rest)
        return Verdict(status, summary, expected, actual, remedy, data or {})
