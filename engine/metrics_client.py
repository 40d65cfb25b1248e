"""Reading an SGLang server's /metrics gauges (its capacity: engine/capacity.py)."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# Gauges summed over the server's scheduler ranks (DP ranks each report their own share).
SUMMED_GAUGES = {
    "sglang:num_running_reqs": "running_reqs",
    "sglang:num_queue_reqs": "queued_reqs",
    "sglang:gen_throughput": "gen_throughput",
}
MAX_GAUGES = {"sglang:token_usage": "token_usage"}


@dataclass
class ServerMetrics:
    running_reqs: float | None = None
    queued_reqs: float | None = None
    gen_throughput: float | None = None
    token_usage: float | None = None


def parse_metrics(text: str) -> ServerMetrics:
    """Parse Prometheus text exposition; sglang: gauges become ServerMetrics (None when absent)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name in SUMMED_GAUGES:
                key = SUMMED_GAUGES[name]
                values[key] = values.get(key, 0.0) + float(sample.value)
            elif name in MAX_GAUGES:
                key = MAX_GAUGES[name]
                values[key] = max(values.get(key, 0.0), float(sample.value))
    return ServerMetrics(**values)
