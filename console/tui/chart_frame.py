"""A textual-plot chart with a note in its place: a chart with nothing to draw says why in its body."""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

from textual.app import ComposeResult, RenderResult
from textual.containers import Vertical
from textual.widgets import Static
from textual_hires_canvas import Canvas
from textual_plot import PlotWidget


class Plot(PlotWidget):
    """PlotWidget drawn at a lower cost, the same on screen: its legend is rebuilt only when what it lists changes
    (PlotWidget rebuilds it on every clear() and plot(), and each rebuild, a Static.update, asks the whole screen for
    a layout), and a redraw refreshes each canvas once (Canvas refreshes itself on every cell a line sets)."""

    can_focus = False  # the arrow keys stay with the tables

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._legend_held = False
        self._legend_drawn: tuple | None = None

    @contextmanager
    def legend_held(self) -> Iterator[None]:
        """Within: clear(), plot() and show_legend() leave the legend alone; after: it is brought up to date once."""
        self._legend_held = True
        try:
            yield
        finally:
            self._legend_held = False
            self._update_legend()

    def _legend_key(self) -> tuple:
        """Everything the legend's text and position follow."""
        styles = tuple((type(d).__name__, d.hires_mode, getattr(d, "line_style", None), getattr(d, "marker", None),
                        getattr(d, "marker_style", None), str(getattr(d, "bar_style", None))) for d in self._datasets)
        lines = tuple((label, v.line_style) for label, v in zip(self._v_lines_labels, self._v_lines))
        return (tuple(self._labels), styles, lines, self._legend_location, self._legend_relative_offset,
                self._scale_rectangle)

    def render(self) -> RenderResult:
        with ExitStack() as stack:
            for canvas in self.query(Canvas):  # textual-plot's (textual-hires-canvas)
                stack.enter_context(canvas.batch_refresh())
            return super().render()

    def _update_legend(self) -> None:
        if self._legend_held:
            return
        if not self.query("#legend"):  # not composed yet: nothing to update
            return
        key = (self.query_one("#legend").display, *self._legend_key())
        if key == self._legend_drawn:
            return
        super()._update_legend()
        self._legend_drawn = (self.query_one("#legend").display, *self._legend_key())  # positioning may move it


class ChartFrame(Vertical):
    DEFAULT_CSS = """
    ChartFrame > .chart-note {
        width: 1fr; height: 1fr; content-align: center middle; text-align: center; color: $text-muted;
    }
    ChartFrame > Plot { height: 1fr; }
    """

    def __init__(self, *, id: str | None = None):
        super().__init__(id=id)
        self.plot = Plot(allow_pan_and_zoom=False)
        self._note = Static("no data yet", classes="chart-note")
        self._note_text = "no data yet"

    def compose(self) -> ComposeResult:
        yield self.plot
        yield self._note

    def on_mount(self) -> None:
        self.show_note("no data yet")

    def show_note(self, text: str) -> None:
        """The body says `text` instead of the chart."""
        if text != self._note_text:  # Static.update asks for a layout of the whole screen
            self._note_text = text
            self._note.update(text)
        self._note.display = True
        self.plot.display = False

    def show_plot(self) -> PlotWidget:
        self._note.display = False
        self.plot.display = True
        return self.plot
