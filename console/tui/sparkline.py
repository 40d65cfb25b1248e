"""Sparklines on one shared scale: textual's Sparkline spans its own data's min to max, so each row is given the
scale's ends as values its summary never draws."""
from __future__ import annotations

from typing import Sequence

from textual.widgets import Sparkline


class ScaleEnd(float):
    """A value that sets the scale (0, or the shared top) or pads a short history, without being drawn."""


def on_scale(values: Sequence[float], top: float, length: int = 0) -> list[float]:
    """`values` on the scale 0..top, front-padded to `length` so that rows of different lengths line up in time."""
    pad = [ScaleEnd(0.0)] * max(0, length - len(values))
    return [ScaleEnd(0.0), ScaleEnd(top), *pad, *values]


def drawn_max(bucket: Sequence[float]) -> float:
    """A bar's height: the bucket's highest real value (0 for a bucket of padding only)."""
    return max((v for v in bucket if not isinstance(v, ScaleEnd)), default=0.0)


class ScaledSparkline(Sparkline):
    def __init__(self, data: Sequence[float] | None = None, **kw):
        super().__init__(data, summary_function=drawn_max, **kw)
