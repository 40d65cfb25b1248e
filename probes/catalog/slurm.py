"""Probes of a [slurm] run's cluster: Slurm's commands, the partition, a test submit, the time limit.
"""
from __future__ import annotations

import re
import shlex

from probes.catalog.output import (
    last_line,
    shell_failure,
)
from probes.catalog.probe import Findings, JudgeInput, Verdict
from probes.context import (
    ProbeContext,
)
from probes.model import CommandResult, Status

# ---------------------------------------------------------------------------------------------- Slurm

SLURM_COMMANDS = ("sinfo", "sbatch", "srun", "squeue", "scancel")
# what sbatch says when it refuses, and the run.toml key that fixes it
SLURM_REFUSALS = (
    ("invalid account", "set slurm.account to one of yours (`sacctmgr show assoc user=$USER format=account`)"),
    ("invalid qos", "set slurm.qos to one your account may use (`sacctmgr show assoc user=$USER format=qos`)"),
    ("invalid partition", "set slurm.partition to one `sinfo -s` lists"),
    ("invalid feature", "slurm.constraint names a feature no node of the partition has (`sinfo -o '%N %f'`)"),
    ("time limit", "lower slurm.time_limit to the partition's limit (`sinfo -o '%P %l'`)"),
    ("node configuration is not available", "ask for what one node has: slurm.gpus_per_node (`sinfo -o '%N %G'`), "
                                            "slurm.constraint, or fewer nodes"),
)


def slurm_commands_command(ctx: ProbeContext) -> str:
    return f"for c in {' '.join(SLURM_COMMANDS)}; do command -v $c || echo \"missing $c\"; done; sinfo --version"


def judge_slurm_commands(res: CommandResult, inp: JudgeInput) -> Verdict:
    expected = f"{', '.join(SLURM_COMMANDS)} on PATH (the cluster's login node)"
    missing = [line.split()[1] for line in res.stdout.splitlines() if line.startswith("missing ")]
    if missing:
        return Verdict(Status.FAIL, f"{', '.join(missing)} not found on PATH", expected, res.stdout.strip(),
                       remedy="run regen on the cluster's login node, or put Slurm's bin directory on PATH "
                              "(`module load slurm` on many clusters)")
    version = last_line(res.stdout)
    if res.exit_status != 0 or not version:
        return Verdict(Status.FAIL, shell_failure(res, "sinfo --version"), expected, res.stderr.strip(),
                       remedy="check that sinfo reaches the controller (SLURM_CONF, munge running)")
    return Verdict(Status.PASS, version, expected, version, data={"version": version})


def slurm_partition_command(ctx: ProbeContext) -> str:
    part = shlex.quote(ctx.slurm.partition if ctx.slurm else "")
    return f"sinfo -h -N -p {part} -o '%N|%T|%G|%l|%f' && echo @@partitions && sinfo -h -o '%R'"


def slurm_submit_command(ctx: ProbeContext) -> str:
    if ctx.slurm is None:  # the probe's `when` runs it only with a [slurm] config
        raise ValueError("slurm.submit needs a run config with a [slurm] table")
    return ctx.slurm.test_command


def gres_gpus(gres: str) -> int:
    """GPUs in sinfo's %G: `gpu:4`, `gpu:h100:8(S:0-1)`, `gpu:a100:2,shard:4` (0 when none)."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def slurm_minutes(text: str) -> int | None:
    """sinfo's %l (`infinite`, `1-00:00:00`, `4:00:00`, `30:00`) in seconds; None for infinite/unknown."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text.strip())
    if not m:
        return None
    d, h, mi, se = (int(g) if g else 0 for g in m.groups())
    return d * 86400 + h * 3600 + mi * 60 + se


def judge_slurm_partition(res: CommandResult, inp: JudgeInput) -> Verdict:
    ask = inp.ctx.slurm
    assert ask is not None
    expected = (f"partition {ask.partition} with {ask.nodes} node(s) of {ask.gpus_per_node} GPUs"
                + (f" and feature {ask.constraint}" if ask.constraint else "") + f", time limit >= {ask.time_limit}")
    if res.exit_status != 0:
        return Verdict(Status.FAIL, shell_failure(res, "sinfo"), expected, res.stderr.strip(),
                       remedy="check that sinfo reaches the controller (SLURM_CONF, munge running)")
    nodes_text, _, parts_text = res.stdout.partition("@@partitions")
    partitions = sorted({p.strip().rstrip("*") for p in parts_text.split() if p.strip()})
    rows = [line.split("|") for line in nodes_text.splitlines() if line.count("|") == 4]
    if not rows:
        return Verdict(Status.FAIL, f"partition {ask.partition!r} not found; the cluster has: "
                       f"{', '.join(partitions) or '(none)'}", expected, nodes_text.strip(),
                       remedy="set slurm.partition to one of them", data={"partitions": partitions})
    nodes = {r[0]: r for r in rows}  # a node listed once per partition it is in
    with_gpus = [n for n, r in nodes.items() if gres_gpus(r[2]) >= ask.gpus_per_node]
    fit = [n for n in with_gpus if not ask.constraint or ask.constraint in nodes[n][4].split(",")]
    usable = [n for n in fit if not any(w in nodes[n][1] for w in ("down", "drain", "fail", "maint", "inval"))]
    limit_s = slurm_minutes(rows[0][3])
    f = Findings()
    most = max(gres_gpus(r[2]) for r in rows)
    if len(with_gpus) >= ask.nodes > len(fit):
        f.fail(f"{len(fit)} node(s) of partition {ask.partition} with {ask.gpus_per_node} GPUs have feature "
               f"{ask.constraint}; the run needs {ask.nodes}",
               "change slurm.constraint to features those nodes have (`sinfo -o '%N %f'`), or remove it")
    elif len(fit) < ask.nodes:
        f.fail(f"{len(fit)} node(s) of partition {ask.partition} have {ask.gpus_per_node} GPUs"
               + (f" and feature {ask.constraint}" if ask.constraint else "") + f"; the run needs {ask.nodes} "
               f"(its nodes have at most {most} GPUs)",
               f"lower slurm.gpus_per_node to {most} or less, or slurm.nodes, or pick another partition")
    elif len(usable) < ask.nodes:
        f.warn(f"only {len(usable)} of the {len(fit)} fitting node(s) are up now (the others are down or "
               "draining): the jobs wait for them", "see `sinfo -R` for why they are down")
    if limit_s is not None and limit_s < ask.time_limit_s:
        f.fail(f"slurm.time_limit {ask.time_limit} is above partition {ask.partition}'s limit {rows[0][3]}",
               f"lower slurm.time_limit to {rows[0][3]} or less")
    states = ", ".join(f"{n} {nodes[n][1]}" for n in sorted(nodes))
    return f.verdict(f"{ask.partition}: {len(usable)} node(s) up with >= {ask.gpus_per_node} GPUs (the run needs "
                     f"{ask.nodes}); time limit {rows[0][3]}", expected=expected, actual=states,
                     data={"nodes": len(nodes), "fit": len(fit), "usable": len(usable), "partition_limit": rows[0][3],
                           "partitions": partitions})


def judge_slurm_submit(res: CommandResult, inp: JudgeInput) -> Verdict:
    ask = inp.ctx.slurm
    assert ask is not None
    expected = "sbatch --test-only accepts the run's job (partition, account, qos, gres, time limit)"
    said = " ".join(line.strip() for line in (res.stderr + res.stdout).splitlines() if line.strip())
    if res.exit_status == 0 and "to start at" in said:
        return Verdict(Status.PASS, last_line(res.stderr) or said, expected, said,
                       data={"account": ask.account, "qos": ask.qos})
    low = said.lower()
    remedy = next((fix for words, fix in SLURM_REFUSALS if words in low), "read Slurm's words above; `sbatch "
                  "--test-only` with the same arguments shows them again")
    return Verdict(Status.FAIL, f"sbatch refused the run's job: {said or '(no output)'}", expected, said,
                   remedy=remedy)


def judge_slurm_time(res: CommandResult, inp: JudgeInput) -> Verdict:
    ask = inp.ctx.slurm
    assert ask is not None
    # with time_min, backfill may start a job with a limit down to it: the shortest allocation is judged
    key = "time_min" if ask.time_min_s is not None else "time_limit"
    usable = (ask.time_min_s or ask.time_limit_s) - ask.handover_s
    expected = (f"each allocation's usable time ({key} - handover_s = {usable} s) well above a server's load "
                f"time (workers.ready_timeout_s = {ask.ready_timeout_s:g} s)")
    data = {"time_limit_s": ask.time_limit_s, "handover_s": ask.handover_s, "usable_s": usable,
            "time_min_s": ask.time_min_s}
    summary = (f"{ask.time_limit} per allocation, {usable} s of it serving before the hand-over; `regen plan` says "
               "how many allocations in a row the run needs") if ask.time_min_s is None else (
        f"{ask.time_limit} per allocation, down to {ask.time_min_s} s (time_min) for a job backfill starts in a "
        f"shorter window: {usable} s of that serving before the hand-over")
    if usable < ask.ready_timeout_s:
        return Verdict(Status.WARN, f"an allocation serves for {usable} s but a server may take up to "
                       f"{ask.ready_timeout_s:g} s to load: an allocation could end before its servers serve",
                       expected, summary, remedy=f"raise slurm.{key} (or lower workers.ready_timeout_s if the "
                       "model loads faster)", data=data)
    return Verdict(Status.PASS, summary, expected, summary, data=data)
