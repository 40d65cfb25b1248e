"""How big one simulated server is: its KV pool, request slots and running batch, as SGLang sizes them."""
from __future__ import annotations

from dataclasses import dataclass

from engine.simulator.config import SimConfig

BYTES_PER_GB = 1 << 30


def default_max_num_reqs(max_total_tokens: int, context_len: int) -> int:
    """SGLang's request slots when nothing sets them (0.5.5 model_runner.py:1592-1601)."""
    return min(max(int(max_total_tokens / context_len * 512), 2048), 4096)


def running_per_dp(cfg: SimConfig, max_total_tokens: int, context_len: int) -> int:
    """The batch one DP rank's scheduler runs (0.5.5 tp_worker.py:281-289): --max-running-requests split
    over the DP ranks, else half the KV pool; never more than the request slots."""
    slots = cfg.sim_max_num_reqs
    if cfg.max_running_requests is not None:
        wanted = max(1, cfg.max_running_requests // max(1, cfg.dp_size))
        return min(wanted, slots) if slots else wanted
    return max(1, min(max_total_tokens // 2, slots or default_max_num_reqs(max_total_tokens, context_len)))


@dataclass(frozen=True)
class MemoryModel:
    """Plausible memory figures for the startup lines, from config.json (a Qwen3-27B-like default)."""
    weight_gb: float
    kv_bytes_per_token: int
    total_gb: float
    mem_fraction: float

    @classmethod
    def from_config(cls, model_cfg: dict, cfg: SimConfig) -> "MemoryModel":
        h = model_cfg.get("hidden_size", 5120)
        layers = model_cfg.get("num_hidden_layers", 64)
        heads = model_cfg.get("num_attention_heads", 40)
        kv_heads = model_cfg.get("num_key_value_heads", 8)
        head_dim = model_cfg.get("head_dim", h // max(1, heads))
        inter = model_cfg.get("intermediate_size", 25600)
        vocab = model_cfg.get("vocab_size", 151936)
        per_layer = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2 + 3 * h * inter
        params = layers * per_layer + 2 * vocab * h
        tp = max(1, cfg.tp_size)
        kv = layers * kv_heads * head_dim * 2 * 2 // tp  # K and V, bf16
        return cls(params * 2 / BYTES_PER_GB / tp, max(1, kv), cfg.sim_gpu_mem_gb, cfg.mem_fraction_static or 0.88)

    @property
    def free_gb(self) -> float:
        """What the static fraction leaves for the KV pool once the weights are loaded."""
        return self.total_gb * self.mem_fraction - self.weight_gb

    def kv_tokens(self) -> int:
        return max(4096, int(self.free_gb * BYTES_PER_GB / self.kv_bytes_per_token))
