"""Alerts tab: every alert the host raised or the console saw (latest last; the cursor follows new ones)."""
from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable

from console.tui.model import RunModel
from console.tui.widgets import sync_table

COLUMNS = ["time", "severity", "from", "alert", "seen"]
SEVERITY_STYLE = {"info": "dim", "warning": "yellow", "error": "bold red", "critical": "bold white on red"}


def clock_text(ts: float) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.gmtime(ts))


class AlertsPanel(Vertical):
    def compose(self) -> ComposeResult:
        table = DataTable(id="alerts-table", cursor_type="row")
        for c in COLUMNS:
            table.add_column(c, key=c)
        yield table

    def refresh_from(self, m: RunModel) -> None:
        rows = [(f"{a.key}|{id(a)}", (clock_text(a.ts), Text(a.severity, style=SEVERITY_STYLE.get(a.severity, "")),
                                      a.origin, a.text[:160], f"x{a.count}")) for a in m.alerts]
        table = self.query_one("#alerts-table", DataTable)
        at_end = table.cursor_row >= table.row_count - 1
        sync_table(table, rows, COLUMNS)
        if at_end and table.row_count:
            table.move_cursor(row=table.row_count - 1)  # follow new alerts unless the operator scrolled up
