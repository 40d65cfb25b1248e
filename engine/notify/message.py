"""Which telemetry events become a notification, and what it says.

A notification carries its cause in words an operator reads on a phone: what happened, the
evidence (log lines, the path), and where (run dir, host)."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from engine.config.load import SEVERITIES, NotifyConfig
from engine.placement.slurm.alerts import NOTIFIED as SLURM_JOB_KEYS
from engine.api.brake import BRAKE_ALERT_KEY
from engine.api.events import AlertEvent, Event, FatalEvent, RunEndEvent
from engine.api.wire import RunState, Severity

# alerts the notifier raises about itself: shown in telemetry, never sent (a dead webhook must not loop)
OWN_KEYS = ("notify.failed", "notify.suppressed")
# alerts sent whatever notify.min_severity says, like a failed end: the run paused itself and waits for an operator
# (the data-quality brake, engine.run.brake; its release, an info alert, is not sent)
ALWAYS_SENT_KEYS = (BRAKE_ALERT_KEY,)
# alert keys starting so are sent whatever their severity: a [slurm] job that ended, was requeued, or will not start
# (and its start after that), in Slurm's words (engine.placement.slurm.alerts)
ALWAYS_SENT_PREFIXES = SLURM_JOB_KEYS
TITLE_MAX = 200


@dataclass(frozen=True)
class Notification:
    kind: str  # alert | fatal | run_end | suppressed
    severity: str  # info | warning | error | critical
    title: str
    text: str
    evidence: str = ""
    ts: float = field(default_factory=time.time)
    key: str = ""  # the alert key (de-duplication), "fatal", "run_end" or "notify.suppressed"
    run_dir: str = ""
    host: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def severity_rank(severity: str) -> int:
    return SEVERITIES.index(severity) if severity in SEVERITIES else len(SEVERITIES) - 1


def _title(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first if len(first) <= TITLE_MAX else first[: TITLE_MAX - 1] + "…"


def notification_for(event: Event, cfg: NotifyConfig, *, run_dir: str, host: str) -> Notification | None:
    """The notification an event asks for under `cfg`, or None for an event that is not sent."""
    if isinstance(event, AlertEvent):
        forced = (event.key in ALWAYS_SENT_KEYS and severity_rank(event.severity) >= severity_rank(Severity.ERROR)) or \
            event.key.startswith(ALWAYS_SENT_PREFIXES)
        if event.key in OWN_KEYS or (severity_rank(event.severity) < severity_rank(cfg.min_severity) and not forced):
            return None
        return Notification(kind="alert", severity=event.severity, key=event.key,
                            title=_title(f"regen {event.severity}: {event.text}"), text=event.text,
                            evidence=event.evidence, run_dir=run_dir, host=host, ts=event.ts)
    if isinstance(event, FatalEvent):
        text = f"{event.exc_type}: {event.message}" if event.exc_type else event.message
        if event.remedy:
            text += f"\nremedy: {event.remedy}"
        evidence = "\n".join(line for line in (f"phase: {event.phase}" if event.phase else "",
                                               f"path: {event.path}" if event.path else "") if line)
        return Notification(kind="fatal", severity=Severity.CRITICAL, key="fatal",
                            title=_title(f"regen: supervisor died: {event.exc_type or 'error'}: {event.message}"),
                            text=text, evidence=evidence, run_dir=run_dir, host=host, ts=event.ts)
    if isinstance(event, RunEndEvent):
        if event.state != RunState.FAILED and not cfg.run_end:
            return None
        counts = f"{event.done}/{event.total} samples"
        if event.state == RunState.DONE:
            text = f"run finished: {counts} done (exit code {event.exit_code})"
        elif event.state == RunState.FAILED:
            text = f"run failed at {counts} (exit code {event.exit_code}): {event.cause or 'no cause recorded'}"
        else:
            text = (f"run {event.state} at {counts} (exit code {event.exit_code}); `regen start` with the same"
                    " config resumes it")
        severity = (Severity.INFO if event.state == RunState.DONE else
                    Severity.CRITICAL if event.state == RunState.FAILED else Severity.WARNING)
        return Notification(kind="run_end", severity=severity, key="run_end",
                            title=_title(f"regen: run {event.state} ({counts})"), text=text, run_dir=run_dir,
                            host=host, ts=event.ts)
    return None
