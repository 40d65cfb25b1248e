"""Time-series charts on textual-plot's PlotWidget: x is minutes before the newest point."""
from __future__ import annotations

from typing import Sequence

from textual_plot import HiResMode, PlotWidget

from console.tui.model import Series

PALETTE = ("cyan", "magenta", "yellow", "green", "red", "blue", "bright_white", "orange1", "purple", "spring_green1")


class TimeChart(PlotWidget):
    """A non-focusable chart (the arrow keys stay with the tables) redrawn from Series on demand."""

    can_focus = False

    def __init__(self, title: str, y_label: str, *, id: str | None = None):
        super().__init__(id=id, allow_pan_and_zoom=False)
        self.border_title = title
        self._y_label = y_label

    def on_mount(self) -> None:
        super().on_mount()
        self.set_xlabel("minutes ago")
        self.set_ylabel(self._y_label)
        self.margin_left = 8
        self.margin_bottom = 2

    def draw(self, series: Sequence[tuple[str, Series, float]], now: float | None = None) -> None:
        """series: (label, points, scale) with values multiplied by scale; now: the x origin (default newest ts)."""
        if not self.query("#legend"):
            # a telemetry batch can arrive before PlotWidget has composed its legend (seen on a loaded
            # machine: NoMatches '#legend'); the next batch or tab switch draws it
            return
        self.clear()
        ends = [s.points[-1][0] for _, s, _ in series if len(s)]
        if not ends:
            return
        origin = now if now is not None else max(ends)
        for i, (label, s, scale) in enumerate(series):
            if len(s) < 1:
                continue
            xs = [(t - origin) / 60.0 for t, _ in s.points]
            ys = [v * scale for _, v in s.points]
            self.plot(xs, ys, line_style=PALETTE[i % len(PALETTE)], hires_mode=HiResMode.BRAILLE, label=label)
        self.set_ylimits(0, None)
        self.show_legend(is_visible=len(series) > 1)
