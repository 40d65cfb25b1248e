"""Rate limit and de-duplication of notifications: at most `max_per_minute`, one per alert key per `dedupe_s`.

What is held is counted and sent later as one "N more alerts suppressed" summary, never dropped; a fatal error
and the run's end always go out.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

from engine.notify.message import Notification, severity_rank

WINDOW_S = 60.0
ALWAYS_SENT = ("fatal", "run_end", "suppressed")
SUMMARY_LINES = 15


@dataclass(frozen=True)
class Held:
    notification: Notification
    due: float  # when a summary carrying it may go out


class Limiter:
    def __init__(self, max_per_minute: int, dedupe_s: float):
        self.max_per_minute = max_per_minute
        self.dedupe_s = dedupe_s
        self._sent: collections.deque[float] = collections.deque()
        self._last_by_key: dict[str, float] = {}
        self.held: list[Held] = []

    def _expire(self, now: float) -> None:
        while self._sent and now - self._sent[0] >= WINDOW_S:
            self._sent.popleft()

    def _slot_at(self, now: float) -> float:
        self._expire(now)
        return now if len(self._sent) < self.max_per_minute else self._sent[0] + WINDOW_S

    def admit(self, n: Notification, now: float) -> bool:
        """True: send it now (and count it). False: held for the next summary."""
        if n.kind not in ALWAYS_SENT:
            last = self._last_by_key.get(n.key) if n.key else None
            if last is not None and now - last < self.dedupe_s:
                self.held.append(Held(n, max(last + self.dedupe_s, self._slot_at(now))))
                return False
            slot = self._slot_at(now)
            if slot > now:
                self.held.append(Held(n, slot))
                return False
        self._sent.append(now)
        if n.key:
            self._last_by_key[n.key] = now
        return True

    def summary_due_in(self, now: float) -> float | None:
        """Seconds until take_summary() has something to send; None when nothing is held."""
        if not self.held:
            return None
        return max(0.0, max(min(h.due for h in self.held), self._slot_at(now)) - now)

    def take_summary(self, now: float, *, force: bool = False) -> Notification | None:
        """One notification for everything held, when due (or forced at exit)."""
        due_in = self.summary_due_in(now)
        if due_in is None or (due_in > 0 and not force):
            return None
        held, self.held = [h.notification for h in self.held], []
        self._sent.append(now)
        return summarize(held, self.max_per_minute, self.dedupe_s)


def summarize(held: list[Notification], max_per_minute: int, dedupe_s: float) -> Notification:
    by_key: dict[str, list[Notification]] = {}
    for n in held:
        by_key.setdefault(n.key or n.title, []).append(n)
    lines = [f"{len(ns)}x {ns[-1].text or ns[-1].title}" if len(ns) > 1 else (ns[0].text or ns[0].title)
             for ns in by_key.values()]
    if len(lines) > SUMMARY_LINES:
        lines = lines[:SUMMARY_LINES] + [f"... and {len(lines) - SUMMARY_LINES} more kinds"]
    worst = max(held, key=lambda n: severity_rank(n.severity))
    noun = "alert" if len(held) == 1 else "alerts"
    last = held[-1]
    return Notification(
        kind="suppressed", severity=worst.severity, key="notify.suppressed",
        title=f"regen: {len(held)} more {noun} suppressed", text="\n".join(lines),
        evidence=(f"held by notify.max_per_minute = {max_per_minute} and notify.dedupe_s = {dedupe_s:g};"
                  " every alert is in telemetry.jsonl of the run dir"),
        run_dir=last.run_dir, host=last.host)
