"""The Workers tab's hosts table (multi-host runs only): each [[hosts]] entry, or each [slurm] group's allocation as
squeue says it (job id, state, pending reason, nodes, time left), from the status reply, redrawn cell by cell."""
from __future__ import annotations

from rich.text import Text

from console.tui.model import RunModel
from console.tui.widgets import FigureTable, sync_table
from engine.run.status import HostStatus

HOST_COLUMNS = ["host", "address", "state", "servers", "joins", "lost", "error"]
# a [slurm] run: one row per server group, named after its job; `state` is the link's (up, connecting, lost)
SLURM_COLUMNS = ["host", "job", "job state", "reason", "nodes", "time left", "next job", "state", "servers", "error"]
JOB_STYLE = {"RUNNING": "green", "PENDING": "bold yellow", "CONFIGURING": "yellow", "COMPLETING": "yellow",
             "REQUEUED": "bold yellow", "SUSPENDED": "bold yellow"}  # any other state is an end: red


def host_style(state: str) -> str:
    return "green" if state == "up" else "dim" if state in ("drained", "stopped", "ended") else "bold red" if state in (
        "lost", "failed") else "yellow"


def job_cells(h: HostStatus, as_of: float | None) -> tuple:
    """job, job state (with how long it has waited, as of the status reply), reason, nodes, time left, next job."""
    j = h.job
    if j is None:
        return ("",) * 6
    nodes = j.nodes if j.nodes not in ("", "(null)") else ""
    # squeue's %L of a job not started is its whole limit; the engine words it (`past its limit`, never INVALID)
    left = j.time_left if j.state == "RUNNING" else ""
    # a job that ended with the run (the host `ended`) is its last state, not an alarm
    style = "dim" if j.ended and h.state == "ended" else JOB_STYLE.get(j.state, "bold red")
    return (j.job_id, Text(j.state_text(as_of), style=style), j.reason_text, nodes, left, j.next_job or "")


def host_rows(m: RunModel) -> tuple[list[str], list[tuple[str, tuple]]]:
    """The columns (a [slurm] run's when any host has a job) and one row per host."""
    slurm = any(h.job is not None for h in m.hosts)
    rows = []
    for h in m.hosts:
        state = Text(h.state, style=host_style(h.state))
        error = h.error or ""
        if h.job is not None and error.startswith(f"slurm job {h.job.job_id} "):
            error = ""  # the job's state in words (`slurm job 4128 PENDING (Resources)`): the job's cells say it
        error = error[:80]
        if slurm:
            cells = (h.name, *job_cells(h, m.hosts_as_of), state, str(len(h.workers)), error)
        else:
            cells = (h.name, h.address, state, str(len(h.workers)), "" if h.joins is None else str(h.joins),
                     "" if h.lost is None else str(h.lost), error)
        rows.append((h.name, cells))
    return (SLURM_COLUMNS if slurm else HOST_COLUMNS), rows


class HostTable(FigureTable):
    """Hidden on a one-host run (no hosts in its status); never focused (the workers table below has the cursor)."""

    can_focus = False

    def __init__(self, **kw):
        super().__init__(cursor_type="none", zebra_stripes=True, **kw)
        self._columns: list[str] = []
        self.display = False

    def show(self, m: RunModel) -> None:
        columns, rows = host_rows(m)
        if self.display != bool(rows):  # set only on a change: each set asks the screen for a layout
            self.display = bool(rows)
        if columns != self._columns:
            self.clear(columns=True)
            self.__dict__.pop("_regen_cells", None)  # sync_table's cache of the rows shown
            self._columns = columns
            for c in columns:
                self.add_column(c, key=c)
        sync_table(self, rows, columns)
