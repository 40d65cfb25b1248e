"""made(): a part of the run (the feed, the ledger, the dispatcher ...) where the supervisor has made it already."""
from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def made(part: T | None, what: str) -> T:
    """The part; only a bug reaches the error (a part used before the supervisor made it)."""
    if part is None:
        raise RuntimeError(f"the supervisor's {what} is used before it was made")
    return part
