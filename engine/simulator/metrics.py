"""SGLang's Prometheus metrics (real names, labels and buckets) on a dedicated CollectorRegistry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
QUEUE_BUCKETS = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400,
                 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class SimMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r = self.registry
        sl = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
        names = list(sl)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r).labels(**sl)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.num_retracted_reqs = gauge("sglang:num_retracted_reqs", "The number of retracted requests.")
        self.num_paused_reqs = gauge("sglang:num_paused_reqs", "The number of paused requests by async weight sync.")
        self.is_cuda_graph = gauge("sglang:is_cuda_graph", "Whether the batch is using CUDA graph.")
        self.max_total_num_tokens = gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.")
        self.context_len = gauge("sglang:context_len", "The context length.")
        self.queue_time = Histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.",
                                    names, buckets=QUEUE_BUCKETS, registry=r).labels(**sl)

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

    def set_scheduler_gauges(self, *, running: int, queued: int, used_tokens: int, token_usage: float,
                             gen_throughput: float | None = None, cache_hit_rate: float | None = None,
                             cuda_graph: bool = True) -> None:
        self.num_running_reqs.set(running)
        self.num_queue_reqs.set(queued)
        self.num_used_tokens.set(used_tokens)
        self.token_usage.set(round(token_usage, 4))
        if gen_throughput is not None:
            self.gen_throughput.set(gen_throughput)
        if cache_hit_rate is not None:
            self.cache_hit_rate.set(cache_hit_rate)
        self.is_cuda_graph.set(1 if cuda_graph else 0)

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
