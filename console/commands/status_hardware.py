"""The GPUs and disks of `regen status`, grouped by host in a multi-host run (a one-host run: as always)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from console.view.fit_table import Col, fitted_table
from console.view.model_parts import bytes_text
from engine.api.status import RunStatus


def _na(value, fmt="{}") -> str:
    return "N/A" if value is None else fmt.format(value)


# the text columns wrap, then go (error first) before a number is cut
GPU_COLUMNS = [Col("gpu"), Col("name", drop=2), Col("mem used/total MiB", short="MiB"), Col("util"), Col("temp"),
               Col("power"), Col("error", drop=1)]


def host_name(host: str) -> str:
    return host or "dispatch"  # the supervisor's own host


def hardware_parts(s: RunStatus, console: Console) -> list[Table | Text]:
    """The GPU table (a `host` column once another host's GPUs are in it) and one line per disk."""
    parts: list[Table | Text] = []
    multi = any(ev.host for ev in s.gpus) or any(d.host for d in s.disk)
    if s.gpus:
        rows = []
        for ev in sorted(s.gpus, key=lambda ev: (ev.host, ev.index)) if multi else s.gpus:
            mem = (f"{ev.mem_used_mb:.0f}/{ev.mem_total_mb:.0f}" if ev.mem_used_mb is not None
                   and ev.mem_total_mb is not None else "N/A")
            rows.append([*(host_name(ev.host),) * multi, str(ev.index), ev.name or "N/A", mem,
                         _na(ev.util_pct, "{:.0f}%"), _na(ev.temp_c, "{:.0f}C"), _na(ev.power_w, "{:.0f}W"),
                         ev.error or ""])
        cols = [Col("host")] * multi + GPU_COLUMNS
        parts.append(fitted_table(console, cols, rows, title="GPUs" + (" (by host)" if multi else "")))
    for disk in sorted(s.disk, key=lambda d: (d.host, d.path)) if multi else s.disk:
        where = f"{host_name(disk.host)}:{disk.path}" if multi else disk.path
        parts.append(Text(f"disk {where}: N/A ({disk.error})" if disk.error is not None else
                          f"disk {where}: {bytes_text(disk.free_bytes)} free of {bytes_text(disk.total_bytes)}"))
    return parts
