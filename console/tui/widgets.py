"""Small shared widgets and helpers: the run header and in-place DataTable syncing."""
from __future__ import annotations

from typing import Any, Hashable, Iterable

from rich.text import Text
from textual.coordinate import Coordinate
from textual.widget import Widget
from textual.widgets import DataTable

from console.view.model import RunModel
from engine.api.wire import duration_text

STATE_STYLE = {
    "running": "bold green", "done": "bold cyan", "paused": "bold yellow", "draining": "yellow", "starting": "yellow",
    "finishing": "cyan",
    "stopped": "dim", "failed": "bold red", "dead": "bold red", "drained": "dim", "disk_full": "bold red", "unknown": "dim", "ready": "green",
    "loading": "yellow", "crashed": "bold red", "pending": "dim",
    "refused": "bold red",  # a worker whose port another process's server holds: nothing is sent to it
}
CONN_STYLE = {"connected": "green", "connecting": "yellow", "reconnecting": "bold yellow", "lost": "bold red",
              "ended": "cyan", "refused": "bold red"}


def styled(text: str, style_key: str | None = None) -> Text:
    return Text(text, style=STATE_STYLE.get(style_key or text, ""))


class RunHeader(Widget):
    """host, run, state, aggregate tok/s, done/total, ETA, elapsed, connection.

    Redrawn in place (one line, fixed height): Static.update would ask for a layout of the whole screen on every
    tick and every telemetry batch."""

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self._text = Text()

    def render(self) -> Text:
        return self._text

    def show(self, m: RunModel, now: float, now_mono: float) -> None:
        t = Text(no_wrap=True, overflow="ellipsis")
        conn = m.connection
        t.append(f" [{conn.text(now_mono)}] ", style=CONN_STYLE.get(conn.state, ""))  # first: never cut off
        t.append(f"{m.host}", style="bold")
        t.append(f":{m.run_dir or '(no run dir)'}  ")
        running = m.is_running
        if m.fatal is not None:
            t.append(m.state_text()[:90], style="bold white on red")
        elif m.brake_line():
            t.append(m.brake_line()[:110], style="bold white on red")
        else:
            t.append(m.state, style=STATE_STYLE.get(m.state, ""))
        tok = m.tokens_per_s
        t.append(f"  {'-' if not running or tok is None else f'{tok:,.0f}'} tok/s")
        total = m.total
        pct = f" ({100.0 * m.done / total:.1f}%)" if total else ""
        t.append(f"  {m.done:,}/{total:,}{pct}")
        eta = m.eta_s() if running else None
        t.append(f"  ETA {'-' if eta is None else duration_text(eta)}")
        if running:
            t.append(f"  up {duration_text(m.elapsed_s(now))}")
        elif m.run_end is not None and m.started_at is not None:  # how long it ran, not a clock that keeps going
            t.append(f"  ran {duration_text(m.run_end.ts - m.started_at)}")
        if m.rejects.total:  # the count and its parts, in `regen status`'s words (engine.api.status.Rejects.text)
            t.append(f"  rejects {m.rejects.text()}", style="yellow")
        if m.protocol_note:  # the whole note is in the Alerts tab
            t.append("  older engine: one process per op", style="yellow")
        if t != self._text:
            self._text = t
            self.refresh()


class NextStep(Widget):
    """One line under the header once the supervisor is gone (not for a finished run): the `regen start` that resumes
    it, as `regen status` prints it, and the key that copies it. Hidden otherwise."""

    DEFAULT_CSS = "NextStep { height: 1; background: $warning 20%; }"

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self._text = Text()
        self.display = False

    def render(self) -> Text:
        return self._text

    def show(self, m: RunModel) -> None:
        hint = m.next_step()
        shown = hint is not None and bool(hint.text())
        t = Text(no_wrap=True, overflow="ellipsis")
        if hint is not None and hint.command:
            t.append(" next: ", style="bold")
            t.append(hint.command, style="bold")
            t.append("  (y copies it" + (f"; {hint.note})" if hint.note else ")"), style="dim")
        elif hint is not None:
            t.append(f" next: {hint.note}", style="yellow")
        if self.display != shown:
            self.display = shown
        if t != self._text:
            self._text = t
            self.refresh()


class FigureTable(DataTable):
    """A DataTable that renders again only the cells whose content changed: DataTable keys its rendered cells on a
    count of its updates, so the one figure a telemetry batch changes re-rendered every cell (the Workers tab's main
    cost)."""

    CELLS_KEPT = 4096

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._cells_by_content: dict[tuple, Any] = {}

    def _render_cell(self, row_index: int, column_index: int, base_style, width: int, cursor: bool = False,
                     hover: bool = False):
        if row_index < 0 or column_index < 0:  # the header and row labels: DataTable's own cache
            return super()._render_cell(row_index, column_index, base_style, width, cursor, hover)
        row_key = self._row_locations.get_key(row_index)
        column_key = self._column_locations.get_key(column_index)
        if row_key is None or column_key is None:  # DataTable asks only for the cells it lists
            raise KeyError(f"no cell at row {row_index}, column {column_index}")
        key = (row_index, column_index, content_key(self._data[row_key][column_key]), base_style, width, cursor,
               hover, self._show_hover_cursor, self.show_cursor, self.cell_padding, self.rows[row_key].height,
               self._pseudo_class_state)
        lines = self._cells_by_content.get(key)
        if lines is None:
            if len(self._cells_by_content) >= self.CELLS_KEPT:
                self._cells_by_content.clear()
            lines = self._cells_by_content[key] = super()._render_cell(row_index, column_index, base_style, width,
                                                                       cursor, hover)
        return lines


def content_key(cell: Any) -> Hashable:
    """What a cell shows, hashable (a rich Text is not)."""
    if isinstance(cell, Text):
        return ("text", cell.plain, str(cell.style), tuple((sp.start, sp.end, str(sp.style)) for sp in cell.spans),
                cell.justify, cell.no_wrap, cell.overflow)
    return (type(cell).__name__, str(cell))


def sync_table(table: DataTable, rows: Iterable[tuple[Hashable, tuple[Any, ...]]], columns: list[str]) -> None:
    """Make `table` show `rows` (key, cells) in order, touching only the cells that changed."""
    cache: dict[Hashable, tuple] = table.__dict__.setdefault("_regen_cells", {})
    seen = set()
    for key, cells in rows:
        seen.add(key)
        old = cache.get(key)
        if old is None:
            table.add_row(*cells, key=str(key))
        elif old != cells:
            for col, (a, b) in enumerate(zip(old, cells)):
                if a != b:
                    table.update_cell(str(key), columns[col], b, update_width=True)
        cache[key] = cells
    for key in [k for k in cache if k not in seen]:
        table.remove_row(str(key))
        del cache[key]


def selected_row_key(table: DataTable) -> str | None:
    """The key of the row under the cursor, or None for an empty table."""
    if table.row_count == 0:
        return None
    row_key, _ = table.coordinate_to_cell_key(Coordinate(table.cursor_row, 0))
    return row_key.value


def bar(fraction: float, width: int = 12) -> str:
    fraction = min(1.0, max(0.0, fraction))
    full = int(fraction * width)
    return "█" * full + "░" * (width - full)


def pct(share: float | None) -> str:
    return "N/A" if share is None else f"{share:.1%}"
