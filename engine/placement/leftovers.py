"""`regen stop` on a run whose supervisor is gone: what it left holding GPUs is released (a [slurm] run's jobs, a
[[hosts]] run's agents and their servers; local servers die with their supervisor), each told in the run's telemetry."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from engine.config.load import ConfigError, load_config
from engine.placement.hosts.leftovers import stop_left_agents
from engine.placement.slurm.leftovers import stop_left_jobs
from engine.telemetry import Telemetry
from engine.api.events import AlertEvent


class Left(Protocol):
    """What one kind of placement left, once stopped (or not: `failed`)."""

    @property
    def failed(self) -> bool: ...

    def text(self) -> str: ...

    def alert(self) -> AlertEvent: ...


def stop_left(run_dir: Path) -> list[Left]:
    """Nothing where nothing was left: no run.toml regen accepted (the caller's no-supervisor reply says it), a run on
    local GPUs only, or no job or agent of it still lives."""
    try:
        cfg = load_config(run_dir / "run.toml")
    except (ConfigError, OSError):
        return []
    found = (stop_left_jobs(cfg) if cfg.slurm is not None else None, stop_left_agents(cfg) if cfg.hosts else None)
    left: list[Left] = [x for x in found if x is not None]
    if left:
        telemetry = Telemetry(run_dir)
        try:
            for x in left:
                telemetry.emit(x.alert())
        finally:
            telemetry.close()
    return left
