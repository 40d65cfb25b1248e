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


def queued_text(queued: float | None, held: int = 0) -> str:
    """The work waiting for a server: in its own queue (SGLang's sglang:num_queue_reqs; N/A unknown), and, when
    regen's queue holds items for it (prefix affinity, not sent: any server may still take them), `3 +40 held`."""
    text = "N/A" if queued is None else f"{queued:.0f}"
    return f"{text} +{held} held" if held else text
