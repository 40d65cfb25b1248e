"""The restart policy of a crashed server: relaunched after a backoff (1 s, doubling, at most 60 s), failed once more
than workers.max_restarts crashes fall inside RESTART_WINDOW_S."""
from __future__ import annotations

RESTART_WINDOW_S = 600.0


class CrashWindow:
    def __init__(self) -> None:
        self._times: list[float] = []

    def crashed(self, now: float, max_restarts: int) -> float | None:
        """Count a crash at `now` (time.time()): the backoff before the relaunch, or None: failed, no relaunch."""
        self._times = [t for t in self._times if now - t < RESTART_WINDOW_S] + [now]
        if len(self._times) > max_restarts:
            return None
        return min(60.0, 2.0 ** (len(self._times) - 1))

    @property
    def count(self) -> int:
        """Crashes inside the window."""
        return len(self._times)

    def clear(self) -> None:
        """A fresh crash budget (an operator's restart of a failed worker)."""
        self._times.clear()
