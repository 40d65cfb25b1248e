"""The rich Console a command prints its report on: the terminal's width, or every column whole (WIDE) when asked
(--wide) or when stdout is not a terminal (piped to a file, less, grep: nothing there to wrap for, and a cut path or
URL cannot be read back). `regen status`, `regen stats`, `regen plan` and `regen export` print through it."""
from __future__ import annotations

from typing import Any

from rich.console import Console

WIDE = 10_000  # lines unwrapped, every column whole


def report_console(wide: bool = False, **kwargs: Any) -> Console:
    """stdout's Console (kwargs: rich Console options, e.g. highlight=False): full width when asked or piped."""
    console = Console(**kwargs)
    if wide or not console.is_terminal:
        console = Console(width=WIDE, **kwargs)
    return console
