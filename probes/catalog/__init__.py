"""The probe catalog: for each probe, the exact shell command it runs on the host and how its output is judged.

A command depends only on the ProbeContext (the report shows a command the operator can paste on the host);
Python probes run a probes/host script with the host interpreter, which prints JSON; stderr is never dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

from probes.catalog.disk import df_command, disk_judge
from probes.catalog.gpu import (
    NVCC_FALLBACKS,
    judge_nvidia_smi,
    judge_nvml,
    judge_torch,
    nvidia_smi_command,
)
from probes.catalog.host import (
    judge_connection,
    judge_packages,
    judge_python,
    judge_router,
    judge_seed,
    packages_for,
    packages_in_flight,
    router_command,
)
from probes.catalog.launch import judge_ports, judge_resume
from probes.catalog.model import judge_model, judge_weights, model_dir_command
from probes.catalog.output import python_command
from probes.catalog.probe import Probe
from probes.catalog.prompts import (
    judge_prompt_format,
    judge_prompt_paths,
    judge_prompt_tokens,
    prompts_args,
)
from probes.catalog.slurm import (
    judge_slurm_commands,
    judge_slurm_partition,
    judge_slurm_submit,
    judge_slurm_time,
    slurm_commands_command,
    slurm_partition_command,
    slurm_submit_command,
)
from probes.context import ProbeContext


def _catalog() -> list[Probe]:
    py = ("host.python",)
    return [
        Probe("connection", "connection to the host (reachability, host key, auth)", lambda c: "id -un && uname -n && uname -srm",
              judge_connection, timeout_s=15),
        Probe("host.python", "host Python interpreter", lambda c: python_command(c, "pyinfo"), judge_python,
              needs=("connection",), timeout_s=20, script="pyinfo"),
        Probe("packages", "Python packages of the host env",
              lambda c: python_command(c, "packages", {"packages": [list(p) for p in packages_for(c)]}), judge_packages,
              needs=py, timeout_s=180, script="packages", on_timeout=packages_in_flight),
        Probe("sampling.seed", "sampling.seed will be honoured by the servers",
              lambda c: python_command(c, "seed_support"), judge_seed, needs=py, timeout_s=30,
              script="seed_support", config="config", when=lambda c: c.sampling_seed is not None, real_gpus=True),
        Probe("gpu.nvidia_smi", "GPUs (nvidia-smi)", nvidia_smi_command, judge_nvidia_smi, needs=("connection",),
              timeout_s=30, real_gpus=True),
        Probe("gpu.nvml", "GPUs through NVML (pynvml)", lambda c: python_command(c, "nvml"), judge_nvml, needs=py,
              uses=("gpu.nvidia_smi",), timeout_s=30, script="nvml", real_gpus=True),
        Probe("cuda.torch", "torch CUDA build vs the driver; nvcc", lambda c: python_command(c, "torch_cuda", {"nvcc_candidates": list(NVCC_FALLBACKS)}),
              judge_torch, needs=py, uses=("gpu.nvidia_smi", "gpu.nvml"), timeout_s=120, script="torch_cuda",
              real_gpus=True),
        Probe("disk.home", "disk free in $HOME (no run dir configured)", lambda c: df_command("~"), disk_judge("home"),
              needs=("connection",), timeout_s=15, config="no_config"),
        Probe("disk.run_dir", "disk free for the run dir", lambda c: df_command(c.run_dir or "~"), disk_judge("run_dir"),
              needs=("connection",), uses=("prompts.format", "prompts.tokens"), timeout_s=15, config="config"),
        Probe("disk.shm", "shared memory (/dev/shm)", lambda c: df_command("/dev/shm"), disk_judge("shm"),
              needs=("connection",), timeout_s=15),
        Probe("model.dir", "model directory (config, tokenizer, chat template)", model_dir_command, judge_model,
              needs=py, timeout_s=30, script="model_dir", config="config"),
        Probe("model.weights", "model weights and their fit on the GPUs", model_dir_command, judge_weights,
              needs=py, uses=("gpu.nvidia_smi", "gpu.nvml"), timeout_s=30, script="model_dir", config="config",
              real_gpus=True),
        Probe("prompts.paths", "prompt files exist", lambda c: python_command(c, "prompts", prompts_args(c, "paths")),
              judge_prompt_paths, needs=py, timeout_s=60, script="prompts", config="config"),
        Probe("prompts.format", "prompt rows (every row): shape, sources, malformed rows",
              lambda c: python_command(c, "prompts", prompts_args(c, "format")), judge_prompt_format,
              needs=("prompts.paths",), timeout_s=180, script="prompts", config="config"),
        Probe("prompts.tokens", "prompt token lengths through the chat template vs the context (every row read)",
              lambda c: python_command(c, "prompts", prompts_args(c, "tokens")), judge_prompt_tokens,
              needs=("prompts.format", "model.dir"), timeout_s=180, script="prompts", config="config"),
        Probe("ports", "worker ports free", lambda c: python_command(c, "ports", {"host": c.bind_host,
                                                                               "ports": c.worker_ports,
                                                                               "run_dir": c.run_dir}),
              judge_ports, needs=py, timeout_s=20, script="ports", config="config"),
        Probe("router.package", "sglang-router for the multi-host router", router_command, judge_router,
              needs=("connection",), timeout_s=60, config="config", when=lambda c: bool(c.router_python)),
        Probe("slurm.commands", "Slurm's commands on the login node", slurm_commands_command, judge_slurm_commands,
              needs=("connection",), timeout_s=20, config="config", when=lambda c: c.slurm is not None),
        Probe("slurm.partition", "Slurm partition: nodes with the GPUs asked, its time limit",
              slurm_partition_command, judge_slurm_partition, needs=("slurm.commands",), timeout_s=30,
              config="config", when=lambda c: c.slurm is not None),
        Probe("slurm.submit", "Slurm accepts the job (sbatch --test-only: account, qos, gres, time)",
              slurm_submit_command, judge_slurm_submit, needs=("slurm.commands",), timeout_s=30,
              config="config", when=lambda c: c.slurm is not None),
        Probe("slurm.time_limit", "Slurm allocation time limit vs the servers' load time and the plan",
              lambda c: "true", judge_slurm_time, needs=("slurm.commands",), timeout_s=10, config="config",
              when=lambda c: c.slurm is not None),
        Probe("run_dir.resume", "run dir: new or resumable", lambda c: python_command(c, "resume", {"run_dir": c.run_dir}),
              judge_resume, needs=py, timeout_s=20, script="resume", config="config"),
    ]


CATALOG: list[Probe] = _catalog()
PROBE_IDS = [p.id for p in CATALOG]


class UnknownProbe(ValueError):
    pass


def probes_for(ctx: ProbeContext, only: set[str] | None = None, catalog: list[Probe] | None = None) -> list[Probe]:
    """The probes to run for this context: config-free ones without a config; `only` (ids or id prefixes
    such as `gpu`) plus what they need, in catalog order."""
    catalog = CATALOG if catalog is None else catalog
    avail = [p for p in catalog if (p.config == "any" or (p.config == "config") == ctx.has_config)
             and (p.when is None or p.when(ctx))]
    by_id = {p.id: p for p in avail}
    if not only:
        return avail
    chosen: set[str] = set()
    inapplicable: list[str] = []  # its config section asks nothing of it (`when`), e.g. sampling.seed without a seed
    for want in only:
        matches = [p.id for p in avail if p.id == want or p.id.startswith(want + ".")]
        if not matches:
            every = {p.id: p for p in catalog}
            if any((p.id == want or p.id.startswith(want + ".")) and p.when is not None and not p.when(ctx)
                   and (p.config == "any" or (p.config == "config") == ctx.has_config) for p in catalog):
                inapplicable.append(want)
                continue
            if want in every or any(i.startswith(want + ".") for i in every):
                raise UnknownProbe(f"probe {want!r} needs a run config (--config run.toml)")
            raise UnknownProbe(f"unknown probe {want!r}; known: {', '.join(by_id)}")
        chosen.update(matches)
    if not chosen and inapplicable:
        raise UnknownProbe(f"probe(s) {', '.join(inapplicable)}: nothing to check for this run config")
    stack = list(chosen)
    while stack:
        for dep in by_id[stack.pop()].needs:
            if dep not in chosen and dep in by_id:
                chosen.add(dep)
                stack.append(dep)
    return [p for p in avail if p.id in chosen]


@dataclass(frozen=True)
class ProbeCommand:
    id: str
    command: str
    timeout_s: float


def default_probes(ctx: ProbeContext | None = None) -> list[ProbeCommand]:
    """The exact commands the probes would run for `ctx` (default: no config, `python3`), e.g. for benchmarks."""
    ctx = ctx or ProbeContext()
    return [ProbeCommand(p.id, p.command(ctx), p.timeout_s) for p in probes_for(ctx)]
