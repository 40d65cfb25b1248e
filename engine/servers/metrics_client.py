"""Reading an SGLang server's /metrics gauges (its capacity: engine/servers/capacity.py)."""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# Gauges summed over the server's DP ranks (each reports its own share).
SUMMED_GAUGES = {
    "sglang:num_running_reqs": "running_reqs",
    "sglang:num_queue_reqs": "queued_reqs",
    "sglang:gen_throughput": "gen_throughput",
    # requests retracted since the server started (0.5.10+; 0.5.23 observability/metrics_collector.py:557-562, a
    # Counter prometheus_client exports with the _total suffix); absent from 0.5.5, which has only the gauge
    # sglang:num_retracted_reqs of the last logging interval: N/A then, never 0
    "sglang:num_retracted_requests_total": "retracted",
}
MAX_GAUGES = {"sglang:token_usage": "token_usage"}
# the lines of those gauges' families (HELP, TYPE, samples): a server exports ~10x more lines (histogram buckets)
# than these, and the parser costs per line
_WANTED_LINES = re.compile(r"^(?:# (?:HELP|TYPE) )?(?:%s)[ {].*$" % "|".join(
    re.escape(name) for name in (*SUMMED_GAUGES, *MAX_GAUGES)), re.MULTILINE)

# SGLang's scheduler labels (0.5.23 observability/scheduler_metrics_mixin.py init_metrics): model_name,
# engine_type, tp_rank, pp_rank, moe_ep_rank, dp_rank (only when DP > 1), and `priority` on each gauge with
# --enable-priority-scheduling (contract 7.5: the total under priority="", plus one series per priority).
PRIORITY = "priority"
DP_RANK = "dp_rank"
RANKS = ("tp_rank", "pp_rank", "moe_ep_rank")  # several report the same DP rank's figures


@dataclass
class ServerMetrics:
    running_reqs: float | None = None
    queued_reqs: float | None = None
    gen_throughput: float | None = None
    token_usage: float | None = None
    retracted: float | None = None  # the server's retraction counter (since its launch); None: not exported


def parse_metrics(text: str) -> ServerMetrics:
    """Parse Prometheus text exposition; sglang: gauges and the retraction counter become ServerMetrics (None: absent).

    Each gauge counts once per DP rank: the total series when it is split by priority, one TP rank's series
    (the lowest, tp_rank 0) when every rank exports (--enable-metrics-for-all-schedulers), never their sum."""
    series: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families("\n".join(_WANTED_LINES.findall(text)) + "\n"):
        for sample in family.samples:
            if sample.name in SUMMED_GAUGES or sample.name in MAX_GAUGES:
                series.setdefault(sample.name, []).append((sample.labels, float(sample.value)))
    values: dict[str, float] = {}
    for name, samples in series.items():
        per_dp = per_dp_rank(samples)
        if name in SUMMED_GAUGES:
            values[SUMMED_GAUGES[name]] = sum(per_dp)
        else:
            values[MAX_GAUGES[name]] = max(per_dp)
    return ServerMetrics(**values)


def per_dp_rank(samples: Iterable[tuple[dict[str, str], float]]) -> list[float]:
    """One value per DP rank from one gauge's series: the priority total, from the lowest reporting rank."""
    samples = list(samples)
    totals = [(labels, v) for labels, v in samples if not labels.get(PRIORITY)]
    if totals:  # without a total series (not seen in any version) the per-priority ones add up to it
        samples = totals
    chosen: dict[tuple[str, str], tuple[tuple[int, ...], float]] = {}
    for labels, value in samples:
        order = tuple(_rank(labels.get(r)) for r in RANKS)
        key = (labels.get(DP_RANK, ""), labels.get(PRIORITY, ""))
        if key not in chosen or order < chosen[key][0]:
            chosen[key] = (order, value)
    return [value for _, value in chosen.values()]


def _rank(text: str | None) -> int:
    try:
        return int(text) if text is not None else 0
    except ValueError:
        return 0
