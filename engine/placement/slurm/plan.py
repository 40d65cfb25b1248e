"""What regen submits to Slurm for a run with [slurm]: the server groups, their exact sbatch and srun lines, and how
many allocations the run needs at the plan's projected duration.

One job per server group (a group starts, fails and hands over on its own nodes, not the whole run's), and no
`--signal` before the limit (SGLang dies of SIGUSR1): the login node reads each job's time left from squeue instead.
"""
from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from engine.api.reports import SlurmPlan
from engine.config.schema import RunConfig, Slurm
from engine.placement.slurm.jobs import JOBS_FILE
from engine.placement.slurm.schedule import (DEFAULT_LOAD_S, DEFAULT_QUEUE_WAIT_S, first_limit_min, handover_times,
                                             limit_text, spacing_s)
from engine.servers.ranks import DIST_PORT_SPAN

STEP_MODULE = "engine.placement.slurm.step"
AGENT_DIR = ".regen/engine"
# a server across nodes: its rank 0 listens for the other ranks on base_port + this (+ DIST_PORT_SPAN per group, so
# two groups' servers that Slurm puts on one node never share SGLang's dist-init ports)
DIST_PORT_OFFSET = 1000


@dataclass(frozen=True)
class SlurmLayout:
    """How servers map onto nodes: tp_size up to gpus_per_node gives several servers per node, above it one
    server spans tp_size / gpus_per_node nodes."""
    gpus_per_node: int
    tp_size: int
    nodes_low: int
    nodes_high: int

    @property
    def nodes_per_group(self) -> int:
        return max(1, self.tp_size // self.gpus_per_node)

    @property
    def servers_per_group(self) -> int:
        return max(1, self.gpus_per_node // self.tp_size)

    @property
    def groups(self) -> int:
        """Jobs regen submits per allocation round: for the most nodes of the range."""
        return self.nodes_high // self.nodes_per_group

    @property
    def groups_counted(self) -> int:
        """Groups the plan's projection counts on: the fewest nodes of the range."""
        return max(1, self.nodes_low // self.nodes_per_group)

    @property
    def servers(self) -> int:
        return self.groups * self.servers_per_group

    @property
    def servers_counted(self) -> int:
        return self.groups_counted * self.servers_per_group

    def describe(self) -> str:
        per = (f"{self.servers_per_group} server(s) of tp {self.tp_size} per node" if self.nodes_per_group == 1
               else f"one server of tp {self.tp_size} across {self.nodes_per_group} nodes")
        nodes = (f"{self.nodes_high} node(s)" if self.nodes_low == self.nodes_high
                 else f"{self.nodes_low}-{self.nodes_high} nodes (the plan counts on {self.nodes_low})")
        elastic = ("" if self.groups == self.groups_counted else
                   f" (elastic: each one Slurm grants serves at once; the plan counts on {self.groups_counted})")
        return (f"{nodes} x {self.gpus_per_node} GPUs: {per}; {self.groups} job(s) of {self.nodes_per_group} "
                f"node(s), {self.servers} server(s){elastic}")


def layout_of(cfg: RunConfig) -> SlurmLayout:
    s = slurm_section(cfg)
    span = max(1, cfg.workers.tp_size // s.gpus_per_node)
    if s.by_groups:  # the range in groups: in nodes for the layout
        low, high = (g * span for g in s.group_range(span))
    else:
        low, high = s.node_range
    return SlurmLayout(gpus_per_node=s.gpus_per_node, tp_size=cfg.workers.tp_size, nodes_low=low, nodes_high=high)


def slurm_section(cfg: RunConfig) -> Slurm:
    """The run's [slurm] section; ValueError for a run without one."""
    if cfg.slurm is None:
        raise ValueError("the run has no [slurm] section")
    return cfg.slurm


def slurm_work_dir(cfg: RunConfig) -> str:
    return slurm_section(cfg).work_dir or str(Path(cfg.run_dir) / "slurm")


def jobs_file(cfg: RunConfig) -> Path:
    """Every job id regen submitted for the run (engine.placement.slurm.jobs.submit appends them)."""
    return Path(slurm_work_dir(cfg)) / JOBS_FILE


def job_name(cfg: RunConfig, group: int) -> str:
    return f"{slurm_section(cfg).job_name}-{group}"


def block(cfg: RunConfig, group: int, slot: int) -> int:
    """The group's port block: each group has two (slot 0 and 1), and each job of it takes the other one than the
    job before, so a job that takes over while the last one still drains never shares a port with it, even on the
    same node."""
    return group + slot * layout_of(cfg).groups


def base_port(cfg: RunConfig, group: int, slot: int = 0) -> int:
    """The first server port of the group's job in `slot` (base_port + block x servers per group)."""
    return cfg.workers.base_port + block(cfg, group, slot) * layout_of(cfg).servers_per_group


def dist_init_port(cfg: RunConfig, group: int, slot: int = 0) -> int:
    """The port a spanning server's rank 0 listens on for its other ranks (on the group's first node)."""
    return cfg.workers.base_port + DIST_PORT_OFFSET + block(cfg, group, slot) * DIST_PORT_SPAN


def srun_argv(cfg: RunConfig, group: int, slot: int = 0) -> list[str]:
    """The job step that runs regen's host agent on each node of the group (one task per node); a group of several
    nodes is one server, each node's agent launching its rank (--dist-init-port: where rank 0 waits for the others).
    A job in the group's second port block (slot 1) says so with --base-port."""
    layout = layout_of(cfg)
    wd = slurm_work_dir(cfg)
    # PYTHONPATH on the step's own line: `sbatch --export=ALL,VAR=...` loses the launch of a job that waited in
    # the queue (Slurm 22.05, seen in tests/test_slurm_run.py)
    argv = ["srun", f"--nodes={layout.nodes_per_group}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            "env", f"PYTHONPATH={wd}/{AGENT_DIR}", cfg.host_python, "-m", STEP_MODULE, "--work-dir", wd,
            "--group", str(group)]
    if slot:
        argv += ["--base-port", str(base_port(cfg, group, slot))]
    if layout.nodes_per_group > 1:
        argv += ["--dist-init-port", str(dist_init_port(cfg, group, slot))]
    return argv


def sbatch_argv(cfg: RunConfig, group: int, *, test_only: bool = False, time_limit_min: int | None = None,
                slot: int = 0) -> list[str]:
    """The allocation of one server group; its batch script is the srun line (--wrap). By default the group's first
    job: its --time staggered (engine/placement/slurm/schedule.py); `time_limit_min`: another job's --time in
    minutes. [slurm] time_min goes on as --time-min, never above the job's own --time (Slurm refuses that job)."""
    s = slurm_section(cfg)
    layout = layout_of(cfg)
    limit_min = time_limit_min if time_limit_min is not None else first_limit_min(s, layout.groups, group)
    limit = limit_text(limit_min)
    wd = slurm_work_dir(cfg)
    argv = ["sbatch", "--parsable", f"--job-name={job_name(cfg, group)}", f"--partition={s.partition}"]
    argv += [f"--account={s.account}"] if s.account else []
    argv += [f"--qos={s.qos}"] if s.qos else []
    argv += [f"--constraint={s.constraint}"] if s.constraint else []
    argv += [f"--nodes={layout.nodes_per_group}", "--ntasks-per-node=1", f"--gres=gpu:{s.gpus_per_node}",
             f"--time={limit}", f"--output={wd}/job-%j.out"]
    argv += [f"--time-min={time_min_text(s, limit_min)}"] if s.time_min else []  # backfill: a shorter idle window
    argv += ["--test-only"] if test_only else []
    argv += list(s.extra_args)
    argv.append("--wrap=" + shlex.join(srun_argv(cfg, group, slot)))
    return argv


def time_min_text(s: Slurm, limit_min: int) -> str:
    """The job's --time-min: [slurm] time_min as written, or the job's own --time where that is shorter (a staggered
    first job, a lowered successor)."""
    if s.time_min_s is not None and s.time_min_s <= limit_min * 60:
        return s.time_min or limit_text(limit_min)
    return limit_text(limit_min)


def allocations_needed(wall_s: float, usable_s: int) -> int:
    return max(1, math.ceil(wall_s / usable_s))


def plan_slurm(cfg: RunConfig, projected_wall_s: float | None) -> SlurmPlan:
    s = slurm_section(cfg)
    layout = layout_of(cfg)
    usable = s.time_limit_s - s.handover_s
    return SlurmPlan(
        layout=layout.describe(), groups=layout.groups, servers=layout.servers, time_limit_s=s.time_limit_s,
        handover_s=s.handover_s, usable_s=usable, projected_wall_s=projected_wall_s,
        allocations=None if projected_wall_s is None else allocations_needed(projected_wall_s, usable),
        sbatch=[shlex.join(sbatch_argv(cfg, g)) for g in range(layout.groups)],
        srun=[shlex.join(srun_argv(cfg, g)) for g in range(layout.groups)], time_min_s=s.time_min_s,
        handovers=handover_times(s, layout.groups, projected_wall_s), spacing_s=spacing_s(s, layout.groups),
        assumed_queue_wait_s=DEFAULT_QUEUE_WAIT_S, assumed_load_s=DEFAULT_LOAD_S)
