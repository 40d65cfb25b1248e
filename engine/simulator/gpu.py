"""The simulator's GPUs as NVML would read them, for a rehearsal's VRAM chart (`GET /sim/gpu`, simulator only).

Like a real SGLang server, the memory is what the process holds, not what its requests use: the CUDA context,
the weights, and from readiness on the whole KV pool (reserved up front) and the CUDA graphs. Utilization is
the share of wall time the scheduler's modelled steps took since the last reading.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

SIM_GPU_NAME = "simulated (sglang-sim)"
CONTEXT_GB = 0.5  # the CUDA context before the weights, as the startup lines say
GRAPH_GB = 0.5  # the captured CUDA graphs


def gpu_indices(visible: str | None, base_gpu_id: int, count: int) -> list[int]:
    """The GPUs the server holds: CUDA_VISIBLE_DEVICES's (regen sets it per worker), else from --base-gpu-id."""
    words = [w.strip() for w in (visible or "").split(",") if w.strip()]
    if words and all(w.isdigit() for w in words):
        return [int(w) for w in words[:count]]
    return list(range(base_gpu_id, base_gpu_id + count))


@dataclass
class SimGpus:
    indices: list[int]
    total_gb: float
    weight_gb: float  # per GPU
    kv_pool_gb: float  # per GPU
    _last: tuple[float, float] | None = None  # (wall time, scheduler busy seconds) at the last reading

    @classmethod
    def of(cls, server) -> "SimGpus":
        cfg = server.cfg
        ranks = cfg.tp_per_node * max(1, cfg.dp_size)  # this node's GPUs
        kv_gb = server.max_total_tokens * server.mem.kv_bytes_per_token / (1 << 30)
        return cls(gpu_indices(os.environ.get("CUDA_VISIBLE_DEVICES"), cfg.base_gpu_id, ranks), server.mem.total_gb,
                   server.mem.weight_gb, kv_gb)

    def readings(self, ready: bool, busy_s: float, now: float | None = None) -> list[dict]:
        """One NVML-like reading per GPU (the fields of engine.api.events.GpuEvent)."""
        now = time.monotonic() if now is None else now
        used_gb = CONTEXT_GB + self.weight_gb + (self.kv_pool_gb + GRAPH_GB if ready else 0.0)
        util = None
        if self._last is not None and now > self._last[0]:
            util = max(0.0, min(100.0, 100.0 * (busy_s - self._last[1]) / (now - self._last[0])))
        self._last = (now, busy_s)
        return [{"index": i, "name": SIM_GPU_NAME, "mem_used_mb": round(min(used_gb, self.total_gb) * 1024, 1),
                 "mem_total_mb": round(self.total_gb * 1024, 1), "util_pct": util} for i in self.indices]
