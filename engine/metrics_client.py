"""Reading an SGLang server's own numbers: /get_server_info capacity and /metrics gauges."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# Gauges summed over the server's scheduler ranks (DP ranks each report their own share).
SUMMED_GAUGES = {
    "sglang:num_running_reqs": "running_reqs",
    "sglang:num_queue_reqs": "queued_reqs",
    "sglang:gen_throughput": "gen_throughput",
}
MAX_GAUGES = {"sglang:token_usage": "token_usage"}


@dataclass
class ServerCapacity:
    max_running_requests: int | None = None
    max_total_num_tokens: int | None = None
    context_length: int | None = None


@dataclass
class ServerMetrics:
    running_reqs: float | None = None
    queued_reqs: float | None = None
    gen_throughput: float | None = None
    token_usage: float | None = None


def _first_int(sources: list[dict[str, Any]], *keys: str) -> int | None:
    for src in sources:
        for key in keys:
            value = src.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                return int(value)
    return None


def parse_server_info(info: dict[str, Any]) -> ServerCapacity:
    """Capacity from /get_server_info: computed values live in internal_states[0] (server args
    there are the resolved ones); the top level holds the launch args and scheduler_info."""
    sources: list[dict[str, Any]] = []
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        sources.append(states[0])
    sources.append(info)
    return ServerCapacity(
        max_running_requests=_first_int(sources, "max_running_requests"),
        max_total_num_tokens=_first_int(sources, "max_total_num_tokens"),
        context_length=_first_int(sources, "context_length", "context_len", "max_req_input_len"),
    )


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
