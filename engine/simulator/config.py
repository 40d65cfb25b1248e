"""Simulator configuration: SGLang's launch flags plus the --sim-* knobs, parsed into SimConfig.

Unknown flags are accepted (a real SGLang launch line may carry many we do not model) and
reported as ignored at startup; an unknown `--sim-*` flag is a typo of ours and is an error.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.simulator.dist import parse_dist_addr
from engine.simulator.profiles import DEFAULT_VERSION, PROFILES, Profile, profile_for


@dataclass
class SimConfig:
    # --- SGLang launch flags (same names and defaults as sglang.srt.server_args.ServerArgs) ---
    model_path: str
    tokenizer_path: str | None = None  # -> model_path
    host: str = "127.0.0.1"
    port: int = 30000  # 0: pick a free port (printed in the "Uvicorn running on" line)
    tp_size: int = 1
    dp_size: int = 1
    base_gpu_id: int = 0
    # one server across nodes: every node runs this launch line with its own --node-rank; tp_size is the total over
    # the nodes (tp_size / nnodes GPUs on each); rank 0 serves HTTP once every rank joined at dist_init_addr
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: int | None = None  # seconds the rendezvous may take; None: torch's 600
    enable_metrics: bool = False
    max_running_requests: int | None = None  # None: derived from the KV pool (batch_limits), reported as null
    max_total_tokens: int | None = None  # KV pool size; None -> derived from GPU memory and config.json
    context_length: int | None = None  # -> config.json max_position_embeddings
    api_key: str | None = None
    served_model_name: str | None = None  # -> model_path
    reasoning_parser: str | None = None
    decode_log_interval: int = 40
    mem_fraction_static: float | None = None  # -> 0.88
    chunked_prefill_size: int | None = None  # -> 8192
    random_seed: int | None = None
    skip_server_warmup: bool = False
    log_level: str = "info"
    log_level_http: str | None = None  # -> log_level
    allow_auto_truncate: bool = False
    enable_deterministic_inference: bool = False  # sampling_seed is honoured only with it (contract 7.3)
    # streamed text and output_ids as deltas (--incremental-streaming-output, 0.5.10+; --stream-output in every
    # version: 0.5.5's own flag, 0.5.10's deprecated alias)
    incremental_streaming_output: bool = False
    incremental_streaming_flag: bool = field(default=False, repr=False)  # which spelling: checked per version
    enable_priority_scheduling: bool = False
    enable_metrics_for_all_schedulers: bool = False  # every TP rank exports its gauges (tp_rank label)
    page_size: int = 1  # KV pages: the radix cache matches whole pages (engine/simulator/prefix_cache.py)
    disable_radix_cache: bool = False  # no prefix reuse: cached_tokens is always 0
    # scales the new-token ratio admission starts from: min(0.7 x c, 1) (0.5.23 new_token_ratio_tracker.py:20-32)
    schedule_conservativeness: float = 1.0
    # mix each prefill batch with the running batch, which decodes in the same step; only with chunked prefill on
    # (0.5.23 arg_groups/fields/schedule.py:208-211, scheduler.py:1376-1378; 0.5.5 server_args.py:3246)
    enable_mixed_chunk: bool = False
    ignored_args: tuple[str, ...] = ()  # SGLang flags accepted but not modelled (logged at startup)

    # --- simulator knobs ---
    sim_step_ms: float = 15.0  # decode step time with one running request
    sim_step_ms_per_req: float = 0.2  # extra step time per running request
    sim_tokens_per_step: int = 1  # tokens each running request gains per step
    sim_prefill_ms_per_1k: float = 2.0  # extra step time per 1000 uncached prompt tokens admitted
    sim_output_mean: float = 1024.0  # mean of the lognormal output length (tokens)
    sim_output_sigma: float = 1.0  # sigma of the underlying normal (long tail)
    sim_empty_share: float = 0.0  # share answering exactly "<think>\n\n</think>\n\nOK.<|im_end|>"
    sim_load_s: float = 0.0  # port open, /health 503, /get_model_info 200 (warmup window)
    sim_slow_start_s: float = 0.0  # extra "weight loading" time before the port is bound
    sim_crash_after: int | None = None  # exit 1 with a scheduler traceback after N finished requests
    sim_oom_after: int | None = None  # exit 1 with a CUDA OOM traceback after N finished requests
    sim_hang_after: int | None = None  # stop answering (port stays open) after N finished requests
    sim_5xx_rate: float = 0.0  # share of /generate attempts answered HTTP 503
    sim_drop_first: int = 0  # the first N /generate requests have their connection closed unanswered (a flooded server)
    sim_abort_rate: float = 0.0  # share of requests finishing with finish_reason abort
    # share of answers that fall into a token cycle repeated until max_new_tokens (a looping thinking model)
    sim_loop_share: float = 0.0
    # share of long answers with legitimately repeated structure (lists, tables, code, multiplication tables)
    sim_repetitive_share: float = 0.0
    sim_instant: bool = False  # no batching delay; prebuilt outputs (client ingest ceiling)
    sim_seed: int = 0
    sim_gpu_mem_gb: float = 139.8  # simulated GPU memory (H200) for the startup lines and KV pool
    sim_instant_pool: int = 256  # prebuilt outputs per kind for --sim-instant
    sim_drain_timeout_s: float = 600.0  # SIGTERM: how long to wait for in-flight requests
    sim_sglang_version: str = DEFAULT_VERSION  # which real version's observable behaviour (profiles.py)
    # the scheduler's request slots (SGLang's max_num_reqs, the req_to_token_pool size; on hybrid models the
    # mamba cache bounds it too): None derives it as SGLang does, min(max(pool / context_len * 512, 2048), 4096)
    sim_max_num_reqs: int | None = None

    # --- process mode (set by main(); in-process servers never os._exit) ---
    exit_process_on_fault: bool = field(default=False, repr=False)

    @property
    def tokenizer(self) -> str:
        return self.tokenizer_path or self.model_path

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def tp_per_node(self) -> int:
        return max(1, self.tp_size // max(1, self.nnodes))

    @property
    def profile(self) -> Profile:
        return profile_for(self.sim_sglang_version)

    def profile_or_none(self) -> Profile | None:
        return PROFILES.get(self.sim_sglang_version)

    def validate(self) -> None:
        """Raise ValueError naming the flag when a value cannot work."""
        profile = self.profile_or_none()
        checks = [
            (self.sim_step_ms >= 0, f"--sim-step-ms {self.sim_step_ms}: must be >= 0"),
            (self.sim_step_ms_per_req >= 0, f"--sim-step-ms-per-req {self.sim_step_ms_per_req}: must be >= 0"),
            (self.sim_tokens_per_step >= 1, f"--sim-tokens-per-step {self.sim_tokens_per_step}: must be >= 1"),
            (self.sim_output_mean >= 1, f"--sim-output-mean {self.sim_output_mean}: must be >= 1"),
            (self.sim_output_sigma >= 0, f"--sim-output-sigma {self.sim_output_sigma}: must be >= 0"),
            (self.max_running_requests is None or self.max_running_requests >= 1,
             f"--max-running-requests {self.max_running_requests}: must be >= 1"),
            (self.sim_max_num_reqs is None or self.sim_max_num_reqs >= 1,
             f"--sim-max-num-reqs {self.sim_max_num_reqs}: must be >= 1"),
            (self.sim_sglang_version in PROFILES,
             f"--sim-sglang-version {self.sim_sglang_version}: not a simulated SGLang version; known: "
             + ", ".join(PROFILES)),
            (not self.incremental_streaming_flag or profile is None or profile.has_incremental_streaming_flag,
             f"--incremental-streaming-output: not a flag of SGLang {self.sim_sglang_version} (added in 0.5.10); "
             "that version's --stream-output streams deltas"),
            (self.tp_size >= 1, f"--tp-size {self.tp_size}: must be >= 1"),
            (self.nnodes >= 1, f"--nnodes {self.nnodes}: must be >= 1"),
            (0 <= self.node_rank < self.nnodes,
             f"--node-rank {self.node_rank}: must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes})"),
            (self.nnodes == 1 or self.dist_init_addr is not None,
             f"--nnodes {self.nnodes}: please provide --dist-init-addr as host:port of head node"),
            (self.nnodes < 1 or self.tp_size % self.nnodes == 0,
             f"--tp-size {self.tp_size} --nnodes {self.nnodes}: the TP size is the total over every node and must be "
             f"a multiple of --nnodes (each node runs tp_size / nnodes GPUs)"),
            (self.page_size >= 1, f"--page-size {self.page_size}: must be >= 1"),
            # SGLang's own check (0.5.23 arg_groups/validation_hook.py:314-315; 0.5.5 server_args.py:3858)
            (self.schedule_conservativeness >= 0, "schedule_conservativeness must be non-negative"),
            (self.decode_log_interval >= 1, f"--decode-log-interval {self.decode_log_interval}: must be >= 1"),
            (self.sim_instant_pool >= 1, f"--sim-instant-pool {self.sim_instant_pool}: must be >= 1"),
            (0 <= self.port <= 65535, f"--port {self.port}: must be in 0..65535"),
        ]
        checks.append((self.sim_loop_share + self.sim_repetitive_share <= 1.0,
                       f"--sim-loop-share {self.sim_loop_share} + --sim-repetitive-share {self.sim_repetitive_share}: "
                       "the two shares are of the same requests and must add up to at most 1"))
        for name in ("sim_empty_share", "sim_5xx_rate", "sim_abort_rate", "sim_loop_share", "sim_repetitive_share"):
            value = getattr(self, name)
            checks.append((0.0 <= value <= 1.0, f"--{name.replace('_', '-')} {value}: must be in [0, 1]"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.dist_init_addr is not None:
            parse_dist_addr(self.dist_init_addr)
        if not Path(self.tokenizer).is_dir():
            raise ValueError(
                f"--model-path/--tokenizer-path {self.tokenizer}: not a directory (the simulator loads the real "
                "tokenizer from a local model folder; nothing is downloaded)"
            )

    def server_args_dict(self) -> dict:
        """ServerArgs-like view for /get_server_info and the startup line; the API key is never shown."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.repr}
        d["tokenizer_path"] = self.tokenizer
        d["served_model_name"] = self.model_name
        d["max_running_requests"] = self.max_running_requests  # null unless passed, as in SGLang (contract 7.1)
        d["api_key"] = "<redacted>" if self.api_key else None
        d["ignored_args"] = list(self.ignored_args)
        return d


# SGLang flags that take a value and flags that are switches; anything else is accepted and ignored.
_VALUE_FLAGS: dict[str, tuple[str, type]] = {
    "--tokenizer-path": ("tokenizer_path", str),
    "--host": ("host", str),
    "--port": ("port", int),
    "--base-gpu-id": ("base_gpu_id", int),
    "--nnodes": ("nnodes", int),
    "--node-rank": ("node_rank", int),
    "--dist-timeout": ("dist_timeout", int),
    "--max-running-requests": ("max_running_requests", int),
    "--max-total-tokens": ("max_total_tokens", int),
    "--context-length": ("context_length", int),
    "--api-key": ("api_key", str),
    "--served-model-name": ("served_model_name", str),
    "--reasoning-parser": ("reasoning_parser", str),
    "--decode-log-interval": ("decode_log_interval", int),
    "--mem-fraction-static": ("mem_fraction_static", float),
    "--chunked-prefill-size": ("chunked_prefill_size", int),
    "--page-size": ("page_size", int),
    "--schedule-conservativeness": ("schedule_conservativeness", float),
    "--random-seed": ("random_seed", int),
    "--log-level": ("log_level", str),
    "--log-level-http": ("log_level_http", str),
    "--sim-step-ms": ("sim_step_ms", float),
    "--sim-step-ms-per-req": ("sim_step_ms_per_req", float),
    "--sim-tokens-per-step": ("sim_tokens_per_step", int),
    "--sim-prefill-ms-per-1k": ("sim_prefill_ms_per_1k", float),
    "--sim-output-mean": ("sim_output_mean", float),
    "--sim-output-sigma": ("sim_output_sigma", float),
    "--sim-empty-share": ("sim_empty_share", float),
    "--sim-load-s": ("sim_load_s", float),
    "--sim-slow-start-s": ("sim_slow_start_s", float),
    "--sim-crash-after": ("sim_crash_after", int),
    "--sim-oom-after": ("sim_oom_after", int),
    "--sim-hang-after": ("sim_hang_after", int),
    "--sim-5xx-rate": ("sim_5xx_rate", float),
    "--sim-drop-first": ("sim_drop_first", int),
    "--sim-abort-rate": ("sim_abort_rate", float),
    "--sim-loop-share": ("sim_loop_share", float),
    "--sim-repetitive-share": ("sim_repetitive_share", float),
    "--sim-seed": ("sim_seed", int),
    "--sim-gpu-mem-gb": ("sim_gpu_mem_gb", float),
    "--sim-instant-pool": ("sim_instant_pool", int),
    "--sim-drain-timeout-s": ("sim_drain_timeout_s", float),
    "--sim-sglang-version": ("sim_sglang_version", str),
    "--sim-max-num-reqs": ("sim_max_num_reqs", int),
}
_SWITCH_FLAGS = {
    "--enable-metrics": "enable_metrics",
    "--skip-server-warmup": "skip_server_warmup",
    "--allow-auto-truncate": "allow_auto_truncate",
    "--enable-deterministic-inference": "enable_deterministic_inference",
    "--stream-output": "incremental_streaming_output",
    "--enable-priority-scheduling": "enable_priority_scheduling",
    "--enable-metrics-for-all-schedulers": "enable_metrics_for_all_schedulers",
    "--disable-radix-cache": "disable_radix_cache",
    "--enable-mixed-chunk": "enable_mixed_chunk",
    "--sim-instant": "sim_instant",
}


_SWITCH_HELP = {
    "--enable-deterministic-inference": "honour sampling_params.sampling_seed (ignored otherwise, as in SGLang)",
    "--stream-output": "streamed text and output_ids are deltas (0.5.10+: deprecated alias of "
                       "--incremental-streaming-output)",
    "--enable-priority-scheduling": "0.5.23: every scheduler gauge also per request priority (total: priority=\"\")",
    "--enable-metrics-for-all-schedulers": "every TP rank exports its gauges (tp_rank label)",
    "--enable-mixed-chunk": "Enabling mixing prefill and decode in a batch when using chunked prefill.",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine.simulator",
        description="SGLang server simulator: SGLang's HTTP protocol, log lines and continuous batching, no GPU. "
        "Throughput with B running requests: B * tokens_per_step / ((step_ms + step_ms_per_req * B) / 1000) "
        "tokens/s.",
        allow_abbrev=True,  # SGLang relies on it: --tp is --tp-size by unique prefix
    )
    parser.add_argument("--model-path", "--model", dest="model_path", required=True)
    parser.add_argument("--tensor-parallel-size", "--tp-size", dest="tp_size", type=int, default=1)
    parser.add_argument("--data-parallel-size", "--dp-size", dest="dp_size", type=int, default=1)
    parser.add_argument("--dist-init-addr", "--nccl-init-addr", dest="dist_init_addr", default=None,
                        help="rank 0's rendezvous address, HOST:PORT, the same on every node")
    defaults = {f.name: f.default for f in dataclasses.fields(SimConfig)}
    for flag, (dest, typ) in _VALUE_FLAGS.items():
        parser.add_argument(flag, dest=dest, type=typ, default=defaults[dest])
    for flag, dest in _SWITCH_FLAGS.items():
        parser.add_argument(flag, dest=dest, action="store_true", help=_SWITCH_HELP.get(flag))
    parser.add_argument("--incremental-streaming-output", dest="incremental_streaming_flag", action="store_true",
                        help="streamed text and output_ids are deltas (SGLang 0.5.10+; 0.5.5: --stream-output)")
    return parser


def parse_args(argv: list[str]) -> SimConfig:
    """Parse a launch command line; unknown SGLang flags end up in SimConfig.ignored_args."""
    parser = build_parser()
    known, unknown = parser.parse_known_args(argv)
    typos = [a for a in unknown if a.startswith("--sim-")]
    if typos:
        parser.error(f"unknown simulator flag(s): {' '.join(typos)}; known: "
                     + ", ".join(sorted(f for f in list(_VALUE_FLAGS) + list(_SWITCH_FLAGS) if f.startswith("--sim-"))))
    values = vars(known)
    values["incremental_streaming_output"] |= values["incremental_streaming_flag"]
    cfg = SimConfig(**values, ignored_args=tuple(unknown))
    try:
        cfg.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return cfg


def read_model_config(model_dir: str) -> dict:
    """config.json of the model folder ({} when absent: the simulator then uses Qwen3-27B-like sizes)."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
