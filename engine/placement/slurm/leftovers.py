"""`regen stop` on a [slurm] run whose supervisor is gone: the jobs it submitted (jobs.jsonl in the run's Slurm work
dir) that still run or wait are cancelled by id, nothing else (engine/placement/leftovers.py reads the run's config
and tells the result)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine.config.load import RunConfig
from engine.placement.slurm import jobs as slurm_jobs
from engine.placement.slurm.plan import jobs_file
from engine.api.events import AlertEvent
from engine.api.wire import Severity


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

    def alert(self) -> AlertEvent:
        return AlertEvent(severity=Severity.ERROR if self.failed else Severity.WARNING, text=f"regen stop: {self.text()}",
                          evidence=self.complaint or "scancel " + " ".join(self.cancelled), key="slurm-leftovers")


def stop_left_jobs(cfg: RunConfig) -> LeftJobs | None:
    """None where none of the run's jobs lives."""
    submitted = jobs_file(cfg)
    try:
        ids, said = asyncio.run(slurm_jobs.cancel_leftovers(submitted))
    except slurm_jobs.SlurmError as exc:
        ids, said = slurm_jobs.submitted(submitted), str(exc)
    return LeftJobs(tuple(ids), said) if ids or said else None
