"""Slurm's commands as regen uses them: sbatch a job, read its state (squeue; once it left the queue scontrol, while
slurmctld still remembers it, for MinJobAge; then sacct, the accounting record), scancel the ids regen submitted.
Every call is the plain command (SLURM_CONF and PATH of the supervisor's environment); what Slurm says is kept word
for word for the operator, except the time left of a job past its limit: squeue prints `INVALID` until the job is
killed (about 30 s later), and that word is never shown (time_left_text)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.api.wire import JobSource
from engine.config.schema import time_limit_seconds

log = logging.getLogger("regen.slurm")

TIMEOUT_S = 30.0
FINAL_STATE_WAIT_S = 15.0
JOBS_FILE = "jobs.jsonl"  # under the slurm work dir: every job regen submitted (regen stop cancels these only)
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED")
GONE = "GONE"  # the state of a job neither squeue, scontrol nor sacct knows (any more)
# squeue's %L words that are not a duration, as the operator reads them
TIME_LEFT_WORDS = {"INVALID": "past its limit", "UNLIMITED": "no limit", "NOT_SET": "not set"}
SACCT_FIELDS = "JobID,State,Reason,NodeList"  # sacct -P -o: one line per job, fields split by |


def time_left_text(raw: str) -> str:
    """squeue's time left as the operator reads it: a duration as squeue prints it (`47:48`, `1-02:00:00`), `past its
    limit` for INVALID (a job over its limit that Slurm has not killed yet), `no limit`, `not set`."""
    raw = raw.strip()
    return TIME_LEFT_WORDS.get(raw, raw)


def time_left_s(text: str) -> int | None:
    """squeue's %L (`9:58`, `1:00:00`, `1-02:00:00`) in seconds; 0 for INVALID (past its limit, not killed yet);
    None for UNLIMITED, NOT_SET."""
    if text.strip() == "INVALID":
        return 0
    try:
        return time_limit_seconds(text)
    except ValueError:
        return None


class SlurmError(Exception):
    """A Slurm command failed; the message holds the command and Slurm's words."""


@dataclass
class JobState:
    job_id: str
    state: str  # PENDING, RUNNING, TIMEOUT, CANCELLED, NODE_FAIL, PREEMPTED, COMPLETED, FAILED ... (Slurm's)
    reason: str = ""  # Slurm's reason: Resources, Priority, None, ...
    nodes: str = ""
    time_left: str = ""
    # how often Slurm requeued it (preemption in a REQUEUE partition, a node failure, `scontrol requeue`): a requeued
    # job keeps its id, so (job id, restarts) names one life of it (engine/placement/slurm/step.py's job dir)
    restarts: int = 0
    source: str = JobSource.SQUEUE  # which command said it

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def given_reason(self) -> str:
        """Slurm's reason, "" where it gives none: squeue prints `None` until slurmctld has evaluated the job
        (seconds after a submit) and for a running one."""
        return "" if self.reason == "None" else self.reason

    def words(self) -> str:
        """What Slurm said, as the operator would read it in squeue."""
        reason = f" ({self.given_reason})" if self.given_reason else ""
        nodes = f" on {self.nodes}" if self.nodes and self.nodes != "(null)" else ""
        return f"job {self.job_id} {self.state}{reason}{nodes}"

    def to_dict(self) -> dict:
        return asdict(self)


async def run_captured(argv: list[str], stdin: bytes | None, timeout: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a command; OSError if it cannot start, TimeoutError (the command killed) past
    `timeout`: the caller names the fix."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    rc = await proc.wait()  # communicate() returned once it exited: its exit code, at once
    return rc, out.decode(errors="replace"), err.decode(errors="replace")


async def run(argv: list[str], timeout: float = TIMEOUT_S) -> tuple[int, str, str]:
    try:
        return await run_captured(argv, None, timeout)
    except OSError as exc:
        raise SlurmError(f"cannot run {argv[0]}: {exc} (is Slurm installed here, on PATH?)") from exc
    except asyncio.TimeoutError:
        raise SlurmError(f"{argv[0]} did not answer within {timeout:.0f} s (is slurmctld reachable?)") from None


async def submit(argv: list[str], jobs_file: Path, group: int) -> str:
    """sbatch --parsable ...: the new job's id, recorded in jobs_file before it is returned."""
    rc, out, err = await run(argv)
    job_id = out.strip().split(";")[0]
    if rc != 0 or not job_id.isdigit():
        raise SlurmError(f"sbatch refused the job (exit {rc}): {err.strip() or out.strip() or '(no output)'}")
    jobs_file.parent.mkdir(parents=True, exist_ok=True)
    with open(jobs_file, "a") as f:
        f.write(json.dumps({"job": job_id, "group": group, "ts": time.time()}) + "\n")
    return job_id


def submitted(jobs_file: Path) -> list[str]:
    """Every job id regen recorded as submitted for this run."""
    try:
        lines = jobs_file.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(str(json.loads(line)["job"]))
        except (ValueError, KeyError):
            continue  # a line cut by a crash mid-write
    return out


SQUEUE_FIELDS = "JobID:|,State:|,Reason:|,NodeList:|,TimeLeft:|,RestartCnt:|"  # squeue -O, each field ended by |


def parse_squeue(job_id: str, out: str) -> JobState | None:
    """The job's line of `squeue -h -j ID -O SQUEUE_FIELDS`; None if it is not there."""
    for line in out.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) >= 6 and parts[0] == job_id:
            return JobState(job_id, parts[1], parts[2], parts[3], parts[4], _count(parts[5]))
    return None


def parse_scontrol(job_id: str, out: str) -> JobState | None:
    """`scontrol show job -o ID` (a job that left the queue: scontrol keeps it for MinJobAge); None without a state."""
    fields = dict(w.split("=", 1) for w in out.split() if "=" in w)
    if "JobState" not in fields:
        return None
    return JobState(job_id, fields["JobState"], fields.get("Reason", ""), fields.get("NodeList", ""),
                    fields.get("TimeLimit", ""), _count(fields.get("Restarts", "")), JobSource.SCONTROL)


def parse_sacct(job_id: str, out: str) -> JobState | None:
    """The job's line of `sacct -n -P -X -j ID -o SACCT_FIELDS` (`4127|CANCELLED by 1000|None|gpu-a17`); None if it is
    not there. `CANCELLED by UID` is the state CANCELLED, and who cancelled it goes to the reason."""
    for line in out.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 4 or parts[0] != job_id or not parts[1].strip():
            continue
        state, _, by = parts[1].strip().partition(" ")
        reason = parts[2].strip()
        if by:
            reason = f"{reason}, {by}" if reason not in ("", "None") else by
        return JobState(job_id, state, reason, parts[3].strip(), "", 0, JobSource.SACCT)
    return None


def last_jobs(jobs_file: Path) -> dict[int, str]:
    """The last job regen submitted for each server group (jobs_file's order), by group."""
    try:
        lines = jobs_file.read_text().splitlines()
    except FileNotFoundError:
        return {}
    out: dict[int, str] = {}
    for line in lines:
        try:
            rec = json.loads(line)
            out[int(rec["group"])] = str(rec["job"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by a crash mid-write
    return out


def _count(text: str) -> int:
    return int(text) if text.isdigit() else 0


async def state(job_id: str) -> JobState:
    rc, out, err = await run(["squeue", "-h", "-j", job_id, "-O", SQUEUE_FIELDS])
    found = parse_squeue(job_id, out)
    if found is not None:
        return found
    # gone from the queue (or squeue refuses an old id)
    rc, out, err = await run(["scontrol", "show", "job", "-o", job_id])
    found = parse_scontrol(job_id, out) if rc == 0 else None
    if found is None and rc != 0 and "Invalid job id" not in err:  # not an answer about the job: Slurm's trouble
        raise SlurmError(f"scontrol show job {job_id} (exit {rc}): {err.strip() or out.strip() or '(no output)'} "
                         "(is SLURM_CONF right, slurmctld reachable?)")
    if found is not None:
        return found
    # slurmctld forgot it (MinJobAge after its end): the accounting record, where the cluster keeps one
    try:
        rc, out, err = await run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", SACCT_FIELDS])
    except SlurmError as exc:
        return JobState(job_id, GONE, f"no longer known to slurmctld; {exc}", source=JobSource.NONE)
    found = parse_sacct(job_id, out) if rc == 0 else None
    if found is not None:
        return found
    said = f"sacct (exit {rc}): {err.strip() or out.strip() or '(no output)'}" if rc != 0 else "sacct has no record of it"
    return JobState(job_id, GONE, f"no longer known to slurmctld; {said}", source=JobSource.NONE)


async def cancel(job_ids: list[str]) -> str:
    """scancel exactly these ids (never by name or user); Slurm's words if it complained."""
    if not job_ids:
        return ""
    rc, out, err = await run(["scancel", *job_ids])
    return "" if rc == 0 else f"scancel {' '.join(job_ids)} (exit {rc}): {err.strip()}"


async def cancel_leftovers(jobs_file: Path) -> tuple[list[str], str]:
    """The jobs regen submitted for this run that still run or wait (a supervisor killed before it could cancel
    them): a new supervisor takes the run over, so they are cancelled (their servers hold the nodes' ports).
    Returns the ids cancelled and what scancel said if it complained."""
    live = []
    for job_id in dict.fromkeys(submitted(jobs_file)):
        if (await state(job_id)).active:
            live.append(job_id)
    return live, await cancel(live)


async def lower_limit(job_id: str, limit: str) -> None:
    """`scontrol update JobId=ID TimeLimit=LIMIT`: a user may lower the limit of a job of theirs (not raise it)."""
    rc, out, err = await run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={limit}"])
    if rc != 0:
        raise SlurmError(f"scontrol update JobId={job_id} TimeLimit={limit} (exit {rc}): "
                         f"{err.strip() or out.strip() or '(no output)'}")


async def final_state(job: JobState) -> JobState:
    """A job COMPLETING is on its way out: wait a little for the state it ends in (CANCELLED, TIMEOUT, NODE_FAIL ...),
    which is what the operator is told."""
    deadline = time.monotonic() + FINAL_STATE_WAIT_S
    while job.state == "COMPLETING" and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        try:
            job = await state(job.job_id)
        except SlurmError:
            break  # the last state seen is said
    return job


async def read_end(job: JobState, wait_s: float, group: str) -> JobState:
    """A job's state once cancelled, as Slurm says it (CANCELLED, or COMPLETING for a moment): what the status shows
    from now on, not the RUNNING read before the cancel. Read for at most wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            job = await state(job.job_id)
        except SlurmError as exc:
            log.warning("group %s: the state of job %s after its cancel: %s", group, job.job_id, exc)
            return job
        if not job.active or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.5)
    log.info("group %s: %s%s", group, job.words(), "" if not job.active else
             f" {wait_s:.0f} s after its cancel (its end is read again by `regen status` once the supervisor is gone)")
    return job
