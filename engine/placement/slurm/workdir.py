"""The login node's side of a [slurm] run's work dir, shared with the nodes: the engine copy every group's job steps
run from (deployed once per supervisor, never under running jobs) and each group's host.toml; the link's commands "on
the host" run here, on that shared filesystem."""
from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

from engine.config.load import RunConfig, dump_toml
from engine.placement.hosts.deploy import engine_tarball
from engine.placement.hosts.ssh import AGENT_DIR, HostError
from engine.placement.slurm.jobs import run_captured
from engine.servers.tuning_record import RECORD_FILE, TuningRecord, write_record


async def run_here(command: str, stdin: bytes | None = None, timeout: float = 60.0) -> tuple[int, str, str]:
    """`/bin/sh -c command` on the login node: (exit code, stdout, stderr); HostError if it cannot run or times out."""
    try:
        return await run_captured(["/bin/sh", "-c", command], stdin, timeout)
    except OSError as exc:
        raise HostError(f"cannot run /bin/sh: {exc}") from exc
    except asyncio.TimeoutError:
        raise HostError(f"`{command[:80]}` timed out after {timeout:.0f} s") from None


async def prepare_work_dir(slurm_dir: Path, group: int, group_dir: Path, engine_root: Path, cfg: RunConfig,
                           tuning: TuningRecord | None = None) -> None:
    """The engine copy under slurm_dir (once per supervisor: every group's job runs from the same copy) and the
    group's host.toml (`cfg`, the group's host config) and tuning record in its dir; HostError naming the dir if
    either fails."""
    engine_dir = slurm_dir / AGENT_DIR
    marker = engine_dir / ".deployed-by"
    me = f"supervisor pid {os.getpid()}"
    try:
        group_dir.mkdir(parents=True, exist_ok=True)
        if not marker.exists() or marker.read_text() != me:  # once per supervisor, not under running jobs
            staging = slurm_dir / f".engine-{group}"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            proc = await asyncio.create_subprocess_exec("tar", "-x", "-C", str(staging), "-f", "-",
                                                        stdin=asyncio.subprocess.PIPE)
            await proc.communicate(engine_tarball(engine_root))
            if not marker.exists() or marker.read_text() != me:
                shutil.rmtree(engine_dir, ignore_errors=True)
                engine_dir.parent.mkdir(parents=True, exist_ok=True)
                staging.rename(engine_dir)
                marker.write_text(me)
            else:
                shutil.rmtree(staging, ignore_errors=True)
        (group_dir / "host.toml").write_text(dump_toml(cfg))
    except OSError as exc:
        raise HostError(f"preparing the Slurm work dir {slurm_dir}: {exc}") from exc
    write_group_tuning(group_dir, tuning)


def write_group_tuning(group_dir: Path, record: TuningRecord | None) -> None:
    """Where the group's next job starts its servers (engine.servers.tuning.RunTuning.host_record), beside its
    host.toml: each job's step copies it into the job's dir (engine/placement/slurm/step.py); none when the run has
    none (a stale one goes). HostError naming the file if it cannot be written."""
    path = group_dir / RECORD_FILE
    try:
        if record is None:
            path.unlink(missing_ok=True)
        else:
            write_record(path, record)
    except OSError as exc:
        raise HostError(f"writing the Slurm group's {path}: {exc}") from exc
