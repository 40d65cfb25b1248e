"""A stand-in for nvidia-ml-py's `pynvml`, for the multi-host tests: copied as pynvml.py into a simulated
host's work dir (the host agent's cwd, which `python -m` puts first on sys.path), it makes that host's NVML
say what fake_nvml.json beside it says: {"error": "..."} (nvmlInit fails with it) or {"gpus": [{"name",
"used_mb", "total_mb", "util", "temp_c", "power_w"}]}. So a test sees which agent sampled a reading."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

NVML_TEMPERATURE_GPU = 0
_SPEC = json.loads((Path(__file__).with_name("fake_nvml.json")).read_text())


class NVMLError(Exception):
    pass


def nvmlInit() -> None:
    if "error" in _SPEC:
        raise NVMLError(_SPEC["error"])


def nvmlShutdown() -> None:
    return None


def nvmlDeviceGetCount() -> int:
    return len(_SPEC["gpus"])


def nvmlDeviceGetHandleByIndex(i: int) -> dict:
    return _SPEC["gpus"][i]


def nvmlDeviceGetName(h: dict) -> str:
    return h["name"]


def nvmlDeviceGetMemoryInfo(h: dict) -> SimpleNamespace:
    return SimpleNamespace(used=h["used_mb"] * 2**20, total=h["total_mb"] * 2**20)


def nvmlDeviceGetUtilizationRates(h: dict) -> SimpleNamespace:
    return SimpleNamespace(gpu=h["util"])


def nvmlDeviceGetTemperature(h: dict, sensor: int) -> int:
    return h["temp_c"]


def nvmlDeviceGetPowerUsage(h: dict) -> int:
    return int(h["power_w"] * 1000)
