"""A worker's --schedule-conservativeness and retractions as `regen status` and the TUI print them."""
from __future__ import annotations

import time

from engine.api.tuning import TuningChoice, TuningSource


def conservativeness_text(value: float | None, source: str) -> str:
    """`0.3 (pilot)`: the value its server runs with and where it came from (engine.api.tuning.TuningSource); N/A
    where it is not known here (a server another host's agent launched, or an engine from before these fields)."""
    if value is None:
        return "N/A"
    return f"{value:g} ({source})" if source else f"{value:g}"


def retracted_text(retracted: float | None) -> str:
    """Requests its server retracted since its launch; N/A when the server exports no counter (SGLang < 0.5.10)."""
    return "N/A" if retracted is None else f"{retracted:.0f}"


def plan_lines(t: TuningChoice, run_dir: str, now: float | None = None) -> list[str]:
    """`regen plan`'s words for the servers' --schedule-conservativeness: the value, its source, why (the rule's
    reason), each server's measured figures with their source and age, the clip env, and what `regen start` does."""
    now = time.time() if now is None else now
    value = "the operator's value" if t.value is None else f"{t.value:g}"
    head = f"schedule conservativeness: {value} ({t.source}"
    if t.source == TuningSource.PILOT:
        head += f", {t.verdict}; within [{t.low:g}, {t.high:g}]"
    lines = [head + ")", f"  why: {t.reason}"]
    lines += [f"  measured on {e.text(now)}" for e in t.evidence]
    if t.clip is not None:
        lines.append(f"  SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION={t.clip}: {t.clip_reason}")
    elif t.clip_reason:
        lines.append(f"  SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION not set: {t.clip_reason}")
    if t.mixed_chunk:
        lines.append(f"  --enable-mixed-chunk: {t.mixed_reason}")
    elif t.mixed_reason:
        lines.append(f"  --enable-mixed-chunk not added: {t.mixed_reason}")
    if t.source == TuningSource.PILOT:
        lines.append(f"  recorded in {run_dir}/tuning.json: `regen start` launches the servers with it; a server "
                     "that retracts more than once a minute gets a higher value at its restart")
    elif t.source == TuningSource.SGLANG_DEFAULT:
        lines.append("  --pilot N measures the servers' token usage, queue and retractions and chooses one")
    return lines
