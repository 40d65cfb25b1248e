"""`regen stop` on a [slurm] run whose supervisor is gone: the jobs it submitted (jobs.jsonl in the run's Slurm work
dir) that still run or wait are cancelled by id, nothing else, and the run's telemetry says so."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from engine.config import ConfigError, load_config
from engine.placement.slurm import jobs as slurm_jobs
from engine.placement.slurm.plan import jobs_file
from engine.telemetry import Telemetry
from engine.telemetry_events import AlertEvent


@dataclass(frozen=True)
class LeftJobs:
    cancelled: tuple[str, ...]  # the live ids regen submitted, scancel'ed
    complaint: str = ""  # what scancel (or squeue) said when it failed; "" when it did not

    @property
    def failed(self) -> bool:
        return bool(self.complaint)

    def text(self) -> str:
        ids = ", ".join(self.cancelled)
        if self.complaint:
            return f"cancelling the slurm job(s) {ids} its supervisor left failed: {self.complaint}"
        return f"cancelled the {len(self.cancelled)} slurm job(s) its supervisor left running: {ids}"


def stop_left_jobs(run_dir: Path) -> LeftJobs | None:
    """None where there is nothing to cancel: no [slurm] in the run's frozen run.toml, or none of its jobs lives."""
    try:
        cfg = load_config(run_dir / "run.toml")
    except (ConfigError, OSError):
        return None  # not a run dir regen accepted: the caller's reply (no supervisor) says it
    if cfg.slurm is None:
        return None
    submitted = jobs_file(cfg)
    try:
        ids, said = asyncio.run(slurm_jobs.cancel_leftovers(submitted))
    except slurm_jobs.SlurmError as exc:
        ids, said = slurm_jobs.submitted(submitted), str(exc)
    if not ids and not said:
        return None
    left = LeftJobs(tuple(ids), said)
    telemetry = Telemetry(run_dir)
    try:
        telemetry.emit(AlertEvent(severity="error" if said else "warning", text=f"regen stop: {left.text()}",
                                  evidence=said or "scancel " + " ".join(ids), key="slurm-leftovers"))
    finally:
        telemetry.close()
    return left
