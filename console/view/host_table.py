"""The rows of the Workers tab's hosts table (multi-host runs only): each [[hosts]] entry, or each [slurm] group's
allocation as squeue said it last (job id, state, pending reason, nodes, time left), from the status reply; a host whose
run ended or that was lost says so (console/view/liveness.py) instead of its last live figures."""
from __future__ import annotations

from rich.text import Text

from console.view.model import RunModel
from engine.api.status import HostStatus
from engine.api.wire import HostState

HOST_COLUMNS = ["host", "address", "state", "servers", "joins", "lost", "error"]
# a [slurm] run: one row per server group, named after its job; `state` is the link's (up, connecting, lost)
SLURM_COLUMNS = ["host", "job", "job state", "reason", "nodes", "time left", "next job", "state", "servers", "error"]
JOB_STYLE = {"RUNNING": "green", "PENDING": "bold yellow", "CONFIGURING": "yellow", "COMPLETING": "yellow",
             "REQUEUED": "bold yellow", "SUSPENDED": "bold yellow"}  # any other state is an end: red


FINAL_HOST_STATES = ("ended", "stopped", "lost", "failed")


def host_style(state: str) -> str:
    if state == HostState.UP:
        return "green"
    if state in (HostState.DRAINED, HostState.STOPPED, HostState.ENDED):
        return "dim"
    return "bold red" if state in (HostState.LOST, HostState.FAILED) else "yellow"


def job_cells(h: HostStatus, as_of: float | None, live: bool = True) -> tuple:
    """job, job state (with how long it has waited, as of the status reply), reason, nodes, time left, next job; once
    the run is over no time is left and the state is the last one squeue said."""
    j = h.job
    if j is None:
        return ("",) * 6
    nodes = j.nodes if j.nodes not in ("", "(null)") else ""
    # squeue's %L of a job not started is its whole limit; the engine words it (`past its limit`, never INVALID)
    left = j.time_left if j.state == "RUNNING" and live else ""
    # a job that ended with the run (the host `ended`) is its last state, not an alarm
    style = "dim" if j.ended and h.state == HostState.ENDED else JOB_STYLE.get(j.state, "bold red")
    return (j.job_id, Text(j.state_text(as_of), style=style), j.reason_text, nodes, left, j.next_job or "")


def host_rows(m: RunModel) -> tuple[list[str], list[tuple[str, tuple]]]:
    """The columns (a [slurm] run's when any host has a job) and one row per host."""
    slurm = any(h.job is not None for h in m.hosts)
    rows = []
    run = m.run_liveness()
    for h in m.hosts:
        # the run over (or its supervisor gone): each host's last word is history, its link is no more
        live = run.live
        if live or h.state in FINAL_HOST_STATES:  # the host's own last word already says it is over
            state = Text(h.state, style=host_style(h.state))
        else:
            state = Text(f"{run.mark()} (was {h.state})", style="dim")
        error = h.error or ""
        if h.job is not None and error.startswith(f"slurm job {h.job.job_id} "):
            error = ""  # the job's state in words (`slurm job 4128 PENDING (Resources)`): the job's cells say it
        error = error[:80]
        if slurm:
            cells = (h.name, *job_cells(h, m.hosts_as_of, live), state, str(len(h.workers)), error)
        else:
            cells = (h.name, h.address, state, str(len(h.workers)), "" if h.joins is None else str(h.joins),
                     "" if h.lost is None else str(h.lost), error)
        rows.append((h.name, cells))
    return (SLURM_COLUMNS if slurm else HOST_COLUMNS), rows


def groups_text(m: RunModel) -> Text | None:
    """A [slurm] run's groups above its allocations: granted (serving) / pending / wanted, against min_groups (yellow
    while the live run has fewer granted than the plan counts on); None for any other run."""
    g = m.slurm_groups
    if g is None:
        return None
    live = m.run_liveness().live
    return Text(g.text(live=live), style="yellow" if live and g.granted < g.counted else "")
