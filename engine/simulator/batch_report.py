"""What the simulated scheduler says about its batches: SGLang's prefill / decode / retract log lines and gauges."""
from __future__ import annotations

import time
from collections.abc import Iterable

from engine.simulator.metrics import SimMetrics
from engine.simulator.profiles import Profile
from engine.simulator.request import SimRequest
from engine.simulator.simlog import SimLog

CUDA_GRAPH_MAX_BS = 256


class BatchReporter:
    """Logs each batch as SGLang's scheduler does and keeps its gauges; owns the gen-throughput interval."""

    def __init__(self, log: SimLog, metrics: SimMetrics | None, profile: Profile):
        self.log = log
        self.metrics = metrics
        self.profile = profile
        self.last_gen_throughput = 0.0
        self.interval_tokens = 0
        self.interval_t0 = time.monotonic()

    def restart_interval(self) -> None:
        self.interval_t0 = time.monotonic()
        self.interval_tokens = 0

    def by_priority(self, running: Iterable[SimRequest], waiting: Iterable[SimRequest]
                    ) -> dict[str, tuple[int, int]] | None:
        """(running, queued) per request priority, when the metrics export per-priority series."""
        if self.metrics is None or not self.metrics.priority:
            return None
        split: dict[str, list[int]] = {}
        for req in running:
            split.setdefault(str(req.priority or 0), [0, 0])[0] += 1
        for req in waiting:
            split.setdefault(str(req.priority or 0), [0, 0])[1] += 1
        return {p: (r, q) for p, (r, q) in split.items()}

    def prefill(self, *, new_seq: int, new_tokens: int, cached: int, usage: float, used_tokens: int,
                running_before: int, queued: int, by_priority: dict[str, tuple[int, int]] | None) -> None:
        self.log.sched(f"Prefill batch, #new-seq: {new_seq}, #new-token: {new_tokens}, #cached-token: {cached}, "
                       f"token usage: {usage:.2f}, #running-req: {running_before}, #queue-req: {queued},")
        if self.metrics is not None:
            total = new_tokens + cached
            self.metrics.set_scheduler_gauges(
                running=running_before, queued=queued, used_tokens=used_tokens, token_usage=usage,
                cache_hit_rate=(cached / total if total else 0.0), by_priority=by_priority)

    def decode(self, *, running: int, queued: int, used_tokens: int, usage: float,
               by_priority: dict[str, tuple[int, int]] | None) -> None:
        now = time.monotonic()
        elapsed = now - self.interval_t0
        self.last_gen_throughput = self.interval_tokens / elapsed if elapsed > 0 else 0.0
        self.restart_interval()
        cuda_graph = running <= CUDA_GRAPH_MAX_BS
        self.log.sched(f"Decode batch, #running-req: {running}, #token: {used_tokens}, "
                       f"token usage: {usage:.2f}, cuda graph: {cuda_graph}, "
                       f"gen throughput (token/s): {self.last_gen_throughput:.2f}, #queue-req: {queued},")
        if self.metrics is not None:
            self.metrics.set_scheduler_gauges(
                running=running, queued=queued, used_tokens=used_tokens, token_usage=usage,
                gen_throughput=self.last_gen_throughput, cache_hit_rate=0.0, cuda_graph=cuda_graph,
                by_priority=by_priority)

    def retracted(self, reqs: list[SimRequest], *, tokens_gained: int, old_ratio: float, new_ratio: float) -> None:
        """SGLang's retraction line (0.5.23 scheduler.py:4524-4536; 0.5.5 :1958-1962) and its metrics."""
        gained = f", #new_tokens_gained: {tokens_gained}" if self.profile.retract_log_tokens_gained else ""
        self.log.sched(f"KV cache pool is full. Retract requests. #retracted_reqs: {len(reqs)}{gained}, "
                       f"#new_token_ratio: {old_ratio:.4f} -> {new_ratio:.4f}")
        if self.metrics is not None:
            self.metrics.set_retracted(len(reqs))
            if self.profile.retraction_counters:
                self.metrics.count_retracted(requests=len(reqs), input_tokens=sum(r.prompt_len for r in reqs),
                                             output_tokens=sum(r.resume_tokens for r in reqs))

    def idle(self, queued: int, by_priority: dict[str, tuple[int, int]] | None) -> None:
        self.last_gen_throughput = 0.0
        if self.metrics is not None:
            self.metrics.set_scheduler_gauges(running=0, queued=queued, used_tokens=0, token_usage=0.0,
                                              gen_throughput=0.0, by_priority=by_priority)
