"""A worker's prefix-cache hit share as `regen status` and the TUI print it: prompt tokens its cache served."""
from __future__ import annotations


def cache_text(prompt_tokens: int | None, cached_tokens: int | None) -> str:
    """"83% of 1.2M": cached / prompt tokens of its committed samples (this start); "-" before any; "N/A" for a
    server that is no dispatch target (behind the router: the router's row has the figures)."""
    if prompt_tokens is None or cached_tokens is None:
        return "N/A"
    if prompt_tokens <= 0:
        return "-"
    return f"{cached_tokens / prompt_tokens:.0%} of {_tokens(prompt_tokens)}"


def _tokens(n: int) -> str:
    if n >= 1_000_000_000:
        return f"{n / 1e9:.1f}G"
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M"
    if n >= 1000:
        return f"{n / 1e3:.1f}k"
    return str(n)
