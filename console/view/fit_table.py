"""A rich Table that fits a width by dropping text columns: numbers, states and ids are never cut."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table

CELL_PADDING = 2  # rich's default (0, 1) padding
UNBOUNDED = 100_000


@dataclass(frozen=True)
class Col:
    header: str
    drop: int = 0  # 0: kept whole (never wrapped, cut or dropped); n > 0: text, wraps, dropped highest n first
    short: str = ""  # the header when the full ones do not fit

    def title(self, short: bool) -> str:
        return self.short if short and self.short else self.header


def fitted_table(console: Console, cols: Sequence[Col], rows: Sequence[Sequence[RenderableType]], *,
                 title: str = "") -> Table:
    """The table at the console's width: text columns wrap at word boundaries; while the kept columns whole plus the
    text columns' longest words do not fit, the headers are shortened, then the text column with the highest
    `drop` goes (named in the title)."""
    shown = list(range(len(cols)))
    dropped: list[str] = []

    def needed(short: bool) -> int:
        return _needed(console, [cols[i].title(short) for i in shown], [cols[i].drop == 0 for i in shown],
                       [[r[i] for i in shown] for r in rows])

    short = needed(False) > console.width
    while needed(short) > console.width:
        droppable = [i for i in shown if cols[i].drop > 0]
        if not droppable:
            break
        victim = max(droppable, key=lambda i: cols[i].drop)
        shown.remove(victim)
        dropped.append(cols[victim].header)
    note = f" ({', '.join(dropped)} not shown: too narrow; --wide shows every column)" if dropped else ""
    table = Table(title=title + note, expand=False)
    for i in shown:
        text = cols[i].drop > 0  # wraps, and a word longer than its share folds onto the next line, never cut
        table.add_column(cols[i].title(short), no_wrap=not text, overflow="fold" if text else "ellipsis")
    for row in rows:
        table.add_row(*(row[i] for i in shown))
    return table


def _needed(console: Console, headers: Sequence[str], whole: Sequence[bool],
            rows: Sequence[Sequence[RenderableType]]) -> int:
    """Columns kept whole at their widest cell, text columns at their longest word, with padding and borders."""
    options = console.options.update_width(UNBOUNDED)
    total = len(headers) + 1
    for j, header in enumerate(headers):
        widths = [Measurement.get(console, options, cell) for cell in [header, *(r[j] for r in rows)]]
        total += CELL_PADDING + max(w.maximum if whole[j] else w.minimum for w in widths)
    return total
