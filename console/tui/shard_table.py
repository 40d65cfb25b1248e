"""The shard rows as a Line API widget: only the visible rows are rendered, only changed ones redrawn."""
from __future__ import annotations

from functools import lru_cache

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from console.view.model_parts import ShardView
from console.view.shard_list import ShardList, has_problem
from engine.api.wire import AlertLevels, ShardState
from console.tui.widgets import STATE_STYLE, bar, pct

# (title, width, right-aligned)
COLUMNS = [("", 2, False), ("shard", 8, False), ("state", 10, False), ("progress", 20, False),
           ("samples", 13, True), ("tokens", 13, True), ("empty %", 9, True), ("truncated %", 13, True),
           ("loops", 7, True)]
# a terminal narrower than the full row (80 columns): the bar goes and the headers shorten, no figure is cut
NARROW_COLUMNS = [("", 2, False), ("shard", 8, False), ("state", 10, False), ("done", 6, True),
                  ("samples", 11, True), ("tokens", 9, True), ("empty %", 7, True), ("trunc %", 7, True),
                  ("loops", 5, True)]


def width_of(columns: list[tuple[str, int, bool]]) -> int:
    return sum(w for _, w, _ in columns) + len(columns) - 1


WIDTH = width_of(COLUMNS)
NARROW_WIDTH = width_of(NARROW_COLUMNS)


def tokens_text(n: int, width: int) -> str:
    """A token count in `width` characters: whole with thousands separators, else in k / M / G."""
    text = f"{n:,}"
    if len(text) <= width:
        return text
    unit, size = next((u, z) for u, z in (("G", 1e9), ("M", 1e6), ("k", 1e3)) if n >= z)
    return f"{n / size:.1f}{unit}"


@lru_cache(maxsize=64)
def _style(spec: str) -> Style:
    return Style.parse(spec) if spec else Style()


def row_cells(s: ShardView, selected: bool, narrow: bool = False,
              levels: AlertLevels = AlertLevels()) -> list[tuple[str, str]]:
    """(text, style) per column (COLUMNS, or NARROW_COLUMNS when narrow): what a shard's row says; a share over the
    run's alert level (the engine's) is coloured."""
    e, t = s.empty_share, s.truncated_share
    state = (("⏸ paused", "bold black on yellow") if s.state == ShardState.PAUSED
             else (s.state, STATE_STYLE.get(s.state, "")))
    mark = ("●" if selected else " ") + ("!" if has_problem(s, levels) else " ")
    return [(mark.rstrip(), "bold magenta" if selected else "bold red"),
            (s.id, ""), state,
            (f"{100 * s.fraction:5.1f}%" if narrow else f"{bar(s.fraction)} {100 * s.fraction:5.1f}%", ""),
            (f"{s.done}/{s.total}", ""), (tokens_text(s.output_tokens, 9 if narrow else 13), ""), (pct(e), "bold red" if e is not None and e > levels.empty_share else ""),
            (pct(t), "yellow" if t is not None and t > levels.truncated_share else ""),
            (str(s.repetition) if s.repetition else "", "bold red")]


def line_segments(cells: list[tuple[str, str]], base: Style, columns=COLUMNS) -> list[Segment]:
    out: list[Segment] = []
    for (text, style), (_, width, right) in zip(cells, columns):
        text = text if len(text) <= width else text[:width - 1] + "…"
        text = text.rjust(width) if right else text.ljust(width)
        out.append(Segment(text, base + _style(style) if style else base))
        out.append(Segment(" ", base))
    return out[:-1]


class ShardTable(ScrollView, can_focus=True):
    """Rows come from a ShardList; render_line draws row `scroll_y + y - 1` (line 0 is the column header)."""

    COMPONENT_CLASSES = {"shard-table--header", "shard-table--cursor", "shard-table--selected"}
    DEFAULT_CSS = """
    ShardTable { height: 1fr; }
    ShardTable > .shard-table--header { text-style: bold; background: $panel; }
    ShardTable > .shard-table--cursor { background: $block-cursor-background; color: $block-cursor-foreground; }
    ShardTable > .shard-table--selected { background: $primary 30%; }
    """
    BINDINGS = [
        Binding("up", "cursor(-1)", "Up", show=False), Binding("down", "cursor(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False), Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "jump(0)", "First", show=False), Binding("end", "jump(-1)", "Last", show=False),
    ]

    def __init__(self, shards: ShardList, **kwargs):
        super().__init__(**kwargs)
        self.shards = shards
        self.cursor_row = 0
        self._cursor_id: str | None = None  # the cursor follows its shard when the order changes
        self.virtual_size = Size(WIDTH, 1)

    # -- data --------------------------------------------------------------------------------
    @property
    def row_count(self) -> int:
        return len(self.shards)

    @property
    def cursor_shard(self) -> str | None:
        return self.shards.id_at(self.cursor_row) if 0 <= self.cursor_row < len(self.shards) else None

    def cells(self, sid: str) -> dict[str, str]:
        """A shard's row as shown, by column title (its text, whether or not it is scrolled into view)."""
        narrow = self.narrow
        cells = row_cells(self.shards.shard(sid), sid in self.shards.selected, narrow, self.shards.levels)
        return {title or "mark": text for (title, _, _), (text, _) in zip(NARROW_COLUMNS if narrow else COLUMNS, cells)}

    @property
    def narrow(self) -> bool:
        """Too narrow for the full row (the bar and long headers go first, then it scrolls sideways)."""
        return 0 < self.size.width < WIDTH

    def on_resize(self) -> None:
        self.virtual_size = Size(NARROW_WIDTH if self.narrow else WIDTH, len(self.shards) + 1)
        self.refresh()

    def rows_changed(self, changed: set[str], order_changed: bool) -> None:
        """Redraw after a fold: the whole view when the order changed, else just the visible changed rows."""
        if order_changed:
            self.virtual_size = Size(NARROW_WIDTH if self.narrow else WIDTH, len(self.shards) + 1)
            row = self.shards.row_of(self._cursor_id) if self._cursor_id is not None else None
            self._set_cursor(self.cursor_row if row is None else row, follow=False)
            self.refresh()
            return
        top, height = self.scroll_offset.y, self.size.height - 1
        for sid in changed:
            row = self.shards.row_of(sid)
            if row is not None and top <= row < top + height:
                self.refresh_line(row + 1)

    def render_line(self, y: int) -> Strip:
        base = self.rich_style
        narrow = self.narrow
        columns = NARROW_COLUMNS if narrow else COLUMNS
        if y == 0:
            style = base + self.get_component_rich_style("shard-table--header")
            strip = Strip(line_segments([(t, "") for t, _, _ in columns], style, columns))
        else:
            row = self.scroll_offset.y + y - 1
            if row >= len(self.shards):
                return Strip.blank(self.size.width, base)
            sid = self.shards.id_at(row)
            selected = sid in self.shards.selected
            style = base
            if selected:
                style = style + self.get_component_rich_style("shard-table--selected")
            if row == self.cursor_row and self.has_focus:
                style = style + self.get_component_rich_style("shard-table--cursor")
            strip = Strip(line_segments(row_cells(self.shards.shard(sid), selected, narrow, self.shards.levels), style,
                                        columns))
        x = self.scroll_offset.x
        return strip.crop_extend(x, x + self.size.width, style)

    # -- cursor ------------------------------------------------------------------------------
    def _set_cursor(self, row: int, follow: bool = True) -> None:
        n = len(self.shards)
        row = max(0, min(row, n - 1)) if n else 0
        old = self.cursor_row
        self.cursor_row = row
        self._cursor_id = self.cursor_shard
        if not follow:
            return
        visible = max(1, self.size.height - 1)
        top = self.scroll_offset.y
        if row < top:
            self.scroll_to(y=row, animate=False, immediate=True)
        elif row >= top + visible:
            self.scroll_to(y=row - visible + 1, animate=False, immediate=True)
        self.refresh_line(old + 1)
        self.refresh_line(row + 1)

    def move_cursor(self, row: int) -> None:
        self._set_cursor(row)

    def refresh_cursor_row(self) -> None:
        self.refresh_line(self.cursor_row + 1)

    def action_cursor(self, delta: int) -> None:
        self._set_cursor(self.cursor_row + delta)

    def action_page(self, pages: int) -> None:
        self._set_cursor(self.cursor_row + pages * max(1, self.size.height - 2))

    def action_jump(self, row: int) -> None:
        self._set_cursor(row if row >= 0 else len(self.shards) - 1)

    def on_click(self, event: events.Click) -> None:
        if event.y >= 1:
            self._set_cursor(self.scroll_offset.y + event.y - 1)

    def on_focus(self) -> None:
        self.refresh_cursor_row()

    def on_blur(self) -> None:
        self.refresh_cursor_row()
