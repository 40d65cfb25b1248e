"""A textual-plot chart with a note in its place: a chart with nothing to draw says why in its body."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static
from textual_plot import PlotWidget


class Plot(PlotWidget):
    can_focus = False  # the arrow keys stay with the tables


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

    def compose(self) -> ComposeResult:
        yield self.plot
        yield self._note

    def on_mount(self) -> None:
        self.show_note("no data yet")

    def show_note(self, text: str) -> None:
        """The body says `text` instead of the chart."""
        self._note.update(text)
        self._note.display = True
        self.plot.display = False

    def show_plot(self) -> PlotWidget:
        self._note.display = False
        self.plot.display = True
        return self.plot
