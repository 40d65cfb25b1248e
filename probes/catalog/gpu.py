"""Probes of the GPUs: nvidia-smi, NVML, torch's CUDA build against the driver.
"""
from __future__ import annotations

import re
from typing import TypedDict

from probes.catalog.output import (
    ScriptOutputError,
    last_line,
    script_error_verdict,
    script_json,
    shell_failure,
    version_tuple,
)
from probes.catalog.probe import Findings, JudgeInput, Verdict
from probes.context import (
    ProbeContext,
)
from probes.model import CommandResult, Status

NVSMI_QUERY = "index,name,memory.total,memory.used,driver_version"
NVSMI_APPS = "pid,process_name,used_memory"
HEADER_MARK = "@@regen:nvidia-smi-header"
APPS_MARK = "@@regen:nvidia-smi-compute-apps"
NVCC_FALLBACKS = ("/usr/local/cuda/bin/nvcc",)  # where nvcc usually is when not on PATH (CUDA_HOME is tried first)
BUSY_GPU_MIB = 1024  # memory already used on a configured GPU above this is worth a warning


def gpu_memory_mib(inp: JudgeInput) -> tuple[list[dict], str]:
    """Per-GPU facts from gpu.nvidia_smi (else gpu.nvml): the configured GPUs when a config names them."""
    for pid in ("gpu.nvidia_smi", "gpu.nvml"):
        gpus = inp.dep_data(pid).get("gpus")
        if gpus:
            wanted = set(inp.ctx.gpus)
            chosen = [g for g in gpus if not wanted or g["index"] in wanted]
            return chosen or gpus, pid
    return [], ""


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
