"""Time-series charts on textual-plot's PlotWidget: x is the time before the newest point, in a unit fit to the span."""
from __future__ import annotations

from dataclasses import dataclass
from math import floor, log10
from typing import Sequence

from textual_plot import HiResMode
from textual_plot.axis_formatter import NumericAxisFormatter
from textual_plot.plot_widget import LegendLocation

from console.tui.chart_frame import ChartFrame
from console.view.series import Series, downsample

PALETTE = ("cyan", "magenta", "yellow", "green", "red", "blue", "bright_white", "orange1", "purple", "spring_green1")
DRAWN_POINTS_MIN = 120
MIN_SPAN_S = 10.0  # the x axis spans the history shown, at least this


@dataclass(frozen=True)
class TimeUnit:
    name: str  # plural, as the axis says it: "minutes ago"
    seconds: float


# the first unit whose limit the span stays under: up to 2 minutes in seconds, 3 hours in minutes, 3 days in hours
TIME_UNITS = ((TimeUnit("seconds", 1.0), 120.0), (TimeUnit("minutes", 60.0), 3 * 3600.0),
              (TimeUnit("hours", 3600.0), 3 * 86400.0))
DAYS = TimeUnit("days", 86400.0)


def time_unit(span_s: float) -> TimeUnit:
    return next((unit for unit, limit in TIME_UNITS if span_s <= limit), DAYS)


class AgoFormatter(NumericAxisFormatter):
    """x ticks are negative (before now); each is labelled with its distance from now, e.g. 30 20 10 0."""

    def get_labels_for_ticks(self, ticks: Sequence[float]) -> list[str]:
        if not ticks:
            return []
        step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
        decimals = -min(0, floor(log10(step))) if step > 0 else 0
        return [f"{abs(t) + 0.0:.{decimals}f}" for t in ticks]


class TimeChart(ChartFrame):
    """A chart redrawn from Series on demand; with nothing to draw, its body says why."""

    def __init__(self, title: str, y_label: str, *, id: str | None = None):
        super().__init__(id=id)
        self.border_title = title
        self._y_label = y_label
        self.unit: TimeUnit | None = None  # the x axis's unit at the last draw (None: nothing drawn)
        self._drawn: tuple | None = None  # what the plot shows now (see draw); None: not drawn

    def on_mount(self) -> None:
        super().on_mount()
        self.plot.set_ylabel(self._y_label)
        self.plot.set_x_formatter(AgoFormatter())
        self.plot.margin_left = 8
        self.plot.margin_bottom = 3  # the tick labels, then the axis label with its unit

    def set_y_label(self, label: str) -> None:
        self._y_label = label
        self.plot.set_ylabel(label)

    def show_note(self, text: str) -> None:
        self.unit = None
        self._drawn = None
        super().show_note(text)

    def draw(self, series: Sequence[tuple[str, Series, float]], now: float | None = None,
             empty: str = "no data yet") -> None:
        """series: (label, points, scale) with values multiplied by scale; now: the x origin (default: the newest
        point); empty: what the body says when no series has a point."""
        plot = self.plot
        ends = [ts for _, s, _ in series if (ts := s.last_ts()) is not None]  # the series with a point
        if not ends:
            self.show_note(empty)
            return
        if not plot.query("#legend"):
            # a telemetry batch can arrive before PlotWidget has composed its legend (seen on a loaded
            # machine: NoMatches '#legend'); the next batch or tab switch draws it
            return
        # a series gains points only at its end (Series.add): its length and ends say whether it changed, and a
        # redraw of a plot costs far more than this (a status poll or a tab switch redraws the panel unchanged)
        drawn = (now, self.size.width, tuple((label, id(s), len(s), s.first_ts(), s.last_ts(), scale)
                                             for label, s, scale in series))
        if drawn == self._drawn:
            return
        self._drawn = drawn
        origin = now if now is not None else max(ends)
        start = min(ts for _, s, _ in series if (ts := s.first_ts()) is not None)
        span = max(MIN_SPAN_S, origin - start)
        unit = time_unit(span)
        self.unit = unit
        self.show_plot()
        with plot.legend_held():
            plot.clear()
            top = 0.0
            for i, (label, s, scale) in enumerate(series):
                points = downsample(s.history(), max(DRAWN_POINTS_MIN, 2 * self.size.width))  # braille: 2 a cell
                if not points:
                    continue
                xs = [(t - origin) / unit.seconds for t, _ in points]
                ys = [v * scale for _, v in points]
                top = max(top, *ys)
                plot.plot(xs, ys, line_style=PALETTE[i % len(PALETTE)], hires_mode=HiResMode.BRAILLE, label=label)
            plot.set_xlabel(f"{unit.name} ago")
            plot.set_xlimits(-span / unit.seconds, 0.0)
            # all zero (a finished or idle run): a range of its own, not the plot's empty one (ticks -0.0000 to 0.00000)
            plot.set_ylimits(0, None if top > 0 else 1.0)
            # top left: the newest points, at the right, are the ones read most
            plot.show_legend(LegendLocation.TOPLEFT, is_visible=len(series) > 1)
