"""Disk tab: free space of the run dir and /dev/shm (and every remote host's work dir and /dev/shm) over time,
and the time until full at the current rate."""
from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from console.tui.charts import TimeChart
from console.view.model import RunModel
from console.view.model_parts import bytes_text
from engine.api.wire import duration_text


def size_unit(largest: float) -> tuple[str, float]:
    """The unit the largest filesystem reads best in (a small one must not read 0.0 GiB)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if largest >= size:
            return unit, size
    return "KiB", 2**10


class DiskPanel(Vertical):
    def compose(self) -> ComposeResult:
        yield Static(id="disk-table")
        yield TimeChart("free space", "", id="disk-chart")

    def refresh_from(self, m: RunModel) -> None:
        t = Table(expand=True)
        disks = sorted(m.disks.values(), key=lambda d: (d.host, d.path))
        multi = any(d.host for d in disks)
        errors = any(d.error is not None for d in disks)  # a host's readings stopped: N/A, and why
        for c in ("host",) * multi + ("path", "free", "total", "used %", "write rate", "full in") + ("error",) * errors:
            t.add_column(c)
        run = m.run_liveness()  # the supervisor reads the disks: once it is gone, the figures are its last
        for d in disks:
            host = (d.host or "dispatch",) * multi
            if not run.live and d.error is None:
                used = 100.0 * (1 - d.free_bytes / d.total_bytes) if d.total_bytes else None
                t.add_row(*host, d.path, bytes_text(d.free_bytes), bytes_text(d.total_bytes),
                          "N/A" if used is None else f"{used:.1f}%", "-",
                          run.mark(m.last_ts), *("",) * errors, style="dim")
                continue
            if d.error is not None:
                t.add_row(*host, d.path, "N/A", "N/A", "N/A", "N/A", "N/A", d.error, style="yellow")
                continue
            rate = d.write_rate()
            full_in = d.time_to_full()
            used = 100.0 * (1 - d.free_bytes / d.total_bytes) if d.total_bytes else None
            t.add_row(*host, d.path, bytes_text(d.free_bytes), bytes_text(d.total_bytes),
                      "N/A" if used is None else f"{used:.1f}%",
                      "N/A" if rate is None else f"{bytes_text(rate)}/s",
                      "not filling" if full_in is None else duration_text(full_in), *("",) * errors,
                      style="bold red" if full_in is not None and full_in < 6 * 3600 else "")
        self.query_one("#disk-table", Static).update(t)
        unit, size = size_unit(max((d.total_bytes for d in disks), default=0))
        chart = self.query_one("#disk-chart", TimeChart)
        chart.border_title = f"free space ({unit})" + ("" if run.live else f", last readings ({run.text(m.last_ts)})")
        chart.set_y_label(unit)
        chart.draw([(d.label, d.history, 1 / size) for d in disks], empty="no disk readings yet")
