"""What the probes need to know about a run: a plain dataclass the console fills from the run config.

Probes never import the engine; `console/commands/probe.py` builds a ProbeContext from
`engine.config.load.RunConfig`. Without a config (`regen probe HOST`) only `python` is set and
only the config-free probes run.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
REHEARSAL = "rehearsal: simulated GPUs"  # the summary of every probe a rehearsal does not need
# `-m engine.simulator` in workers.launch (engine.config.load.SIMULATOR_LAUNCH; `regen demo` uses it)
_SIMULATOR_LAUNCH = re.compile(r"(?:^|\s)-m\s*engine\.simulator(?:\s|$)")


# SGLang reads a request's sampling_seed only on a server launched with this flag (contract 7.3;
# engine/config/load.py DETERMINISTIC_FLAG, which refuses a seed without it at config load)
DETERMINISTIC_FLAG = "--enable-deterministic-inference"
# SGLang refuses a prompt of min(context_len - 1, max_total_num_tokens - 1) - 5 tokens or more (contract 7.4; the
# engine's copy, which the run's feed applies: engine/run/prompt_limit.py INPUT_MARGIN); with the context alone
# known, prompts of context - 6 tokens or more are refused
PROMPT_INPUT_MARGIN = 5


def prompt_input_limit(context_length: int) -> int:
    """Prompts of this many tokens or more are refused by a server of this context length (turns rejected)."""
    return context_length - 1 - PROMPT_INPUT_MARGIN


def is_rehearsal(launch: str | None) -> bool:
    """Whether a run config's `workers.launch` starts the SGLang simulator instead of SGLang: a rehearsal,
    which needs no GPU, CUDA, sglang or weights. The one place that decides it (probes, preflight, reports)."""
    return bool(launch and _SIMULATOR_LAUNCH.search(launch))


@dataclass(frozen=True)
class SlurmAsk:
    """What a [slurm] run asks of the cluster, as the slurm.* probes check it from the login node."""
    partition: str
    gpus_per_node: int
    nodes: int  # the fewest nodes the run counts on
    nodes_per_job: int
    time_limit: str  # as written (Slurm's format)
    time_limit_s: int
    handover_s: int
    ready_timeout_s: float  # how long a server may take to load ([workers])
    test_command: str  # the exact `sbatch --test-only ...` of the run's first job
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    time_min_s: int | None = None  # [slurm] time_min: the shortest limit a job may be started with


@dataclass(frozen=True)
class ProbeContext:
    python: str = "python3"  # the host interpreter (run config `host_python`)
    has_config: bool = False
    config_path: str | None = None
    run_dir: str | None = None
    model: str | None = None
    tokenizer: str | None = None  # defaults to model
    prompts: tuple[str, ...] = ()
    prompt_format: str = "auto"
    turns: str = "all"
    enable_thinking: bool = True
    tp_size: int = 1
    gpus: tuple[int, ...] = ()
    base_port: int = 30000
    bind_host: str = "127.0.0.1"
    context_length: int | None = None  # None: the model config's
    max_new_tokens: int | None = None
    # Disk: an explicit projection (bytes) when the caller has one; otherwise disk.run_dir
    # estimates it from the prompt count. The floor is the free space the supervisor alerts at.
    disk_need_bytes: int | None = None
    disk_floor_bytes: int = 20 * 10**9
    shm_need_bytes: int = GIB
    # Resume check: what the config would freeze into the run dir.
    content_hash: str | None = None
    content_fields: dict[str, Any] = field(default_factory=dict)
    # the console asking watches this run dir (the TUI attached to it): a live supervisor there is the run's own
    attached: bool = False
    # prompts.format and prompts.tokens read every row of every prompt file (until scan_budget_s); prompts.tokens
    # renders through the chat template sample_rows rows spread over all of them, each file's first and last
    # end_rows, and the longest_rows longest prompts by characters
    sample_rows: int = 1000
    end_rows: int = 5
    longest_rows: int = 64
    scan_budget_s: float = 120.0
    router_python: str | None = None  # multi-host dispatch host: the python that runs sglang-router
    launch: str = ""  # workers.launch of the run config ("" without a config)
    launch_args: tuple[str, ...] = ()  # workers.extra_args, added to the launch line
    sampling_seed: int | None = None  # sampling.seed of the run config
    # [sampling] keys run.toml leaves out that the host fills from the model's generation_config.json at the start:
    # a stored content field that differs only there is the model's value, not a change the operator made
    sampling_from_model: tuple[str, ...] = ()
    slurm: SlurmAsk | None = None  # [slurm]: what the run asks of the cluster (None: no Slurm)

    @property
    def seed_honoured_by_launch(self) -> bool:
        """Whether the servers are launched with DETERMINISTIC_FLAG (else SGLang ignores the seed)."""
        return DETERMINISTIC_FLAG in self.launch.split() + list(self.launch_args)

    @property
    def rehearsal(self) -> bool:
        return is_rehearsal(self.launch)

    @property
    def tokenizer_path(self) -> str | None:
        return self.tokenizer or self.model

    @property
    def worker_count(self) -> int:
        if not self.gpus or self.tp_size < 1:
            return 0
        return len(self.gpus) // self.tp_size

    @property
    def worker_ports(self) -> list[int]:
        return [self.base_port + i for i in range(self.worker_count)]
