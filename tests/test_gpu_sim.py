"""A rehearsal's VRAM: the SGLang simulator's modelled GPUs, read by the supervisor where NVML is unavailable."""
from __future__ import annotations

import json

import pytest

from engine.servers.gpu import GpuSampler
from engine.simulator.gpu import CONTEXT_GB, GRAPH_GB, SIM_GPU_NAME, SimGpus, gpu_indices
from tests.test_engine_run import make_config, supervisors, wait_for  # noqa: F401 (fixture)


def test_the_simulators_gpus_are_the_ones_regen_gave_it():
    assert gpu_indices("2,3", 0, 2) == [2, 3]
    assert gpu_indices(None, 4, 2) == [4, 5]
    assert gpu_indices("GPU-uuid", 1, 1) == [1]


def test_memory_held_grows_to_the_whole_kv_pool_at_readiness_and_util_follows_the_busy_time():
    gpus = SimGpus([0, 1], total_gb=139.8, weight_gb=27.0, kv_pool_gb=90.0)
    loading = gpus.readings(ready=False, busy_s=0.0, now=100.0)
    assert [g["index"] for g in loading] == [0, 1] and {g["name"] for g in loading} == {SIM_GPU_NAME}
    assert loading[0]["mem_used_mb"] == round((CONTEXT_GB + 27.0) * 1024, 1) and loading[0]["util_pct"] is None
    ready = gpus.readings(ready=True, busy_s=1.5, now=102.0)
    assert ready[0]["mem_used_mb"] == round((CONTEXT_GB + 27.0 + 90.0 + GRAPH_GB) * 1024, 1)
    assert ready[0]["mem_total_mb"] == round(139.8 * 1024, 1) and ready[0]["util_pct"] == 75.0


def test_a_rehearsal_without_nvml_reports_the_simulators_gpus(tmp_path, tiny_model_dir, supervisors):  # noqa: F811
    if GpuSampler().available:
        pytest.skip("NVML reads this machine's GPUs: a rehearsal here shows those")
    run_dir = tmp_path / "run"
    # answers of ~300 tokens at 40 ms a step: the run lasts several 2 s ticks, each with a reading
    cfg = make_config(run_dir, tiny_model_dir, prompts=200,
                      sim=("--sim-step-ms", "40", "--sim-output-mean", "300", "--sim-gpu-mem-gb", "80"))
    cfg = cfg.model_copy(update=dict(workers=cfg.workers.model_copy(update=dict(api_key="k-s3cret-key"))))
    sup = supervisors(run_dir).start(cfg)

    def simulated() -> dict[int, dict]:
        path = run_dir / "telemetry.jsonl"
        text = path.read_text() if path.exists() else ""
        whole = text[:text.rfind("\n") + 1]  # a line still being written is read next time
        events = [json.loads(line) for line in whole.splitlines() if line]
        return {e["index"]: e for e in events if e["type"] == "gpu" and e.get("name") == SIM_GPU_NAME}

    found = wait_for(lambda: len(simulated()) == 2 and simulated(), 90, "both GPUs' simulated readings", sup)
    for index in (0, 1):
        g = found[index]
        assert g["error"] is None and g["mem_total_mb"] == 80 * 1024
        assert 0 < g["mem_used_mb"] <= g["mem_total_mb"] and g["temp_c"] is None
