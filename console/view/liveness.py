"""One rule for how live a shown figure is, judged here for every panel of the TUI and for `regen status`.

Each figure comes from a source (the supervisor, one worker's server, a host's agent, a Slurm job) and is live, stale
(nothing new from a source that should speak: shown with its age), ended (its source finished in order) or gone (its
source died or was lost): a figure is only ever shown as current while its source is live.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from engine.api.wire import ENDED_RUN_STATES, LIVE_WORKER_STATES, HostState, RunState, duration_text

# the supervisor reads every worker and GPU at each 2 s tick: five ticks without a word is no longer "now"
STALE_AFTER_S = 10.0
# how a run ended in order (its servers stopped by the supervisor) rather than by a death or a failure
ORDERLY_ENDS = frozenset({RunState.DONE, RunState.STOPPED, RunState.DRAINED})
LOST_HOST_STATES = frozenset({HostState.LOST, HostState.FAILED})


class Freshness(StrEnum):
    LIVE = "live"
    STALE = "stale"
    ENDED = "ended"
    GONE = "gone"


@dataclass(frozen=True)
class Liveness:
    freshness: Freshness
    source: str  # what the figure came from, in words: "supervisor pid 812", "worker gpu0", "host h1"
    as_of: float | None = None  # the host time of the figure (None: never heard)
    why: str = ""  # for a figure that is not live: what ended or went

    @property
    def live(self) -> bool:
        return self.freshness is Freshness.LIVE

    def mark(self, now: float | None = None) -> str:
        """"" for a live figure; else the word shown beside or instead of it: `stale 42s`, `ended`, `gone`."""
        if self.freshness is Freshness.STALE:
            age = None if now is None or self.as_of is None else max(0.0, now - self.as_of)
            return "stale" if age is None else f"stale {duration_text(age)}"
        return "" if self.live else self.freshness.value

    def text(self, now: float | None = None) -> str:
        """The mark with its reason: `gone: supervisor dead`."""
        mark = self.mark(now)
        return f"{mark}: {self.why}" if mark and self.why else mark


def of_run(*, running: bool | None, state: str, connected: bool, pid: int | None = None,
           lost_since: float | None = None) -> Liveness:
    """The supervisor: every live figure's first source. running is a status reply's (None: not known yet)."""
    source = f"supervisor pid {pid}" if pid is not None else "supervisor"
    if running is False or state in ENDED_RUN_STATES:
        if state in ORDERLY_ENDS:
            return Liveness(Freshness.ENDED, source, why=f"run {state}")
        return Liveness(Freshness.GONE, source, why=f"supervisor {state if state in ENDED_RUN_STATES else 'gone'}")
    if not connected:
        return Liveness(Freshness.STALE, source, as_of=lost_since, why="connection to the host lost")
    return Liveness(Freshness.LIVE, source)


def of_worker(run: Liveness, name: str, state: str, as_of: float | None, now: float | None,
              host: Liveness | None = None) -> Liveness:
    """One worker's server: no more live than the supervisor that reads it, nor than the host it runs on."""
    source = f"worker {name}"
    if not run.live:
        return Liveness(run.freshness, source, as_of, run.why)
    if host is not None and not host.live:
        return Liveness(host.freshness, source, as_of, host.why)
    if state not in LIVE_WORKER_STATES:
        return Liveness(Freshness.ENDED, source, as_of, f"server {state}")
    if as_of is not None and now is not None and now - as_of > STALE_AFTER_S:
        return Liveness(Freshness.STALE, source, as_of, "no reading from the supervisor")
    return Liveness(Freshness.LIVE, source, as_of)


def of_host(run: Liveness, name: str, state: str) -> Liveness:
    """A multi-host run's host (or Slurm group): lost or failed takes its servers' figures with it."""
    source = f"host {name}"
    if not run.live:
        return Liveness(run.freshness, source, why=run.why)
    if state in LOST_HOST_STATES:
        return Liveness(Freshness.GONE, source, why=f"host {state}")
    if state == HostState.STOPPED:
        return Liveness(Freshness.ENDED, source, why="host stopped")
    return Liveness(Freshness.LIVE, source)
