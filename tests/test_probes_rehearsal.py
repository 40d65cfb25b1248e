"""A rehearsal (workers.launch runs the SGLang simulator) is not a broken host (issue 13, case 7).

On this GPU-less machine (no nvidia-smi, no NVML, no torch, no sglang) and with the tiny model (tokenizer,
template and config, no weights): the simulator config passes with the GPU probes SKIP "rehearsal: simulated
GPUs"; the same config with SGLang's launch still FAILs them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from console.commands.demo import demo_config
from console.commands.probe import context_from_config
from engine.config.load import DEFAULT_LAUNCH, SIMULATOR_LAUNCH
from probes.context import is_rehearsal
from tests.sshd_fixtures import free_port_base
from tests.test_probes_fakes import REPO, sharegpt, write_jsonl, write_run_toml

GPU_PROBES = ("gpu.nvidia_smi", "gpu.nvml", "cuda.torch", "model.weights")


def regen(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "console.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200"))


def run_toml(tmp_path: Path, model: Path, launch: str | None) -> Path:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    write_jsonl(data / "chat.jsonl", [sharegpt(i, turns=2) for i in range(12)])
    path = write_run_toml(tmp_path / ("sim.toml" if launch else "real.toml"), run_dir=tmp_path / "runs" / "r1",
                          model=model, prompts=[str(data / "chat.jsonl")], base_port=free_port_base(2))
    if launch:  # [workers] is the file's last table
        path.write_text(path.read_text() + f"launch = {json.dumps(launch)}\n")
    return path


def by_id(report: dict) -> dict[str, dict]:
    return {p["id"]: p for p in report["probes"]}


def test_is_rehearsal_reads_the_launch_command(tmp_path):
    assert is_rehearsal(SIMULATOR_LAUNCH) and not is_rehearsal(DEFAULT_LAUNCH)
    assert is_rehearsal("/opt/venv/bin/python -m engine.simulator --port {port}")
    assert not is_rehearsal("{python} -m engine.simulator_old --port {port}")
    assert not is_rehearsal("") and not is_rehearsal(None)
    demo = demo_config(tmp_path, tmp_path / "model", [str(tmp_path / "p.jsonl")], 2, [])  # what `regen demo` runs
    assert context_from_config(demo).rehearsal


def test_rehearsal_config_skips_the_gpu_probes_and_passes(tmp_path, tiny_model_dir):
    cfg = run_toml(tmp_path, tiny_model_dir, SIMULATOR_LAUNCH)
    proc = regen("probe", "local", "--config", str(cfg), "--json")
    report = json.loads(proc.stdout)
    assert report["rehearsal"] is True
    probes = by_id(report)
    for pid in GPU_PROBES:
        assert (probes[pid]["status"], probes[pid]["summary"]) == ("SKIP", "rehearsal: simulated GPUs"), pid
        assert probes[pid]["data"] == {"rehearsal": True}
    assert probes["packages"]["status"] == "PASS", probes["packages"]["summary"]
    assert probes["packages"]["summary"].endswith("; sglang not needed (rehearsal)")
    assert "sglang: not needed (rehearsal: simulated GPUs)" in probes["packages"]["actual"]
    assert probes["prompts.tokens"]["status"] == "PASS"  # tokenizer and template; the tiny model has no weights
    bad = {p: r["summary"] for p, r in probes.items() if r["status"] not in ("PASS", "WARN", "SKIP")}
    assert bad == {} and proc.returncode == 0, (bad, proc.stderr)
    assert report["summary"]["SKIP"] == len(GPU_PROBES)


def test_rehearsal_report_header_says_so(tmp_path, tiny_model_dir):
    cfg = run_toml(tmp_path, tiny_model_dir, SIMULATOR_LAUNCH)
    proc = regen("probe", "local", "--config", str(cfg))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == ("rehearsal: workers.launch runs the SGLang simulator (-m engine.simulator); the GPU, CUDA, "
                        "sglang and weights probes are SKIP (simulated GPUs)")
    assert lines[1].startswith("regen probe local (rehearsal)")
    skip_rows = [ln for ln in lines if "rehearsal: simulated GPUs" in ln]
    assert len(skip_rows) == len(GPU_PROBES) and all("SKIP" in ln for ln in skip_rows)
    assert "╭─ SKIP" not in proc.stdout  # no evidence panel for what the header explains
    total = next(ln for ln in reversed(lines) if " probes in " in ln)  # the effective sampling follows it
    assert total.endswith(f"SKIP {len(GPU_PROBES)}") and "FAIL" not in total and "ERROR" not in total


def test_sglang_launch_on_a_gpu_less_host_still_fails(tmp_path, tiny_model_dir):
    cfg = run_toml(tmp_path, tiny_model_dir, None)  # DEFAULT_LAUNCH: sglang.launch_server
    proc = regen("probe", "local", "--config", str(cfg), "--json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert report["rehearsal"] is False
    probes = by_id(report)
    assert {pid: probes[pid]["status"] for pid in ("packages", *GPU_PROBES)} == {
        "packages": "FAIL", "gpu.nvidia_smi": "FAIL", "gpu.nvml": "FAIL", "cuda.torch": "FAIL", "model.weights": "FAIL"}
    assert "sglang: ModuleNotFoundError: No module named 'sglang'" in probes["packages"]["summary"]
    # weights still downloading: prompt lengths are checked anyway (tokenizer and template are there)
    assert probes["model.dir"]["status"] == "PASS"
    assert probes["prompts.tokens"]["status"] == "PASS", probes["prompts.tokens"]["summary"]


@pytest.mark.parametrize("only", ["gpu", "cuda.torch"])
def test_only_a_gpu_probe_in_a_rehearsal_is_skip_not_fail(tmp_path, tiny_model_dir, only):
    cfg = run_toml(tmp_path, tiny_model_dir, SIMULATOR_LAUNCH)
    proc = regen("probe", "local", "--config", str(cfg), "--json", "--only", only)
    assert proc.returncode == 0
    report = json.loads(proc.stdout)
    assert [p["status"] for p in report["probes"] if p["id"].startswith(only)] and \
        all(p["status"] == "SKIP" for p in report["probes"] if p["id"].startswith(only))
