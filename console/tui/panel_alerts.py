"""Alerts tab: every alert the host raised or the console saw (latest last; the cursor follows new ones), and
under the list the evidence of the highlighted one (for a dead supervisor: the path, the remedy, the log)."""
from __future__ import annotations

import time
from typing import Any

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from console.view.model import RunModel

from console.view.model_parts import AlertView
from console.tui.widgets import selected_row_key, sync_table
from engine.api.wire import Severity

COLUMNS = ["time", "severity", "from", "alert", "seen"]
SEVERITY_STYLE = {"info": "dim", "warning": "yellow", "error": "bold red", "critical": "bold white on red"}


def clock_text(ts: float) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.gmtime(ts))


def row_key(a: AlertView) -> str:
    return f"{a.key}|{id(a)}"


class AlertsPanel(Vertical):
    DEFAULT_CSS = """
    AlertsPanel #alerts-table { height: 1fr; }
    AlertsPanel #alert-detail { height: auto; max-height: 12; padding: 0 1; border-top: solid $primary; }
    """
    _placed_row: int | None = None  # where following put the cursor last (the fatal alert's row, or the last one)

    def compose(self) -> ComposeResult:
        table: DataTable[Any] = DataTable(id="alerts-table", cursor_type="row")  # cells as sync_table puts them
        for c in COLUMNS:
            table.add_column(c, key=c)
        yield table
        yield Static("", id="alert-detail")

    def refresh_from(self, m: RunModel) -> None:
        self._by_key = {row_key(a): a for a in m.alerts}
        rows = [(row_key(a), (clock_text(a.ts), Text(a.severity, style=SEVERITY_STYLE.get(a.severity, "")),
                              a.origin, a.text[:160], f"x{a.count}")) for a in m.alerts]
        table = self.query_one("#alerts-table", DataTable)
        following = table.cursor_row >= table.row_count - 1 or table.cursor_row == self._placed_row
        sync_table(table, rows, COLUMNS)
        if following and table.row_count:
            # follow new alerts unless the operator moved; a run's fatal alert outranks whatever came after it
            fatal = [i for i, a in enumerate(m.alerts) if a.severity == Severity.CRITICAL]
            self._placed_row = fatal[-1] if fatal else table.row_count - 1
            table.move_cursor(row=self._placed_row)
        self._show_detail(selected_row_key(table))

    @on(DataTable.RowHighlighted, "#alerts-table")
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_detail(event.row_key.value)

    def _show_detail(self, key: str | None) -> None:
        a = getattr(self, "_by_key", {}).get(key) if key is not None else None
        detail = self.query_one("#alert-detail", Static)
        if a is None:
            detail.update("")
            return
        text = Text(a.text, style="bold")
        if a.evidence:
            text.append("\n" + a.evidence)
        detail.update(text)
