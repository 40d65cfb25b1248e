"""Helpers for the probe tests (no tests here): fake GPU tools for the PASS side, configs, a runner.

The FAIL side of every GPU probe is this real machine (no GPU, no sglang, no torch). The PASS
side puts a fake `nvidia-smi` on PATH and fake `pynvml` / `torch` / `sglang` packages on
PYTHONPATH, printing what two H200s print.
"""
from __future__ import annotations

import asyncio
import os
import stat
import sys
import textwrap
from pathlib import Path

from console.host.connect import open_transport
from probes.catalog import CATALOG
from probes.catalog.probe import Probe
from probes.context import ProbeContext
from probes.model import ProbeReport
from probes.runner import run_probes

HOST_PYTHON = sys.executable  # the venv's python: has transformers, pyarrow, psutil, pynvml; no sglang, no torch
REPO = Path(__file__).resolve().parents[1]

H200_QUERY = "0, NVIDIA H200, 143771, 1, 570.124.06\n1, NVIDIA H200, 143771, 1, 570.124.06\n"
H200_HEADER = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 570.124.06             Driver Version: 570.124.06     CUDA Version: 12.8     |
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
|=========================================+========================+======================|
|   0  NVIDIA H200                    On  |   00000000:18:00.0 Off |                    0 |
|   1  NVIDIA H200                    On  |   00000000:2A:00.0 Off |                    0 |
+-----------------------------------------+------------------------+----------------------+
"""


def write_exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_nvidia_smi(bin_dir: Path, *, query: str = H200_QUERY, apps: str = "", cuda: str = "12.8") -> Path:
    """A `nvidia-smi` that answers the three invocations the gpu.nvidia_smi probe makes."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "query.csv").write_text(query)
    (bin_dir / "apps.csv").write_text(apps)
    (bin_dir / "header.txt").write_text(H200_HEADER.replace("CUDA Version: 12.8", f"CUDA Version: {cuda}"))
    d = str(bin_dir)
    return write_exe(bin_dir / "nvidia-smi", textwrap.dedent(f"""\
        #!/bin/sh
        case "$1" in
          --query-gpu=*) cat '{d}/query.csv' ;;
          --query-compute-apps=*) cat '{d}/apps.csv' ;;
          "") cat '{d}/header.txt' ;;
          *) echo "nvidia-smi: unknown option $1" >&2; exit 2 ;;
        esac
        """))


def fake_gpu_libs(lib_dir: Path, *, torch_cuda: str = "12.8", torch_version: str = "2.8.0",
                  with_sglang: bool = True) -> Path:
    """pynvml, torch (and sglang) packages that behave as on a 2x H200 host. transformers would use a fake
    torch >= 2.6 (and break on it), so a run that also loads tokenizers asks for torch_version < 2.6."""
    lib_dir.mkdir(parents=True, exist_ok=True)
    (lib_dir / "pynvml.py").write_text(textwrap.dedent("""\
        from collections import namedtuple
        _Mem = namedtuple("_Mem", "total free used")
        def nvmlInit(): pass
        def nvmlShutdown(): pass
        def nvmlSystemGetDriverVersion(): return "570.124.06"
        def nvmlSystemGetCudaDriverVersion(): return 12080
        def nvmlDeviceGetCount(): return 2
        def nvmlDeviceGetHandleByIndex(i): return i
        def nvmlDeviceGetName(h): return "NVIDIA H200"
        def nvmlDeviceGetMemoryInfo(h): return _Mem(143771 << 20, 143000 << 20, 771 << 20)
        """))
    torch = lib_dir / "torch"
    torch.mkdir(exist_ok=True)
    (torch / "__init__.py").write_text(textwrap.dedent(f"""\
        __version__ = "{torch_version}+cu{torch_cuda.replace('.', '')}"
        from torch import version, cuda
        """))
    (torch / "version.py").write_text(f"cuda = {torch_cuda!r}\n")
    (torch / "cuda.py").write_text(textwrap.dedent("""\
        def is_available(): return True
        def device_count(): return 2
        def get_device_name(i): return "NVIDIA H200"
        def init(): pass
        """))
    if with_sglang:
        (lib_dir / "sglang").mkdir(exist_ok=True)
        (lib_dir / "sglang" / "__init__.py").write_text('__version__ = "0.5.5.post3"\n')
    return lib_dir


def gpu_env(monkeypatch, tmp_path: Path, **kw) -> tuple[Path, Path]:
    """Put the fakes on PATH / PYTHONPATH of this process (the local transport's commands inherit them)."""
    bin_dir = tmp_path / "fakebin"
    fake_nvidia_smi(bin_dir, **{k: v for k, v in kw.items() if k in ("query", "apps", "cuda")})
    libs = fake_gpu_libs(tmp_path / "fakelibs", **{k: v for k, v in kw.items() if k in ("torch_cuda", "torch_version", "with_sglang")})
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("PYTHONPATH", str(libs))
    return bin_dir, libs


def write_run_toml(path: Path, *, run_dir: Path, model: Path, prompts: list[str], base_port: int = 39000,
                   gpus: str = "[0, 1]", tp: int = 1, extra: str = "", python: str = HOST_PYTHON) -> Path:
    prompts_toml = "[" + ", ".join(f'"{p}"' for p in prompts) + "]"
    path.write_text(textwrap.dedent(f"""\
        run_dir = "{run_dir}"
        model = "{model}"
        prompts = {prompts_toml}
        host_python = "{python}"
        {extra}
        [workers]
        gpus = {gpus}
        tp_size = {tp}
        base_port = {base_port}
        """))
    return path


def context(**kw) -> ProbeContext:
    kw.setdefault("python", HOST_PYTHON)
    return ProbeContext(**kw)


def config_context(tmp_path: Path, model: Path, prompts: list[str], **kw) -> ProbeContext:
    kw.setdefault("run_dir", str(tmp_path / "run"))
    kw.setdefault("gpus", (0, 1))
    kw.setdefault("base_port", 39000)
    kw.setdefault("max_new_tokens", 1024)
    kw.setdefault("sample_rows", 200)
    return context(has_config=True, model=str(model), prompts=tuple(prompts), **kw)


async def probe_local(ctx: ProbeContext, only: set[str] | None = None, *, catalog: list[Probe] | None = None,
                      timeout_s: float | None = None) -> ProbeReport:
    transport = await open_transport("local")
    try:
        return await run_probes(transport, "local", ctx, only, catalog=catalog, timeout_s=timeout_s)
    finally:
        await transport.close()


def run_local(ctx: ProbeContext, only: set[str] | None = None, **kw) -> dict:
    """id -> ProbeResult."""
    report = asyncio.run(probe_local(ctx, only, **kw))
    return {r.id: r for r in report.results}


def probe(probe_id: str) -> Probe:
    return next(p for p in CATALOG if p.id == probe_id)


def write_jsonl(path: Path, rows: list) -> Path:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sharegpt(i: int, turns: int = 1) -> dict:
    conv = []
    for t in range(turns):
        conv += [{"from": "human", "value": f"question {i}.{t}: explain caching"}, {"from": "gpt", "value": f"answer {i}"}]
    return {"id": f"sg-{i}", "conversations": conv}


def openai(i: int) -> dict:
    return {"id": f"oa-{i}", "source": "oa-src", "messages": [{"role": "system", "content": "be brief"},
                                                             {"role": "user", "content": f"what is {i} squared?"}]}


def add_weights(model_dir: Path, size: int = 4096) -> Path:
    """A weights file of `size` bytes (sparse, so a 'huge' model costs no disk)."""
    w = model_dir / "model.safetensors"
    with open(w, "wb") as f:
        f.truncate(size)
    return w
