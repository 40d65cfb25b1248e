"""Per target, until when its pull loop takes no new work (a failing server, a router with none, work moved off it)."""
from __future__ import annotations


class PullPauses:
    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    def set(self, name: str, until: float) -> None:
        self._until[name] = until

    def extend(self, name: str, until: float) -> None:
        """Paused at least until `until` (a longer pause already set stays)."""
        if until > self._until.get(name, 0.0):
            self._until[name] = until

    def paused(self, name: str, now: float) -> bool:
        return now < self._until.get(name, 0.0)
