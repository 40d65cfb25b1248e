"""The Workers tab's hosts table widget (multi-host runs only): the rows console/view/host_table.py builds, redrawn
cell by cell."""
from __future__ import annotations

from typing import Any

from console.tui.widgets import FigureTable, sync_table
from console.view.host_table import host_rows
from console.view.model import RunModel


class HostTable(FigureTable):
    """Hidden on a one-host run (no hosts in its status); never focused (the workers table below has the cursor)."""

    can_focus = False

    def __init__(self, **kw: Any) -> None:
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
