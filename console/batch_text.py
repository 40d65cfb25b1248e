"""How a worker's running batch size reads on screen (`regen status` and the TUI workers table)."""
from __future__ import annotations


def batch_text(size: int | None, source: str, discovered: int | None = None, discovered_source: str = "") -> str:
    """`256 (log)`; once the server's queue corrected it, what discovery said too: `288 (feedback; log: 256)`;
    `-` until it is known (the worker is not ready yet, or an engine from before these fields)."""
    if size is None:
        return "-"
    text = f"{size} ({source})" if source else str(size)
    if source == "feedback" and discovered is not None:
        text = f"{size} (feedback; {discovered_source or 'reported'}: {discovered})"
    return text
