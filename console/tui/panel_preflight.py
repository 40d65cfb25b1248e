"""Preflight tab: the probe table; the selected probe's command, exit status, output, expected/actual, remedy."""
from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.coordinate import Coordinate
from textual.widgets import DataTable, Static

from probes.model import ProbeReport, ProbeResult
from probes.render import STYLE, detail
from console.tui.widgets import sync_table

COLUMNS = ["status", "probe", "summary", "time"]


class PreflightPanel(Vertical):
    BINDINGS = [
        Binding("r", "app.rerun_probe", "Rerun probe"),
        Binding("a", "app.rerun_probes", "Rerun all"),
        Binding("e", "app.export_probes", "Export JSON"),
    ]

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.report: ProbeReport | None = None

    def compose(self) -> ComposeResult:
        yield Static("probes not run yet", id="preflight-summary")
        with Horizontal():
            table: DataTable[Any] = DataTable(id="probe-table", cursor_type="row")  # cells as sync_table puts them
            for c in COLUMNS:
                table.add_column(c, key=c)
            yield table
            with VerticalScroll(id="probe-detail-box"):
                yield Static(id="probe-detail")

    @property
    def selected_probe(self) -> ProbeResult | None:
        table = self.query_one("#probe-table", DataTable)
        if self.report is None or table.row_count == 0:
            return None
        row_key, _ = table.coordinate_to_cell_key(Coordinate(table.cursor_row, 0))
        return next((r for r in self.report.results if r.id == row_key.value), None)

    def set_report(self, report: ProbeReport, partial: bool = False) -> None:
        if partial and self.report is not None:
            fresh = {r.id: r for r in report.results}
            self.report.results = [fresh.get(r.id, r) for r in self.report.results]
        else:
            self.report = report
        self._draw()

    def on_mount(self) -> None:
        self._draw()  # a report that came before the table was composed

    def _draw(self) -> None:
        r = self.report
        if r is None or not self.query("#probe-table"):
            return  # nothing yet, or the table is not composed (yet, or any more at the app's exit): drawn on mount
        rows = [(p.id, (Text(p.status.value, style=STYLE[p.status]), p.id, p.summary[:70], f"{p.duration_s:.1f}s"))
                for p in r.results]
        sync_table(self.query_one("#probe-table", DataTable), rows, COLUMNS)
        counts = "  ".join(f"{k} {v}" for k, v in r.summary().items() if v)
        self.query_one("#preflight-summary", Static).update(
            f"{r.timing_text(r.host)}: {counts or 'none'}"
            "   [dim]r rerun · a rerun all · e export JSON[/]")
        self.show_selected()

    def show_selected(self) -> None:
        p = self.selected_probe
        self.query_one("#probe-detail", Static).update(detail(p) if p is not None else "")

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.show_selected()
