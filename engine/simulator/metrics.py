"""SGLang's Prometheus metrics (real names, labels and buckets) on a dedicated CollectorRegistry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
QUEUE_BUCKETS = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400,
                 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000)
CONTENT_TYPE = CONTENT_TYPE_LATEST


# scheduler gauges: attribute -> (name, help text)
_GAUGES = {
    "num_running_reqs": ("sglang:num_running_reqs", "The number of running requests."),
    "num_queue_reqs": ("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
    "num_used_tokens": ("sglang:num_used_tokens", "The number of used tokens."),
    "token_usage": ("sglang:token_usage", "The token usage."),
    "gen_throughput": ("sglang:gen_throughput", "The generation throughput (token/s)."),
    "cache_hit_rate": ("sglang:cache_hit_rate", "The prefix cache hit rate."),
    "num_retracted_reqs": ("sglang:num_retracted_reqs", "The number of retracted requests."),
    "num_paused_reqs": ("sglang:num_paused_reqs", "The number of paused requests by async weight sync."),
    "is_cuda_graph": ("sglang:is_cuda_graph", "Whether the batch is using CUDA graph."),
    "max_total_num_tokens": ("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
    "context_len": ("sglang:context_len", "The context length."),
}
# 0.5.10+ (observability/metrics_collector.py:295-310); prometheus_client adds the _total suffix
_RETRACTION_COUNTERS = (
    ("sglang:num_retracted_requests", "Total number of retracted requests."),
    ("sglang:num_retracted_input_tokens", "Total number of retracted input tokens."),
    ("sglang:num_retracted_output_tokens", "Total number of retracted output tokens."),
)
_ADDITIVE = ("num_used_tokens", "token_usage", "gen_throughput")  # a priority's share of the total


class SimMetrics:
    """`tp_ranks` > 1: every TP rank's scheduler exports its gauges (--enable-metrics-for-all-schedulers);
    `priority`: each gauge is exported under priority="" (the total) and once per priority seen
    (--enable-priority-scheduling, 0.5.23 observability/metrics_collector.py:1413-1430)."""

    def __init__(self, model_name: str, *, tp_ranks: int = 1, priority: bool = False,
                 retraction_counters: bool = False):
        self.registry = CollectorRegistry()
        self.priority = priority
        r = self.registry
        names = ["model_name", "engine_type", "tp_rank", "pp_rank"] + (["priority"] if priority else [])
        self._ranks = [{"model_name": model_name, "engine_type": "unified", "tp_rank": str(t), "pp_rank": "0",
                        **({"priority": ""} if priority else {})} for t in range(max(1, tp_ranks))]
        self._gauges = {key: Gauge(name, doc, names, registry=r) for key, (name, doc) in _GAUGES.items()}
        self._priorities: set[str] = set()
        self._values: dict[str, float] = {}
        for key in _GAUGES:
            self._set(key, 0.0)
        self.queue_time = Histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.",
                                    names, buckets=QUEUE_BUCKETS, registry=r).labels(**self._ranks[0])

        self._retraction_counters = [
            Counter(name, doc, names, registry=r).labels(**self._ranks[0]) for name, doc in _RETRACTION_COUNTERS
        ] if retraction_counters else []
        tl = {"model_name": model_name}

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=r).labels(**tl)

        self.prompt_tokens = counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = counter("sglang:cached_tokens", "Number of cached prompt tokens.")
        self.num_requests = counter("sglang:num_requests", "Number of requests processed.")
        self.num_so_requests = counter("sglang:num_so_requests", "Number of structured output requests processed.")
        self.num_aborted_requests = counter("sglang:num_aborted_requests", "Number of requests aborted.")
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              ["model_name"], buckets=TTFT_BUCKETS, registry=r).labels(**tl)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                             ["model_name"], buckets=E2E_BUCKETS, registry=r).labels(**tl)

    def _set(self, key: str, total: float, parts: dict[str, float] | None = None) -> None:
        self._values[key] = total
        gauge = self._gauges[key]
        for labels in self._ranks:
            gauge.labels(**labels).set(total)
            if self.priority:
                for p in self._priorities:
                    gauge.labels(**dict(labels, priority=p)).set((parts or {}).get(p, 0.0))

    def set_static(self, *, max_total_num_tokens: int, context_len: int) -> None:
        self._set("max_total_num_tokens", max_total_num_tokens)
        self._set("context_len", context_len)

    def set_retracted(self, count: int) -> None:
        """Requests the last retraction sent back to the waiting queue (the pool ran out mid-decode)."""
        self._set("num_retracted_reqs", count)

    def count_retracted(self, *, requests: int, input_tokens: int, output_tokens: int) -> None:
        """A retraction's requests and their prompt / output tokens (0.5.23 metrics_collector.py:1513-1525)."""
        for counter, amount in zip(self._retraction_counters, (requests, input_tokens, output_tokens)):
            counter.inc(amount)

    def set_scheduler_gauges(self, *, running: int, queued: int, used_tokens: int, token_usage: float,
                             gen_throughput: float | None = None, cache_hit_rate: float | None = None,
                             cuda_graph: bool = True, by_priority: dict[str, tuple[int, int]] | None = None) -> None:
        """`by_priority`: (running, queued) per priority; additive gauges are split by running share."""
        if by_priority:
            self._priorities.update(by_priority)
        split = by_priority or {}
        totals: dict[str, float] = {"num_running_reqs": running, "num_queue_reqs": queued, "num_used_tokens": used_tokens,
                  "token_usage": round(token_usage, 4), "is_cuda_graph": 1 if cuda_graph else 0}
        if gen_throughput is not None:
            totals["gen_throughput"] = gen_throughput
        if cache_hit_rate is not None:
            totals["cache_hit_rate"] = cache_hit_rate
        parts: dict[str, float]
        for key, total in totals.items():
            if key == "num_running_reqs":
                parts = {p: rq[0] for p, rq in split.items()}
            elif key == "num_queue_reqs":
                parts = {p: rq[1] for p, rq in split.items()}
            elif key in _ADDITIVE:
                parts = {p: total * rq[0] / running for p, rq in split.items()} if running else {}
            else:
                parts = {p: total for p in split}
            self._set(key, total, parts)
        for key in ("num_retracted_reqs", "num_paused_reqs"):
            self._set(key, self._values.get(key, 0.0), {})

    def observe_finished(self, *, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                         e2e_s: float, ttft_s: float | None, aborted: bool) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.num_requests.inc()
        if aborted:
            self.num_aborted_requests.inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
