"""The probe catalog: for each probe, the exact shell command it runs on the host and how its output is judged.

A probe's command depends only on the ProbeContext (so the report shows a command the
operator can paste into a shell on the host). Commands that need Python run a script from
probes/host/ with the configured host interpreter: `<python> -c <script> <json args>`;
the scripts print JSON and keep every error's text. stderr is never discarded.

`needs`: probes that must PASS or WARN first (otherwise this one is SKIP, naming them).
`uses`: probes whose data this one reads when available (it waits for them, never skips).
`real_gpus`: in a rehearsal (the run config launches the SGLang simulator, `ProbeContext.rehearsal`)
the probe is SKIP with "rehearsal: simulated GPUs"; `packages` then does not import sglang.
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypedDict

from probes.context import DETERMINISTIC_FLAG, GIB, REHEARSAL, ProbeContext, prompt_input_limit
from probes.host import script
from probes.host.candidates import candidate_words, describe, search_from_dict
from probes.shell import shell_path
from probes.model import CommandResult, ProbeResult, Status

MIN_PYTHON = (3, 10)
# (module, distribution) imported by `packages`; sglang last: it imports torch and may crash the interpreter.
PACKAGES = (
    ("transformers", "transformers"),
    ("pyarrow", "pyarrow"),
    ("psutil", "psutil"),
    ("pynvml", "nvidia-ml-py"),
    ("aiohttp", "aiohttp"),
    ("orjson", "orjson"),
    ("prometheus_client", "prometheus-client"),
    ("sglang", "sglang"),
)
NVSMI_QUERY = "index,name,memory.total,memory.used,driver_version"
NVSMI_APPS = "pid,process_name,used_memory"
HEADER_MARK = "@@regen:nvidia-smi-header"
APPS_MARK = "@@regen:nvidia-smi-compute-apps"
NVCC_FALLBACKS = ("/usr/local/cuda/bin/nvcc",)  # where nvcc usually is when not on PATH (CUDA_HOME is tried first)
BUSY_GPU_MIB = 1024  # memory already used on a configured GPU above this is worth a warning
OUTPUT_TOKENS_GUESS = 2048  # per sample, for the disk estimate (Qwen3 thinking answers average ~1.4K)
BYTES_PER_TOKEN = 6  # input_ids int32 + loss_mask uint8 + the decoded text, after zstd
KV_HEADROOM = 0.85  # weights above this share of a GPU leave too little room for the KV cache


@dataclass
class Verdict:
    """A judge's answer; the runner adds id, title, command, exit status, output and duration."""

    status: Status
    summary: str
    expected: str = ""
    actual: str = ""
    remedy: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JudgeInput:
    ctx: ProbeContext
    deps: Mapping[str, ProbeResult]  # results of `needs` and `uses` (those that ran)

    def dep_data(self, probe_id: str) -> dict[str, Any]:
        r = self.deps.get(probe_id)
        return r.data if r is not None and r.status in (Status.PASS, Status.WARN) else {}


@dataclass(frozen=True)
class Probe:
    id: str
    title: str
    command: Callable[[ProbeContext], str]
    judge: Callable[[CommandResult, JudgeInput], Verdict]
    needs: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()
    timeout_s: float = 30.0
    script: str | None = None  # the probes/host script embedded in the command (for a short display)
    # what the partial output of a timed-out command tells (e.g. which import hung); None: nothing more
    on_timeout: Callable[[CommandResult], str | None] | None = None
    config: str = "any"  # "any": always; "config": only with --config; "no_config": only without
    when: Callable[[ProbeContext], bool] | None = None  # only for contexts where this holds
    real_gpus: bool = False  # checks what only real SGLang servers need (GPUs, CUDA, weights): SKIP in a rehearsal


class Findings:
    """Issues found by a judge; the verdict's status is the worst of them."""

    ORDER = {Status.PASS: 0, Status.WARN: 1, Status.FAIL: 2, Status.ERROR: 3}

    def __init__(self) -> None:
        self.items: list[tuple[Status, str, str]] = []  # (status, text, remedy)

    def add(self, status: Status, text: str, remedy: str = "") -> None:
        self.items.append((status, text, remedy))

    def fail(self, text: str, remedy: str = "") -> None:
        self.add(Status.FAIL, text, remedy)

    def warn(self, text: str, remedy: str = "") -> None:
        self.add(Status.WARN, text, remedy)

    @property
    def status(self) -> Status:
        worst = Status.PASS
        for status, _, _ in self.items:
            if self.ORDER[status] > self.ORDER[worst]:
                worst = status
        return worst

    def verdict(self, ok_summary: str, *, expected: str = "", actual: str = "", data: dict | None = None) -> Verdict:
        status = self.status
        if status is Status.PASS:
            return Verdict(status, ok_summary, expected, actual, "", data or {})
        worst = [(t, r) for s, t, r in self.items if s is status]
        rest = [t for s, t, _ in self.items if s is not status]
        summary = "; ".join(t for t, _ in worst)
        remedy = " ".join(dict.fromkeys(r for _, r in worst + [(t, r) for s, t, r in self.items if s is not status] if r))
        if rest:
            actual = (actual + "\n" if actual else "") + "also: " + "; ".join(rest)
        return Verdict(status, summary, expected, actual, remedy, data or {})


# ---------------------------------------------------------------------------------------------- helpers


def python_command(ctx: ProbeContext, name: str, args: Any = None) -> str:
    argv = [ctx.python, "-c", script(name)]
    if args is not None:
        argv.append(json.dumps(args, sort_keys=True))
    return " ".join(shlex.quote(a) for a in argv)


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def shell_failure(res: CommandResult, what: str) -> str:
    """`what` failed (exit N): <the shell's own text>."""
    text = last_line(res.stderr) or last_line(res.stdout) or "(no output)"
    if res.exit_status == 127:
        return f"{what} not found (exit 127): {text}"
    return f"{what} failed (exit {res.exit_status}): {text}"


def json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # not ours: a library printed to stdout; the raw stdout is in the report
    return out


class ScriptOutputError(Exception):
    pass


def script_json(res: CommandResult, what: str) -> dict:
    """The last JSON object the host script printed, or an error naming what went wrong."""
    objs = json_lines(res.stdout)
    if res.exit_status == 0 and objs:
        return objs[-1]
    if res.exit_status == 127:
        raise ScriptOutputError(shell_failure(res, "the host python"))
    detail = last_line(res.stderr) or "(no stderr)"
    raise ScriptOutputError(f"the {what} script exited {res.exit_status} without a result: {detail}")


def script_error_verdict(exc: ScriptOutputError, ctx: ProbeContext) -> Verdict:
    return Verdict(Status.ERROR, str(exc), remedy=f"run the command by hand on the host with {ctx.python} to see why")


def gib(n: float | int | None) -> str:
    if n is None:
        return "?"
    return f"{n / GIB:.1f} GiB"


def size_text(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def version_tuple(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    m = re.match(r"(\d+)\.(\d+)", str(text))
    return (int(m.group(1)), int(m.group(2))) if m else None


def gpu_memory_mib(inp: JudgeInput) -> tuple[list[dict], str]:
    """Per-GPU facts from gpu.nvidia_smi (else gpu.nvml): the configured GPUs when a config names them."""
    for pid in ("gpu.nvidia_smi", "gpu.nvml"):
        gpus = inp.dep_data(pid).get("gpus")
        if gpus:
            wanted = set(inp.ctx.gpus)
            chosen = [g for g in gpus if not wanted or g["index"] in wanted]
            return chosen or gpus, pid
    return [], ""


# ---------------------------------------------------------------------------------------------- connection


def judge_connection(res: CommandResult, inp: JudgeInput) -> Verdict:
    if res.exit_status != 0:
        return Verdict(Status.FAIL, shell_failure(res, "`id -un && uname -n && uname -srm`"),
                       expected="a POSIX shell with id and uname", actual=res.stderr.strip(),
                       remedy="check the account's login shell on the host")
    lines = res.stdout.strip().splitlines()
    user, host, kernel = (lines + ["?", "?", "?"])[:3]
    return Verdict(Status.PASS, f"connected as {user}@{host} ({kernel})",
                   data={"user": user, "hostname": host, "kernel": kernel})


# ---------------------------------------------------------------------------------------------- python and packages


def judge_python(res: CommandResult, inp: JudgeInput) -> Verdict:
    py = inp.ctx.python
    expected = f"{py} runs and is Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]}"
    if res.exit_status == 127:
        return Verdict(Status.FAIL, shell_failure(res, py), expected, res.stderr.strip(),
                       remedy=f"install Python >= 3.10 or set host_python in the run config to the SGLang env's python "
                              f"(e.g. /opt/venv/bin/python); `command -v python3` on the host lists what is on PATH")
    try:
        info = script_json(res, "interpreter")
    except ScriptOutputError as exc:
        return Verdict(Status.FAIL, f"{py} did not run the probe script: {exc}", expected, res.stderr.strip(),
                       remedy="set host_python to a Python >= 3.10")
    version = tuple(info.get("version") or ())
    vtext = ".".join(map(str, version))
    venv = info.get("prefix") != info.get("base_prefix")
    where = f"{info.get('executable')}" + (f" (venv {info.get('prefix')})" if venv else "")
    data = dict(info, venv=venv)
    if version[:2] < MIN_PYTHON:
        return Verdict(Status.FAIL, f"{py} is Python {vtext} at {where}: too old", expected, f"Python {vtext}",
                       remedy="point host_python at a Python >= 3.10 (the SGLang env's)", data=data)
    return Verdict(Status.PASS, f"Python {vtext} at {where}", expected, f"Python {vtext}", data=data)


def packages_for(ctx: ProbeContext) -> tuple[tuple[str, str], ...]:
    """(module, distribution) the host env needs: a rehearsal runs the simulator, not sglang."""
    return tuple(p for p in PACKAGES if not (ctx.rehearsal and p[0] == "sglang"))


def packages_in_flight(res: CommandResult) -> str | None:
    records = json_lines(res.stdout)
    done = {r["module"] for r in records if "module" in r}
    hung = next((r["start"] for r in records if "start" in r and r["start"] not in done), None)
    return f"while importing {hung}" if hung else None


def judge_packages(res: CommandResult, inp: JudgeInput) -> Verdict:
    records = json_lines(res.stdout)
    done = {r["module"]: r for r in records if "module" in r}
    started = [r["start"] for r in records if "start" in r]
    finished = any(r.get("done") for r in records)
    wanted = packages_for(inp.ctx)
    expected = "importable in " + inp.ctx.python + ": " + ", ".join(m for m, _ in wanted)
    f = Findings()
    if not finished:
        crashed = next((m for m in started if m not in done), None)
        how = f"exit {res.exit_status}" if res.exit_status is not None else (res.error or "no exit status")
        if crashed:
            f.add(Status.FAIL, f"importing {crashed} crashed the interpreter ({how}): {last_line(res.stderr) or '(no stderr)'}",
                  f"reinstall {crashed} in the host env and try `{inp.ctx.python} -c 'import {crashed}'` by hand")
        else:
            return Verdict(Status.ERROR, f"the package script printed no result ({how}): {last_line(res.stderr)}",
                           expected, res.stderr.strip())
    lines, versions, broken = [], {}, []
    for module, dist in wanted:
        r = done.get(module)
        if r is None:
            lines.append(f"{module}: not checked")
            continue
        if r.get("ok"):
            versions[module] = r.get("version")
            lines.append(f"{module} {r.get('version') or '(version unknown)'}")
        else:
            lines.append(f"{module}: {r['error']}")
            broken.append(dist)
            f.fail(f"{module}: {r['error']}")
    if broken:
        f.fail(f"{len(broken)} of {len(wanted)} not importable", f"install into the host env: {inp.ctx.python} -m pip "
               "install " + " ".join(broken) + " (sglang pins torch and the rest; `pip install 'sglang[all]'`)")
    if len(wanted) < len(PACKAGES):
        lines.append(f"sglang: not needed ({REHEARSAL})")
    ok = ", ".join(f"{m} {versions[m]}" for m in versions)
    return f.verdict(f"all {len(wanted)} importable: {ok}" + ("; sglang not needed (rehearsal)" if inp.ctx.rehearsal
                                                              else ""),
                     expected=expected, actual="\n".join(lines), data={"packages": {m: done.get(m) for m, _ in wanted}})


# ---------------------------------------------------------------------------------------------- seed


def judge_seed(res: CommandResult, inp: JudgeInput) -> Verdict:
    """sampling.seed set: will the servers follow it? (the launch flag, and an sglang that knows the field)"""
    ctx = inp.ctx
    try:
        info = script_json(res, "seed support")
    except ScriptOutputError as exc:
        return script_error_verdict(exc, ctx)
    expected = (f"servers launched with {DETERMINISTIC_FLAG} by an sglang whose SamplingParams take sampling_seed"
                f" (sampling.seed = {ctx.sampling_seed})")
    drop = "or remove sampling.seed from the run config"
    f = Findings()
    if not ctx.seed_honoured_by_launch:
        f.warn(f"the servers will ignore sampling.seed = {ctx.sampling_seed}: SGLang reads a request's sampling_seed"
               f" only with {DETERMINISTIC_FLAG}, which the launch line and workers.extra_args lack",
               f'add "{DETERMINISTIC_FLAG}" to workers.extra_args (SGLang then uses deterministic, slower kernels), '
               + drop)
    where = info.get("sglang") or "sglang"
    if info.get("error"):
        f.fail(f"cannot check sglang: {info['error']}", f"install sglang into {ctx.python}'s env, " + drop)
    if info.get("sampling_seed") is False:
        f.fail(f"{where}: SamplingParams has no sampling_seed (sglang 0.4.x): every request carrying the seed fails"
               " with HTTP 500", "upgrade sglang (0.5.5 or later), " + drop)
    if info.get("deterministic_flag") is False:
        f.fail(f"{where}: ServerArgs has no {DETERMINISTIC_FLAG}: a server launched with it does not start, and"
               " without it the seed is ignored", "upgrade sglang (0.5.5 or later), " + drop)
    for key in ("sampling_seed", "deterministic_flag"):
        if info.get(key + "_error"):
            f.warn(f"{where}: could not read the source that says it: {info[key + '_error']}")
    return f.verdict(f"sampling.seed = {ctx.sampling_seed} is honoured: {DETERMINISTIC_FLAG} in the launch line and"
                     f" {where} takes sampling_seed", expected=expected,
                     actual=json.dumps(info, sort_keys=True), data=info)


# ---------------------------------------------------------------------------------------------- router


def router_command(ctx: ProbeContext) -> str:
    code = "import importlib.metadata as m, sglang_router; print(m.version('sglang-router'))"
    return f"{shlex.quote(ctx.router_python or ctx.python)} -c {shlex.quote(code)}"


def judge_router(res: CommandResult, inp: JudgeInput) -> Verdict:
    python = inp.ctx.router_python or inp.ctx.python
    expected = f"{python} imports sglang_router (the multi-host run's router)"
    if res.exit_status != 0:
        return Verdict(Status.FAIL, shell_failure(res, f"{python} -c 'import sglang_router'"), expected,
                       res.stderr.strip() or res.stdout.strip(),
                       remedy=f"{python} -m pip install sglang-router (on the dispatch host)")
    version = last_line(res.stdout)
    return Verdict(Status.PASS, f"sglang-router {version}", expected, version, data={"version": version})


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
    usable = ask.time_limit_s - ask.handover_s
    expected = (f"each allocation's usable time (time_limit - handover_s = {usable} s) well above a server's load "
                f"time (workers.ready_timeout_s = {ask.ready_timeout_s:g} s)")
    data = {"time_limit_s": ask.time_limit_s, "handover_s": ask.handover_s, "usable_s": usable}
    summary = (f"{ask.time_limit} per allocation, {usable} s of it serving before the hand-over; `regen plan` says "
               "how many allocations in a row the run needs")
    if usable < ask.ready_timeout_s:
        return Verdict(Status.WARN, f"an allocation serves for {usable} s but a server may take up to "
                       f"{ask.ready_timeout_s:g} s to load: an allocation could end before its servers serve",
                       expected, summary, remedy="raise slurm.time_limit (or lower workers.ready_timeout_s if the "
                       "model loads faster)", data=data)
    return Verdict(Status.PASS, summary, expected, summary, data=data)


# ---------------------------------------------------------------------------------------------- GPUs


def nvidia_smi_command(ctx: ProbeContext) -> str:
    return (
        f"nvidia-smi --query-gpu={NVSMI_QUERY} --format=csv,noheader,nounits"
        f" && printf '%s\\n' {HEADER_MARK} && nvidia-smi"
        f" && printf '%s\\n' {APPS_MARK} && nvidia-smi --query-compute-apps={NVSMI_APPS} --format=csv,noheader,nounits"
    )


class SmiGpu(TypedDict):
    """One GPU as gpu.nvidia_smi reads it (`nvidia-smi --query-gpu`), the rows of its data's "gpus"."""
    index: int
    name: str
    memory_total_mib: int
    memory_used_mib: int
    driver_version: str


def judge_nvidia_smi(res: CommandResult, inp: JudgeInput) -> Verdict:
    expected = "nvidia-smi lists the GPUs" + (f" {list(inp.ctx.gpus)}" if inp.ctx.gpus else "")
    out = res.stdout
    query, _, rest = out.partition(HEADER_MARK)
    header, _, apps = rest.partition(APPS_MARK)
    if res.exit_status != 0 and not rest:
        return Verdict(Status.FAIL, shell_failure(res, "nvidia-smi"), expected,
                       (res.stderr.strip() or res.stdout.strip()),
                       remedy="install the NVIDIA driver (nvidia-smi ships with it) or run on a GPU host; in a "
                              "container, start it with --gpus all")
    f = Findings()
    gpus: list[SmiGpu] = []
    for line in query.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 5:
            f.fail(f"unexpected nvidia-smi line: {line!r}")
            continue
        try:
            gpus.append(SmiGpu(index=int(cells[0]), name=cells[1], memory_total_mib=int(float(cells[2])),
                               memory_used_mib=int(float(cells[3])), driver_version=cells[4]))
        except ValueError:
            f.fail(f"unexpected nvidia-smi line: {line!r}")
    m = re.search(r"CUDA Version:\s*([\d.]+)", header)
    cuda = m.group(1) if m else None
    if not rest or res.exit_status != 0 and not apps:
        f.warn(f"CUDA version unknown: {shell_failure(res, 'nvidia-smi (header)')}")
    elif cuda is None:
        f.warn("CUDA version not found in the nvidia-smi header")
    processes = []
    if apps:
        if res.exit_status != 0:
            f.warn(shell_failure(res, "nvidia-smi --query-compute-apps"))
        for line in apps.strip().splitlines():
            cells = [c.strip() for c in line.split(",")]
            if len(cells) >= 3 and cells[0].isdigit():
                used = int(cells[2]) if cells[2].isdigit() else None
                processes.append({"pid": int(cells[0]), "name": cells[1], "used_memory_mib": used})
    if not gpus:
        f.fail("nvidia-smi ran but listed no GPUs", "check the driver (`nvidia-smi -L`) and CUDA_VISIBLE_DEVICES")
    present = {g["index"] for g in gpus}
    missing = [i for i in inp.ctx.gpus if i not in present]
    if missing:
        f.fail(f"configured GPU(s) {missing} not present (host has {sorted(present)})",
               "fix workers.gpus in the run config")
    for g in gpus:
        if (not inp.ctx.gpus or g["index"] in inp.ctx.gpus) and g["memory_used_mib"] > BUSY_GPU_MIB:
            f.warn(f"GPU {g['index']} already has {g['memory_used_mib']} MiB in use",
                   "stop what holds the GPU memory (see the processes) or choose other GPUs")
    if processes:
        f.warn("processes hold GPU memory: " + ", ".join(
            f"pid {p['pid']} {p['name']} ({p['used_memory_mib']} MiB)" for p in processes))
    names = sorted({g["name"] for g in gpus})
    total = sum(g["memory_total_mib"] for g in gpus)
    driver = gpus[0]["driver_version"] if gpus else None
    actual = "\n".join(f"GPU {g['index']}: {g['name']}, {g['memory_used_mib']}/{g['memory_total_mib']} MiB used"
                       for g in gpus)
    summary = (f"{len(gpus)} GPU(s): {', '.join(names)}; {total // 1024} GiB total; driver {driver}, CUDA {cuda}; "
               f"{len(processes)} process(es) holding VRAM")
    return f.verdict(summary, expected=expected, actual=actual,
                     data={"gpus": gpus, "cuda_version": cuda, "driver_version": driver, "processes": processes})


def judge_nvml(res: CommandResult, inp: JudgeInput) -> Verdict:
    try:
        info = script_json(res, "NVML")
    except ScriptOutputError as exc:
        return script_error_verdict(exc, inp.ctx)
    expected = "pynvml.nvmlInit() succeeds and lists the GPUs"
    if not info.get("ok"):
        stage = info.get("stage")
        remedy = ("install nvidia-ml-py into the host env" if stage == "import"
                  else "NVML ships with the NVIDIA driver (libnvidia-ml.so.1); install the driver or expose it to the container")
        what = "import pynvml" if stage == "import" else f"pynvml {stage}()"
        return Verdict(Status.FAIL, f"{what} failed: {info.get('error')}", expected, info.get("error", ""), remedy,
                       data=info)
    f = Findings()
    gpus = info.get("gpus") or []
    if not gpus:
        f.fail("NVML sees no GPUs")
    smi = inp.dep_data("gpu.nvidia_smi").get("gpus")
    if smi is not None and len(smi) != len(gpus):
        f.warn(f"NVML sees {len(gpus)} GPU(s), nvidia-smi {len(smi)}")
    names = sorted({g["name"] for g in gpus})
    return f.verdict(f"NVML: {len(gpus)} GPU(s) {', '.join(names)}; driver {info.get('driver_version')}, "
                     f"CUDA {info.get('cuda_version')}", expected=expected, data=info)


def judge_torch(res: CommandResult, inp: JudgeInput) -> Verdict:
    try:
        info = script_json(res, "torch/CUDA")
    except ScriptOutputError as exc:
        return script_error_verdict(exc, inp.ctx)
    driver_cuda = inp.dep_data("gpu.nvidia_smi").get("cuda_version") or inp.dep_data("gpu.nvml").get("cuda_version")
    expected = "torch with CUDA available, built for a CUDA the driver supports" + (
        f" (driver: CUDA {driver_cuda})" if driver_cuda else "")
    f = Findings()
    nvcc = info.get("nvcc") or {}
    if "torch_error" in info:
        f.fail(f"import torch failed: {info['torch_error']}", "install the CUDA build of torch that SGLang pins "
               f"({inp.ctx.python} -m pip install sglang installs it)")
    else:
        tv, tc = info.get("torch_version"), info.get("torch_cuda")
        if tc is None:
            f.fail(f"torch {tv} is a CPU-only build (torch.version.cuda is None)",
                   "install a CUDA build of torch (the one sglang pins)")
        elif not info.get("cuda_available"):
            f.fail(f"torch {tv} (CUDA {tc}): torch.cuda.is_available() is False: "
                   f"{info.get('cuda_error') or '(no reason given)'}",
                   "check the driver (gpu.nvidia_smi) and CUDA_VISIBLE_DEVICES")
        built, supported = version_tuple(tc), version_tuple(driver_cuda)  # None for a missing or odd version
        if built and supported and built > supported:
            f.fail(f"torch is built for CUDA {tc} but the driver supports up to CUDA {driver_cuda}",
                   "upgrade the NVIDIA driver or install a torch built for an older CUDA")
    if not nvcc.get("path"):
        f.warn("nvcc not found (searched " + ", ".join(nvcc.get("searched") or []) + ")",
               "install the CUDA toolkit or set CUDA_HOME if SGLang needs to JIT-compile kernels")
    elif nvcc.get("exit_status") not in (0, None) or nvcc.get("error"):
        f.warn(f"{nvcc['path']} --version failed: {nvcc.get('error') or last_line(nvcc.get('stderr', ''))}")
    actual = (f"torch {info.get('torch_version')} CUDA {info.get('torch_cuda')} available={info.get('cuda_available')} "
              f"devices={info.get('device_count')}; nvcc {nvcc.get('version')} at {nvcc.get('path')}"
              if "torch_error" not in info else f"torch: {info['torch_error']}; nvcc {nvcc.get('version')} at {nvcc.get('path')}")
    data = dict(info, driver_cuda=driver_cuda)
    return f.verdict(f"torch {info.get('torch_version')} CUDA {info.get('torch_cuda')} on {info.get('device_count')} "
                     f"device(s); driver CUDA {driver_cuda}; nvcc {nvcc.get('version')}",
                     expected=expected, actual=actual, data=data)


# ---------------------------------------------------------------------------------------------- disk


def df_command(path: str) -> str:
    """df of the nearest existing parent of `path` (the run dir need not exist yet)."""
    return (
        f"p={shell_path(path)}; while [ ! -e \"$p\" ]; do p=$(dirname -- \"$p\"); done; "
        "printf 'path=%s\\n' \"$p\"; if [ -w \"$p\" ]; then echo writable=yes; else echo writable=no; fi; "
        "df -Pk -- \"$p\""
    )


def parse_df(res: CommandResult) -> dict:
    info: dict[str, Any] = {}
    lines = res.stdout.splitlines()
    for line in lines:
        if line.startswith("path="):
            info["path"] = line[5:]
        elif line.startswith("writable="):
            info["writable"] = line.endswith("yes")
    table = [ln for ln in lines if not ln.startswith(("path=", "writable="))]
    if len(table) >= 2:
        cells = table[-1].split()
        if len(cells) >= 6:
            info.update(filesystem=cells[0], total=int(cells[1]) * 1024, used=int(cells[2]) * 1024,
                        free=int(cells[3]) * 1024, mount=" ".join(cells[5:]))
    return info


def estimate_run_bytes(inp: JudgeInput) -> tuple[int | None, str]:
    """Projected shard bytes from the prompt count (prompts.format) and prompt lengths (prompts.tokens)."""
    if inp.ctx.disk_need_bytes is not None:
        return inp.ctx.disk_need_bytes, "from the caller's projection"
    fmt = inp.dep_data("prompts.format")
    if not fmt.get("rows"):
        return None, "unknown: prompts.format reported no row count"
    rows = fmt["rows"]
    turns = fmt.get("user_turns_mean") or 1.0 if inp.ctx.turns == "all" else 1.0
    prompt_tokens = inp.dep_data("prompts.tokens").get("mean") or (fmt.get("row_bytes_mean") or 2000) / 4
    out_tokens = min(inp.ctx.max_new_tokens or OUTPUT_TOKENS_GUESS, OUTPUT_TOKENS_GUESS)
    samples = rows * turns
    need = int(samples * (prompt_tokens + out_tokens) * BYTES_PER_TOKEN)
    return need, (f"estimate: {rows} rows x {turns:.2f} turns x ({prompt_tokens:.0f} prompt + {out_tokens} output tokens) "
                  f"x {BYTES_PER_TOKEN} B/token")


def disk_judge(kind: str) -> Callable[[CommandResult, JudgeInput], Verdict]:
    def judge(res: CommandResult, inp: JudgeInput) -> Verdict:
        if res.exit_status != 0:
            return Verdict(Status.FAIL, shell_failure(res, "df"), actual=res.stderr.strip(),
                           remedy="check the path and that df exists on the host")
        info = parse_df(res)
        if "free" not in info:
            return Verdict(Status.ERROR, "could not parse df output", actual=res.stdout)
        ctx = inp.ctx
        if kind == "shm":
            need, how = ctx.shm_need_bytes, f"{gib(ctx.shm_need_bytes)} (1 GiB per GPU for NCCL and torch shared memory)"
            remedy = "enlarge /dev/shm: docker run --shm-size=32g, or mount -o remount,size=32G /dev/shm"
        else:
            projected, how = estimate_run_bytes(inp) if kind == "run_dir" else (None, "no run configured")
            need = ctx.disk_floor_bytes + (projected or 0)
            how = f"{size_text(need)} = the {size_text(ctx.disk_floor_bytes)} alert floor + projected shards " \
                  f"{size_text(projected)} ({how})"
            remedy = "free space on that filesystem or choose a run_dir on a bigger one"
        f = Findings()
        where = f"{info['path']} ({info['filesystem']} on {info['mount']})"
        if kind != "shm" and info.get("writable") is False:
            f.fail(f"{info['path']} is not writable by this user", "choose a run_dir the SSH user can write")
        if info["free"] < need:
            f.fail(f"{size_text(info['free'])} free at {where}, below the need of {size_text(need)}", remedy)
        elif info["free"] < 2 * need:
            f.warn(f"{size_text(info['free'])} free at {where}, less than 2x the need of {size_text(need)}", remedy)
        return f.verdict(f"{size_text(info['free'])} free of {size_text(info['total'])} at {where}; need {size_text(need)}",
                         expected=f"free >= {how}", actual=f"{size_text(info['free'])} free",
                         data=dict(info, need=need, need_basis=how))

    return judge


# ---------------------------------------------------------------------------------------------- model


def model_info(res: CommandResult) -> dict:
    return script_json(res, "model dir")


def missing_model_verdict(model: dict, expected: str, data: dict) -> Verdict:
    searched = model.get("hub_cache_searched")
    extra = f"; not in the Hugging Face cache either ({', '.join(searched)})" if searched else ""
    return Verdict(Status.FAIL, f"model dir {model.get('given')}: {model.get('error')}{extra}", expected,
                   model.get("error", ""), remedy="set model in the run config to the model directory on the host",
                   data=data)


def judge_model(res: CommandResult, inp: JudgeInput) -> Verdict:
    """config.json, tokenizer files and the chat template: what rendering prompts needs (weights: model.weights)."""
    try:
        info = model_info(res)
    except ScriptOutputError as exc:
        return script_error_verdict(exc, inp.ctx)
    ctx = inp.ctx
    model, tok = info.get("model", {}), info.get("tokenizer", {})
    path = model.get("path") or model.get("given")
    expected = "config.json, tokenizer files and a chat template"
    data: dict[str, Any] = {"model": model, "tokenizer": tok}
    if "path" not in model:
        return missing_model_verdict(model, expected, data)
    f = Findings()
    if not model.get("is_dir"):
        f.fail(f"model path {path} is not a directory")
        return f.verdict("", expected=expected, data=data)
    if model.get("list_error"):
        f.fail(f"cannot list {path}: {model['list_error']}")
    if model.get("config_error"):
        f.fail(f"{path}/config.json: {model['config_error']}", "the model dir needs the config.json of the model")
    cfg = model.get("config") or {}
    arch = ",".join(cfg.get("architectures") or []) or cfg.get("model_type") or "?"
    if "path" not in tok:
        f.fail(f"tokenizer {tok.get('given')}: {tok.get('error')}")
    elif not tok.get("files"):
        f.fail(f"no tokenizer files in {tok.get('path')} (looked for tokenizer.json, tokenizer_config.json, "
               "vocab.json+merges.txt, tokenizer.model)")
    if "path" in tok and not tok.get("chat_template"):
        f.fail(f"no chat template in {tok.get('path')} (tokenizer_config.json chat_template or chat_template.jinja)"
               + (f": {tok['chat_template_error']}" if tok.get("chat_template_error") else ""),
               "prompts are rendered with the model's own chat template; copy chat_template.jinja from the model repo")
    thinking = tok.get("thinking") or {}
    supports_thinking = bool(thinking.get("enable_thinking") or thinking.get("think_tag"))
    if tok.get("chat_template") and ctx.enable_thinking and not supports_thinking:
        f.warn("enable_thinking is on but the chat template never mentions enable_thinking or <think>")
    context = ctx.context_length or cfg.get("max_position_embeddings")
    if ctx.context_length and cfg.get("max_position_embeddings") and ctx.context_length > cfg["max_position_embeddings"]:
        f.warn(f"context_length {ctx.context_length} is above the model's max_position_embeddings "
               f"{cfg['max_position_embeddings']}")
    data.update(architecture=arch, context_length=context, supports_thinking=supports_thinking,
                chat_template_source=tok.get("chat_template_source"), path=path, tokenizer_path=tok.get("path"))
    summary = (f"{arch} at {path}: context {context}; tokenizer {tok.get('tokenizer_class') or '?'}; chat template "
               f"from {tok.get('chat_template_source')}, thinking {'yes' if supports_thinking else 'no'}")
    actual = (f"architecture {arch}; tokenizer files {tok.get('files')}; chat template {tok.get('chat_template_source')}")
    return f.verdict(summary, expected=expected, actual=actual, data=data)


def judge_weights(res: CommandResult, inp: JudgeInput) -> Verdict:
    """Weights present (every shard the index names) and their fit on the GPUs at tp_size."""
    try:
        info = model_info(res)
    except ScriptOutputError as exc:
        return script_error_verdict(exc, inp.ctx)
    ctx = inp.ctx
    model = info.get("model", {})
    path = model.get("path") or model.get("given")
    expected = f"weights in the model dir that fit the GPUs at tp_size {ctx.tp_size}"
    if "path" not in model or not model.get("is_dir"):
        # model.dir reports the path itself; a second FAIL for the same cause would be noise
        why = f"{path} is not a directory" if "path" in model else model.get("error") or f"{path} not found"
        return Verdict(Status.SKIP, f"no model dir to look in (see model.dir: {why})", expected, data={"model": model})
    f = Findings()
    weights = model.get("weights_bytes") or 0
    index = model.get("index") or {}
    if index.get("missing_shards"):
        f.fail(f"{index['name']} names {len(index['missing_shards'])} missing shard file(s) in {path}: "
               + ", ".join(index["missing_shards"][:5]), "finish downloading the model")
    if index.get("total_size") and not weights:
        weights = int(index["total_size"])
    if not weights:
        f.fail(f"no weights in {path} (no *.safetensors or *.bin files)",
               "download the weights into the model dir (huggingface-cli download MODEL --local-dir DIR)")
    gpus, source = gpu_memory_mib(inp)
    per_gpu = weights / max(1, ctx.tp_size)
    fit = None
    if weights and gpus:
        smallest = min(g["memory_total_mib"] for g in gpus) * (1 << 20)
        fit = {"weights_per_gpu": per_gpu, "gpu_memory": smallest, "share": per_gpu / smallest, "source": source}
        if per_gpu > smallest:
            f.fail(f"weights {gib(weights)} / tp {ctx.tp_size} = {gib(per_gpu)} per GPU exceed the GPU memory "
                   f"{gib(smallest)}", "raise workers.tp_size")
        elif per_gpu > KV_HEADROOM * smallest:
            f.warn(f"weights {gib(per_gpu)} per GPU leave little KV cache room on {gib(smallest)} GPUs",
                   "raise workers.tp_size")
    elif weights:
        why = ", ".join(f"{d} {inp.deps[d].status.value}" if d in inp.deps else f"{d} not run"
                        for d in ("gpu.nvidia_smi", "gpu.nvml"))
        f.warn(f"cannot check the fit on the GPUs: no GPU memory known ({why})")
    files = model.get("weights") or []
    fit_text = f"{gib(per_gpu)}/GPU at tp {ctx.tp_size} of {gib(fit['gpu_memory'])}" if fit else "fit unknown"
    return f.verdict(f"weights {gib(weights)} in {len(files)} file(s) at {path} ({fit_text})", expected=expected,
                     actual=f"weights {size_text(weights)} in {len(files)} file(s)",
                     data={"path": path, "weights": files, "weights_bytes": weights, "index": index, "fit": fit})


# ---------------------------------------------------------------------------------------------- prompts


def prompts_args(ctx: ProbeContext, mode: str) -> dict:
    args: dict[str, Any] = {"mode": mode, "patterns": list(ctx.prompts), "format": ctx.prompt_format}
    if mode in ("format", "tokens"):
        args["budget_s"] = ctx.scan_budget_s
    if mode == "tokens":
        args.update(tokenizer=ctx.tokenizer_path, enable_thinking=ctx.enable_thinking, turns=ctx.turns,
                    sample=ctx.sample_rows, ends=ctx.end_rows, longest=ctx.longest_rows)
    return args


def rows_read_words(files: list[dict], budget_s: float | None) -> tuple[str, bool]:
    """(`read 914,000 of 914,000 rows (every row)`, whether every row of every file was read)."""
    ok = [fr for fr in files if not fr.get("error")]
    read = sum(fr.get("read", 0) for fr in ok)
    rows = sum(fr.get("rows") or 0 for fr in ok)
    complete = all(fr.get("complete") for fr in ok)
    exact = all(fr.get("rows_exact") for fr in ok)
    if complete:
        return f"read {read:,} of {rows:,} rows (every row)", True
    why = sorted({fr.get("stopped") or "?" for fr in ok if not fr.get("complete")})
    budget = f" of {budget_s:g} s" if budget_s is not None and "time budget" in why else ""
    unknown = sum(1 for fr in ok if fr.get("rows") is None)
    total = f"{'' if exact else '~'}{rows:,} rows" + (f" and {unknown} file(s) of unknown rows" if unknown else "")
    return f"read {read:,} of {total} (stopped: {', '.join(why)}{budget})", False


def legacy_candidates(missing: list[dict]) -> dict:
    """The pre-finder `data.candidates` shape (files, searched, cut, ...), kept for readers of regen.probe/1."""
    searches = [m["candidates"] for m in missing if m.get("candidates")]
    files = [dict(c, similarity=c["closeness"], pattern=s["configured"]) for s in searches for c in s["candidates"]]
    return {"files": files, "total_found": sum(s["total"] for s in searches),
            "searched": list(dict.fromkeys(r for s in searches for r in s["roots"])),
            "unreadable": [u for s in searches for u in s["unlisted"]],
            "unreadable_count": sum(s["unlisted_count"] for s in searches),
            "unreadable_files": [u for s in searches for u in s["unreadable"]],
            "cut": next((s["cut"] for s in searches if s["cut"]), None)}


def missing_words(m: dict) -> str:
    """`work/chat.jsonl: cannot stat: [Errno 2] ...; best candidate: /x/work/data/prompts/chat.jsonl (...)`."""
    text = f"{m['pattern']}: {m['why']}: {m['error']}".rstrip(": ")
    search = m.get("candidates")
    if not search:
        return text
    best = search["candidates"][:1]
    if best:
        return text + "; best candidate: " + candidate_words(search_from_dict(search).candidates[0])
    return text + f"; no file named like {search['name']} found nearby"


def missing_remedy(missing: list[dict], config: str | None) -> str:
    where = f"`prompts` in {config}" if config else "`prompts` in the run config"
    best = [(m["pattern"], m["candidates"]["candidates"][0]["path"]) for m in missing
            if (m.get("candidates") or {}).get("candidates")]
    if best:
        return (f"set {where} to the best candidate (" + "; ".join(f"{p} -> {c}" for p, c in best)
                + "), or copy the files to those paths on the host")
    return f"fix {where} (the paths are read on the host), or copy the files to the host"


def judge_prompt_paths(res: CommandResult, inp: JudgeInput) -> Verdict:
    try:
        info = script_json(res, "prompt paths")
    except ScriptOutputError as exc:
        return script_error_verdict(exc, inp.ctx)
    files, missing = info.get("files", []), info.get("missing", [])
    expected = "every prompt path/glob names readable files: " + ", ".join(inp.ctx.prompts)
    total = sum(f.get("size") or 0 for f in files)
    if not missing:
        return Verdict(Status.PASS, f"{len(files)} file(s), {size_text(total)}: "
                       + ", ".join(f["path"] for f in files[:5]) + (" ..." if len(files) > 5 else ""),
                       expected, "\n".join(f"{f['path']} ({size_text(f.get('size'))})" for f in files),
                       data={"files": files})
    actual = []
    for m in missing:
        actual.append(f"{m['pattern']}: {m['why']}: {m['error']}".rstrip(": "))
        if m.get("candidates"):
            actual += ["  " + line for line in describe(m["candidates"])]
    return Verdict(Status.FAIL, "; ".join(missing_words(m) for m in missing), expected, "\n".join(actual),
                   remedy=missing_remedy(missing, inp.ctx.config_path),
                   data={"files": files, "missing": missing, "candidates": legacy_candidates(missing)})


def judge_prompt_format(res: CommandResult, inp: JudgeInput) -> Verdict:
    try:
        info = script_json(res, "prompt format")
    except ScriptOutputError as exc:
        return script_error_verdict(exc, inp.ctx)
    files = info.get("files", [])
    f = Findings()
    by_source: dict[str, int] = {}
    shapes: dict[str, int] = {}
    read = good = with_assistant = user_turns = rows = bytes_read = 0
    malformed: list[dict] = []
    malformed_total = 0
    for fr in files:
        if fr.get("error"):
            f.fail(f"{fr['path']}: {fr['error']}",
                   f"install pyarrow into {inp.ctx.python}" if fr.get("import_error") else "")
            continue
        read += fr["read"]
        good += fr["good"]
        with_assistant += fr["with_assistant"]
        user_turns += fr["user_turns"]
        rows += fr.get("rows") or 0
        bytes_read += fr.get("bytes_read") or 0
        malformed += fr["malformed"]
        malformed_total += fr["malformed_count"]
        for k, v in fr["by_source"].items():
            by_source[k] = by_source.get(k, 0) + v
        for k, v in fr["shapes"].items():
            shapes[k] = shapes.get(k, 0) + v
        if fr["read"] and not fr["good"]:
            f.fail(f"{fr['path']}: none of the {fr['read']:,} rows read is a usable conversation "
                   f"(first: {fr['malformed'][0]['where']}: {fr['malformed'][0]['reason']})",
                   "expected ShareGPT (conversations: [{from, value}]) or OpenAI (messages: [{role, content}]) rows")
        elif not fr["read"] and fr.get("complete"):
            f.warn(f"{fr['path']}: the file is empty ({fr.get('size')} bytes, no rows)")
    if files and not good and (read or all(fr.get("complete") for fr in files)) \
            and not any(fr.get("error") for fr in files):
        f.fail("no usable conversation in any prompt file")
    read_words, complete = rows_read_words(files, info.get("budget_s"))
    if malformed_total:
        f.warn(f"{malformed_total:,} malformed row(s) of the {read:,} read, e.g. "
               + "; ".join(f"{m['where']}: {m['reason']}" for m in malformed[:3]),
               "malformed rows are skipped and logged to rejects.jsonl; fix them at the source to keep them")
    if not complete and any(not fr.get("error") for fr in files):
        f.warn(f"not every row was checked: {read_words}",
               "the rows not read here are checked as the run reads them (each bad one to rejects.jsonl); "
               "`regen plan` reads every row")
    mixed = sum(v for k, v in shapes.items() if k.startswith("mixed"))
    if mixed:
        f.warn(f"{mixed} row(s) mix ShareGPT (from/value) and OpenAI (role/content) turns in one conversation")
    share = with_assistant / good if good else 0.0
    data = {"files": files, "read": read, "complete": complete, "good": good, "malformed_count": malformed_total,
            "malformed": malformed, "by_source": by_source, "shapes": shapes, "assistant_share": share,
            "rows": rows, "user_turns_mean": (user_turns / good) if good else None,
            "row_bytes_mean": (bytes_read / read) if read and bytes_read else None, "read_s": info.get("read_s")}
    actual = "\n".join(
        [f"{read_words} in " + (f"{info['read_s']:.1f} s" if info.get("read_s") is not None else "?")]
        + [f"{fr['path']}: {fr.get('format')}, "
           + (f"{fr['rows']:,} rows{'' if fr.get('rows_exact') else ' (estimated)'}" if fr.get("rows") is not None
              else "rows unknown") + ", "
         f"read {fr['read']:,}{'' if fr.get('complete') else ' (stopped: ' + str(fr.get('stopped')) + ')'}, "
         f"good {fr['good']:,}, malformed {fr['malformed_count']:,}"
         if not fr.get("error") else f"{fr['path']}: {fr['error']}" for fr in files]
        + [f"  {m['where']}: {m['reason']}" for m in malformed[:20]]
        + ([f"  ... {malformed_total - 20} more"] if malformed_total > 20 else []))
    summary = (f"{read_words} in {len(files)} file(s): {good:,} good; shapes "
               + ", ".join(f"{k} {v:,}" for k, v in shapes.items())
               + f"; {share:.0%} already have assistant answers; sources: "
               + ", ".join(f"{k} {v:,}" for k, v in sorted(by_source.items(), key=lambda kv: -kv[1])[:5]))
    return f.verdict(summary, expected=f"every row in a known shape (every row read, within {inp.ctx.scan_budget_s:g} s)",
                     actual=actual, data=data)


def judge_prompt_tokens(res: CommandResult, inp: JudgeInput) -> Verdict:
    try:
        info = script_json(res, "prompt tokens")
    except ScriptOutputError as exc:
        return script_error_verdict(exc, inp.ctx)
    tok = info.get("tokens") or {}
    ctx = inp.ctx
    model = inp.dep_data("model.dir")
    context = model.get("context_length") or ctx.context_length
    limit = prompt_input_limit(context) if context else None
    expected = (f"prompts under SGLang's input limit ({limit:,} tokens: context {context:,} - 6) with room for "
                f"max_new_tokens {ctx.max_new_tokens}" if limit else "prompt lengths (the context is unknown)")
    if tok.get("error"):
        remedy = f"install transformers into {ctx.python}" if tok.get("stage") == "import" else \
            "check the tokenizer files in the model dir"
        return Verdict(Status.FAIL, tok["error"], expected, tok["error"], remedy, data=tok)
    f = Findings()
    lengths = tok.pop("lengths", [])
    checked = tok.pop("checked_lengths", [])
    read_words, complete = rows_read_words(info.get("files", []), info.get("budget_s"))
    how = f"{read_words}; rendered {tok.get('checked', len(checked)):,}: {tok.get('how', '')}"
    if tok.get("template_failure_count"):
        f.warn(f"the chat template failed on {tok['template_failure_count']} rendered row(s), e.g. "
               + "; ".join(f"{x['where']}: {x['reason']}" for x in tok["template_failures"][:3]))
    if not lengths:
        f.fail("no row read could be rendered through the chat template")
        return f.verdict("", expected=expected, actual=how, data=tok)
    over = [t for t in tok.get("top", []) if limit and t["tokens"] >= limit]
    over_n = sum(1 for n in checked if limit and n >= limit)
    longest = tok.get("longest_lengths") or []
    # every one of the longest-by-characters rows is over the limit: more rows than those may be
    at_least = "at least " if limit and longest and len(longest) >= tok.get("longest_asked", 0) > 0 \
        and min(longest) >= limit else ""
    p50, p99 = tok["p50"], tok["p99"]
    if limit:
        if p50 >= limit:
            f.fail(f"half the prompts are over SGLang's input limit {limit:,} (context {context:,}; p50 {p50:,})",
                   "raise context_length (if the model allows it) or filter the prompts")
        elif over_n:
            rows_read = sum(fr.get("read", 0) for fr in info.get("files", []) if not fr.get("error"))
            f.warn(f"{at_least}{over_n:,} prompt(s) over SGLang's input limit of {limit:,} tokens (context "
                   f"{context:,}), found among {len(checked):,} rendered of {rows_read:,} rows read (the longest by "
                   "characters included): those turns are rejected, not generated, each to rejects.jsonl; e.g. "
                   + ", ".join(f"{t['where']} ({t['tokens']:,} tokens)" for t in over[:3]),
                   "filter those rows out of the prompt files to keep the counts true, or raise context_length (a "
                   "model whose context allows it)")
        elif ctx.max_new_tokens and p99 + ctx.max_new_tokens > context:
            f.warn(f"p99 prompt {p99} + max_new_tokens {ctx.max_new_tokens} > context {context}: long answers will be "
                   "cut at the context length (finish_reason length)")
    if not complete:
        f.warn(f"not every row was read: {read_words}",
               "the rows not read here are checked as the run reads them (an over-long prompt is a reject); "
               "`regen plan` reads every row")
    tok.update(context_length=context, input_limit=limit, over_context=over_n, over_examples=over[:10],
               read_words=read_words, complete=complete)
    return f.verdict(f"prompt tokens p50 {p50} / p90 {tok['p90']} / p99 {p99} / max {tok['max']} over {len(lengths)} "
                     f"rows spread over the file(s) and the {len(longest)} longest; {read_words}; context {context}",
                     expected=expected,
                     actual=f"p50 {p50}, p90 {tok['p90']}, p99 {p99}, max {tok['max']}, mean {tok['mean']:.0f}\n{how}"
                     + "".join(f"\n  {t['where']}: {t['tokens']:,} tokens" for t in tok.get("top", [])[:5]),
                     data=tok)


# ---------------------------------------------------------------------------------------------- ports, run dir


def judge_ports(res: CommandResult, inp: JudgeInput) -> Verdict:
    try:
        info = script_json(res, "ports")
    except ScriptOutputError as exc:
        return script_error_verdict(exc, inp.ctx)
    ports = info.get("ports", [])
    f = Findings()
    for p in ports:
        if p["free"]:
            continue
        holders = p.get("holders") or []
        if holders and all(h.get("run_worker") for h in holders):
            # never "stop that process": it is this run's own server, and the run is live (run_dir.resume says so)
            f.warn(f"port {p['port']} on {info['host']} is held by this run's own server "
                   f"{holders[0]['run_worker']} (pid {holders[0]['pid']}): the run is live",
                   "watch it with `regen status` / `regen tui`; to start it again, `regen stop` it first")
            continue
        who = ", ".join(f"pid {h['pid']} ({h['cmdline']})" for h in holders) or (p.get("holders_note") or "holder unknown")
        f.fail(f"port {p['port']} on {info['host']} is busy ({p['error']}); held by {who}",
               "stop that process or set workers.base_port to a free range")
    first, last = inp.ctx.base_port, inp.ctx.base_port + len(ports) - 1
    return f.verdict(f"ports {first}..{last} free on {info.get('host')}",
                     expected=f"{len(ports)} worker port(s) {first}..{last} free on {info.get('host')}",
                     actual=", ".join(f"{p['port']} {'free' if p['free'] else 'busy'}" for p in ports), data=info)


def changed_fields(old: dict, new: dict) -> list[str]:
    changed = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += [f"{key}.{k} {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            changed.append(f"{key} {a!r} -> {b!r}")
    return changed


def judge_resume(res: CommandResult, inp: JudgeInput) -> Verdict:
    try:
        info = script_json(res, "run dir")
    except ScriptOutputError as exc:
        return script_error_verdict(exc, inp.ctx)
    ctx = inp.ctx
    rd = info.get("run_dir")
    expected = "a new run dir, or one started with the same content fields (same hash)"
    if info.get("exists") is False:
        return Verdict(Status.PASS, f"new run: {rd} does not exist yet", expected, info.get("stat_error", ""),
                       data=dict(info, mode="new"))
    if info.get("exists") is None:
        return Verdict(Status.FAIL, f"cannot stat {rd}: {info.get('error')}", expected, data=info)
    if not info.get("is_dir"):
        return Verdict(Status.FAIL, f"{rd} exists and is not a directory", expected,
                       remedy="choose another run_dir", data=info)
    f = Findings()
    if info.get("error"):
        f.fail(f"cannot list {rd}: {info['error']}")
    if not info.get("writable"):
        f.fail(f"{rd} is not writable by this user")
    own = ""  # the console asking is attached to this run: its live supervisor is the run's own, not a rival
    if info.get("supervisor_alive"):
        if ctx.attached:
            own = f"this run's supervisor (pid {info['supervisor_pid']}) runs it"
        else:
            f.fail(f"a supervisor (pid {info['supervisor_pid']}) already runs this run dir {rd}",
                   "watch it with `regen status` / `regen tui`, or `regen stop` it before starting it again")
    if info.get("db_error"):
        f.fail(f"{rd}/state.sqlite: {info['db_error']}")
    stored = info.get("content_hash")
    mode = "new"
    if not info.get("state_db") and not info.get("run_toml"):
        if info.get("entry_count") and not info.get("deployed"):
            f.fail(f"{rd} is not empty and is not a regen run dir (no state.sqlite or run.toml; it has "
                   f"{', '.join(info.get('entries', [])[:8])})", "choose an empty or new directory")
        summary = f"new run: {rd} exists and is empty"
    elif stored is None:
        summary = f"{rd} has no content hash recorded yet: starting records it (new run)"
    elif ctx.content_hash is None or stored == ctx.content_hash:
        mode = "resume"
        summary = f"resumable: {rd} was started with the same content (hash {stored[:12]}); " \
                  f"{info.get('samples_committed', 0)} samples committed"
    else:
        changes = changed_fields(info.get("content_fields") or {}, ctx.content_fields)
        from_model = [c for c in changes if c.split(" ")[0] in {f"sampling.{k}" for k in ctx.sampling_from_model}]
        changes = [c for c in changes if c not in from_model]
        note = (f" ({', '.join(c.split(' ')[0] for c in from_model)}: taken from the model's generation_config.json "
                "on the host at the start, checked there)") if from_model else ""
        if not changes:
            mode = "resume"
            summary = f"resumable: {rd}; {info.get('samples_committed', 0)} samples committed{note}"
        elif not info.get("samples_committed"):
            mode = "changed-empty"
            summary = (f"{rd} has no committed sample: the changed config is taken (changed: {', '.join(changes)})"
                       f"{note}")
        else:
            mode = "changed"
            f.fail(f"not resumable: {rd} was started with another config and has {info.get('samples_committed')} "
                   f"samples committed; changed: {', '.join(changes)}{note}",
                   "set run_dir to a new directory to start over with these values, or revert these fields to resume")
            summary = ""
    if own and mode == "resume":
        mode, summary = "live", f"live: {own}; {info.get('samples_committed', 0)} samples committed"
    return f.verdict(summary, expected=expected, actual=f"stored hash {stored}, config hash {ctx.content_hash}",
                     data=dict(info, mode=mode))


# ---------------------------------------------------------------------------------------------- the catalog


def model_dir_command(ctx: ProbeContext) -> str:
    return python_command(ctx, "model_dir", {"model": ctx.model, "tokenizer": ctx.tokenizer_path})


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
