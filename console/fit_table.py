"""A rich Table that fits a width by dropping text columns: numbers, states and ids are never cut."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table


@dataclass(frozen=True)
class Col:
    header: str
    drop: int = 0  # 0: kept whole (no_wrap, never dropped); n > 0: dropped n-th-last when the width is short


def fitted_table(console: Console, cols: Sequence[Col], rows: Sequence[Sequence[RenderableType]], *,
                 title: str = "") -> Table:
    """The table at the console's width: text columns wrap, then the highest `drop` goes first (its header named
    in the title) until what remains fits; kept columns are never truncated."""
    shown = list(range(len(cols)))
    dropped: list[str] = []
    while True:
        table = _table([cols[i] for i in shown], [[r[i] for i in shown] for r in rows], title, dropped)
        if Measurement.get(console, console.options, table).minimum <= console.width:
            return table
        droppable = [i for i in shown if cols[i].drop > 0]
        if not droppable:
            return table
        victim = max(droppable, key=lambda i: cols[i].drop)
        shown.remove(victim)
        dropped.append(cols[victim].header)


def _table(cols: Sequence[Col], rows: Sequence[Sequence[RenderableType]], title: str, dropped: list[str]) -> Table:
    note = f" ({', '.join(dropped)} not shown: too narrow; --wide shows every column)" if dropped else ""
    table = Table(title=title + note, expand=False)
    for c in cols:
        table.add_column(c.header, no_wrap=c.drop == 0, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table
