"""Config-free probes on this machine (FAIL side: no GPU, no sglang, no torch) and with fake GPU tools (PASS side)."""
from __future__ import annotations

import dataclasses
import json
import os

from probes.catalog.output import python_command
from probes.model import Status
from tests.test_probes_fakes import context, gpu_env, probe, run_local, write_exe


def test_config_free_set_runs_and_connection_passes():
    res = run_local(context())
    assert list(res) == ["connection", "host.python", "packages", "gpu.nvidia_smi", "gpu.nvml", "cuda.torch",
                         "disk.home", "disk.shm"]
    conn = res["connection"]
    assert conn.status is Status.PASS
    assert conn.summary.startswith("connected as ")
    assert conn.data["user"] and conn.data["kernel"].startswith("Linux")


def test_host_python_pass_and_missing_interpreter():
    res = run_local(context(), {"host.python"})
    assert res["host.python"].status is Status.PASS
    assert res["host.python"].summary.startswith("Python 3.")

    res = run_local(context(python="/opt/nowhere/bin/python3"))
    r = res["host.python"]
    assert r.status is Status.FAIL
    assert r.exit_status == 127
    assert "/opt/nowhere/bin/python3: not found" in r.summary  # the shell's own words
    assert "/opt/nowhere/bin/python3: not found" in r.stderr
    # everything that needs the interpreter is SKIP, naming it
    assert res["packages"].status is Status.SKIP
    assert res["packages"].summary == "needs host.python, which is FAIL"


def test_host_python_too_old(tmp_path):
    old = write_exe(tmp_path / "python3.8", "#!/bin/sh\n"
                    "echo '{\"executable\": \"/usr/bin/python3.8\", \"version\": [3, 8, 10], \"prefix\": \"/usr\", "
                    "\"base_prefix\": \"/usr\"}'\n")
    r = run_local(context(python=str(old)), {"host.python"})["host.python"]
    assert r.status is Status.FAIL
    assert "Python 3.8.10" in r.summary and "too old" in r.summary


def test_packages_fail_names_sglang_with_import_error_text():
    r = run_local(context(), {"packages"})["packages"]
    assert r.status is Status.FAIL
    assert "sglang: ModuleNotFoundError: No module named 'sglang'" in r.summary
    assert "pyarrow" not in r.summary  # installed ones are not blamed
    pkgs = r.data["packages"]
    assert pkgs["pyarrow"]["ok"] and pkgs["pyarrow"]["version"]
    assert pkgs["sglang"]["error"] == "ModuleNotFoundError: No module named 'sglang'"
    assert "pip install sglang" in r.remedy


def test_packages_pass_with_sglang_present(monkeypatch, tmp_path):
    gpu_env(monkeypatch, tmp_path)
    r = run_local(context(), {"packages"})["packages"]
    assert r.status is Status.PASS, r.summary
    assert "sglang 0.5.5.post3" in r.summary
    assert "transformers" in r.summary


def test_packages_broken_import_and_crash(monkeypatch, tmp_path):
    libs = tmp_path / "libs"
    (libs / "sglang").mkdir(parents=True)
    (libs / "sglang" / "__init__.py").write_text("import os\nos._exit(139)\n")  # dies like a segfaulting extension
    (libs / "orjson.py").write_text("raise ImportError('libfoo.so.1: cannot open shared object file')\n")
    monkeypatch.setenv("PYTHONPATH", str(libs))
    r = run_local(context(), {"packages"})["packages"]
    assert r.status is Status.FAIL
    assert "orjson: ImportError: libfoo.so.1: cannot open shared object file" in r.summary
    assert "importing sglang crashed the interpreter (exit 139)" in r.summary


def test_nvidia_smi_missing_is_fail_with_shell_text():
    r = run_local(context(), {"gpu.nvidia_smi"})["gpu.nvidia_smi"]
    assert r.status is Status.FAIL
    assert r.exit_status == 127
    assert r.summary == "nvidia-smi not found (exit 127): /bin/sh: 1: nvidia-smi: not found"
    assert r.stderr.strip() == "/bin/sh: 1: nvidia-smi: not found"
    assert "2>/dev/null" not in r.command


def test_nvidia_smi_pass_two_h200(monkeypatch, tmp_path):
    gpu_env(monkeypatch, tmp_path)
    r = run_local(context(gpus=(0, 1)), {"gpu.nvidia_smi"})["gpu.nvidia_smi"]
    assert r.status is Status.PASS, r.summary
    assert r.summary.startswith("2 GPU(s): NVIDIA H200; 280 GiB total; driver 570.124.06, CUDA 12.8")
    assert r.data["gpus"][1] == {"index": 1, "name": "NVIDIA H200", "memory_total_mib": 143771, "memory_used_mib": 1,
                                 "driver_version": "570.124.06"}
    assert r.data["processes"] == []


def test_nvidia_smi_warns_on_processes_holding_vram_and_fails_on_missing_gpu(monkeypatch, tmp_path):
    query = "0, NVIDIA H200, 143771, 70312, 570.124.06\n1, NVIDIA H200, 143771, 1, 570.124.06\n"
    gpu_env(monkeypatch, tmp_path, query=query, apps="4242, /usr/bin/python3, 70300\n")
    r = run_local(context(gpus=(0, 1)), {"gpu.nvidia_smi"})["gpu.nvidia_smi"]
    assert r.status is Status.WARN
    assert "GPU 0 already has 70312 MiB in use" in r.summary
    assert "pid 4242 /usr/bin/python3 (70300 MiB)" in r.summary
    r = run_local(context(gpus=(0, 1, 2, 3)), {"gpu.nvidia_smi"})["gpu.nvidia_smi"]
    assert r.status is Status.FAIL
    assert "configured GPU(s) [2, 3] not present (host has [0, 1])" in r.summary


def test_nvml_fail_real_text_and_pass_fake(monkeypatch, tmp_path):
    r = run_local(context(), {"gpu.nvml"})["gpu.nvml"]
    assert r.status is Status.FAIL
    assert r.summary == "pynvml nvmlInit() failed: NVMLError_LibraryNotFound: NVML Shared Library Not Found"
    gpu_env(monkeypatch, tmp_path)
    res = run_local(context(), {"gpu.nvml", "gpu.nvidia_smi"})
    r = res["gpu.nvml"]
    assert r.status is Status.PASS, r.summary
    assert r.summary == "NVML: 2 GPU(s) NVIDIA H200; driver 570.124.06, CUDA 12.8"


def test_torch_fail_real_and_pass_fake(monkeypatch, tmp_path):
    r = run_local(context(), {"cuda.torch"})["cuda.torch"]
    assert r.status is Status.FAIL
    assert "import torch failed: ModuleNotFoundError: No module named 'torch'" in r.summary
    gpu_env(monkeypatch, tmp_path)
    res = run_local(context(), {"cuda.torch", "gpu.nvidia_smi"})
    r = res["cuda.torch"]
    assert r.status is Status.PASS, r.summary
    assert "torch 2.8.0+cu128 CUDA 12.8 on 2 device(s); driver CUDA 12.8" in r.summary
    assert r.data["nvcc"]["path"]  # the real toolkit of this machine


def test_torch_newer_than_driver_fails(monkeypatch, tmp_path):
    gpu_env(monkeypatch, tmp_path, torch_cuda="12.9", cuda="12.4")
    r = run_local(context(), {"cuda.torch", "gpu.nvidia_smi"})["cuda.torch"]
    assert r.status is Status.FAIL
    assert "torch is built for CUDA 12.9 but the driver supports up to CUDA 12.4" in r.summary


def test_torch_without_nvcc_warns(monkeypatch, tmp_path):
    _bin, _libs = gpu_env(monkeypatch, tmp_path)
    monkeypatch.setenv("PATH", f"{_bin}:/bin")  # no /usr/local/bin: no nvcc on PATH
    monkeypatch.delenv("CUDA_HOME", raising=False)
    no_fallback = dataclasses.replace(
        probe("cuda.torch"), command=lambda c: python_command(c, "torch_cuda", {"nvcc_candidates": []}))
    catalog = [probe("connection"), probe("host.python"), probe("gpu.nvidia_smi"), no_fallback]
    r = run_local(context(), catalog=catalog)["cuda.torch"]
    assert r.status is Status.WARN
    assert r.summary.startswith("nvcc not found (searched PATH=")


def test_disk_home_and_shm_pass_and_fail_below_need():
    res = run_local(context(), {"disk.home", "disk.shm"})
    home, shm = res["disk.home"], res["disk.shm"]
    assert home.status is Status.PASS, home.summary
    assert home.data["path"] == os.path.expanduser("~")
    assert shm.data["path"] == "/dev/shm"
    res = run_local(context(disk_floor_bytes=10**18, shm_need_bytes=10**18), {"disk.home", "disk.shm"})
    assert res["disk.home"].status is Status.FAIL
    assert "below the need of 1000000000.0 GB" in res["disk.home"].summary
    assert res["disk.shm"].status is Status.FAIL


def test_disk_warns_below_twice_the_need():
    free = run_local(context(), {"disk.home"})["disk.home"].data["free"]
    r = run_local(context(disk_floor_bytes=int(free * 0.7)), {"disk.home"})["disk.home"]
    assert r.status is Status.WARN
    assert "less than 2x the need" in r.summary


def test_json_report_round_trips():
    from tests.test_probes_fakes import probe_local
    import asyncio

    report = asyncio.run(probe_local(context(), {"connection"}))
    d = json.loads(json.dumps(report.to_dict()))
    assert d["schema"] == "regen.probe/1"
    assert d["summary"]["PASS"] == 1
    keys = {"id", "title", "status", "summary", "expected", "actual", "command", "exit_status", "stdout", "stderr",
            "duration_s", "remedy", "data"}
    assert keys <= set(d["probes"][0])


def test_packages_timeout_names_the_import_that_hung(monkeypatch, tmp_path):
    libs = tmp_path / "libs"
    (libs / "sglang").mkdir(parents=True)
    (libs / "sglang" / "__init__.py").write_text("import signal\nsignal.pause()\n")  # e.g. CUDA init that never returns
    for name in ("transformers", "pyarrow", "psutil", "pynvml", "aiohttp", "orjson", "prometheus_client"):
        (libs / f"{name}.py").write_text("__version__ = '1.0'\n")  # instant imports: only sglang is slow
    monkeypatch.setenv("PYTHONPATH", str(libs))
    r = run_local(context(), {"packages"}, timeout_s=3)["packages"]
    assert r.status is Status.ERROR
    assert r.summary.startswith("timed out after 3s while importing sglang")
