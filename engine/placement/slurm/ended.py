"""A [slurm] run's allocations once its supervisor is gone (engine.ctl last-status): each server group's last job as
Slurm says it now (squeue while it lists the job, then scontrol, then sacct: engine.placement.slurm.jobs.state), so
a finished run's hosts show each job's last state and `ended`, never the RUNNING a live status said last. A job that
still runs or waits with no supervisor (one killed outright) is said so, with what releases it (`regen stop`)."""
from __future__ import annotations

import asyncio

from engine.config.load import RunConfig
from engine.placement.slurm import jobs as slurm_jobs
from engine.placement.slurm.plan import job_name, jobs_file, layout_of
from engine.api.status import HostStatus, SlurmJobStatus
from engine.api.wire import HostState


def allocations_after(cfg: RunConfig) -> list[HostStatus]:
    """One row per server group (its job's name), as the live status has them."""
    return asyncio.run(_allocations(cfg))


async def _allocations(cfg: RunConfig) -> list[HostStatus]:
    from engine.placement.slurm.link import group_host, job_status  # the link's words for a job, and its host entry

    last = slurm_jobs.last_jobs(jobs_file(cfg))

    async def row_of(group: int) -> HostStatus:
        host = group_host(cfg, group)
        row = HostStatus(name=job_name(cfg, group), address=host.address, state=HostState.STOPPED,
                         work_dir=host.work_dir)
        job_id = last.get(group)
        if job_id is None:
            row.error = f"no job was submitted for it ({jobs_file(cfg)} names none)"
            return row
        try:
            job = await slurm_jobs.state(job_id)
        except slurm_jobs.SlurmError as exc:
            row.job = SlurmJobStatus(job_id=job_id, state="UNKNOWN", reason="Slurm did not answer")
            row.error = f"the last state of slurm job {job_id} cannot be read: {exc}"
            return row
        row.job = job_status(job)
        if job.active:
            row.error = (f"slurm job {job_id} is still {job.state} with no supervisor: `regen stop` cancels it, "
                         "`regen start` takes the run over")
        else:
            row.state = HostState.ENDED
        return row

    # every group asked at once: a status must not wait for Slurm group after group
    return list(await asyncio.gather(*(row_of(g) for g in range(layout_of(cfg).groups))))
