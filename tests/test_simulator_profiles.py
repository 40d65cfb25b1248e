"""Each simulated SGLang version (--sim-sglang-version) says its batch size where that version does, and no more.

shared/reference/sglang_contract.md 7.1 and 7.6: `max_running_requests` is null in /get_server_info unless the
flag was passed; the scheduler's working batch, derived from the KV pool, is in
internal_states[i].effective_max_running_requests_per_dp from 0.5.10 and in the start-up log line in every
version; /server_info and /model_info exist from 0.5.10 (the /get_* paths kept).
"""
from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest

from engine.simulator import parse_args
from engine.simulator.profiles import DEFAULT_VERSION, PROFILES
from tests.sim_fixtures import start_sim  # noqa: F401  (fixture)
from tests.test_simulator import metric_samples, post

pytestmark = pytest.mark.timeout(60)
VERSIONS = sorted(PROFILES, key=lambda v: tuple(map(int, v.split("."))))
STARTUP = re.compile(r"^\[[\d\- :]+\] max_total_num_tokens=(\d+), chunked_prefill_size=\d+, max_prefill_tokens=\d+, "
                     r"max_running_requests=(\d+), context_len=\d+, available_gpu_mem=[\d.]+ GB$", re.M)


async def get_json(url: str) -> tuple[int, dict | None]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as resp:
            body = await resp.read()
            return resp.status, json.loads(body) if resp.status == 200 else None


def startup_batch(log: str) -> int:
    found = STARTUP.findall(log)
    assert len(found) == 1, log
    return int(found[0][1])


def test_the_default_profile_is_the_newest_and_an_unknown_one_names_the_versions(tiny_model_dir, capsys):
    assert DEFAULT_VERSION == VERSIONS[-1] == "0.5.23"
    assert parse_args(["--model-path", str(tiny_model_dir)]).sim_sglang_version == "0.5.23"
    assert parse_args(["--model-path", str(tiny_model_dir), "--sim-sglang-version", "0.5.5"]).profile.version == "0.5.5"
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tiny_model_dir), "--sim-sglang-version", "0.4.10"])
    assert "--sim-sglang-version 0.4.10: not a simulated SGLang version; known: 0.5.5, 0.5.10, 0.5.23" in \
        capsys.readouterr().err


@pytest.mark.parametrize("version", VERSIONS)
async def test_an_unset_batch_is_null_in_server_info_derived_from_the_pool_and_logged(start_sim, version):
    # a 600-token KV pool: SGLang runs min(600 // 2, its request slots) = 300
    sim = await start_sim(sim_sglang_version=version, max_total_tokens=600)
    assert startup_batch(sim.log) == 300
    assert sim.server.scheduler.max_running == 300
    new = version != "0.5.5"
    for path in ("/get_server_info", "/server_info"):
        status, info = await get_json(sim.url + path)
        if path == "/server_info" and not new:
            assert status == 404  # 0.5.5 has only /get_server_info
            continue
        assert status == 200
        assert info["max_running_requests"] is None
        assert info["version"].startswith(PROFILES[version].reported_version)
        state = info["internal_states"][0]
        assert state["max_running_requests"] is None
        if new:
            assert state["effective_max_running_requests_per_dp"] == 300
        else:
            assert "effective_max_running_requests_per_dp" not in state
    status, model = await get_json(sim.url + "/model_info")
    assert status == (200 if new else 404)
    status, old_model = await get_json(sim.url + "/get_model_info")
    assert status == 200 and ("architectures" in old_model) == new  # an alias of /model_info from 0.5.10
    if new:
        assert model == old_model


@pytest.mark.parametrize("version", VERSIONS)
async def test_the_flag_is_reported_everywhere(start_sim, version):
    sim = await start_sim(sim_sglang_version=version, max_running_requests=12)
    assert startup_batch(sim.log) == 12
    _, info = await get_json(sim.url + "/get_server_info")
    assert info["max_running_requests"] == 12 and info["internal_states"][0]["max_running_requests"] == 12
    assert info["internal_states"][0].get("effective_max_running_requests_per_dp") == (12 if version != "0.5.5" else None)


def test_without_a_flag_the_batch_is_bounded_by_the_request_slots(tiny_model_dir):
    # an H200-sized pool gives thousands of slots; --sim-max-num-reqs stands in for a smaller slot pool
    # (a hybrid model's mamba cache): the batch is min(pool // 2, slots)
    from engine.simulator.server import SimServer

    default = SimServer(parse_args(["--model-path", str(tiny_model_dir)]))
    assert 2048 <= default.running_limit <= 4096
    small = SimServer(parse_args(["--model-path", str(tiny_model_dir), "--sim-max-num-reqs", "5"]))
    assert small.running_limit == 5 and small.cfg.max_running_requests is None


async def test_the_scheduler_really_runs_the_unreported_batch(start_sim):
    sim = await start_sim(sim_sglang_version="0.5.5", sim_max_num_reqs=3, enable_metrics=True, sim_output_mean=200,
                          sim_output_sigma=0.0, sim_step_ms=3.0, decode_log_interval=5)
    _, info = await get_json(sim.url + "/get_server_info")
    assert info["max_running_requests"] is None and startup_batch(sim.log) == 3
    tasks = [asyncio.create_task(post(sim.url + "/generate", {"rid": f"q{i}", "text": f"prompt {i}",
                                                              "sampling_params": {"max_new_tokens": 1000}}))
             for i in range(7)]
    running_seen = queue_seen = 0.0
    while not all(t.done() for t in tasks):
        async with aiohttp.ClientSession() as session:
            async with session.get(sim.url + "/metrics") as resp:
                samples = metric_samples(await resp.text())
        running_seen = max(running_seen, samples["sglang:num_running_reqs"])
        queue_seen = max(queue_seen, samples["sglang:num_queue_reqs"])
        await asyncio.wait(tasks, timeout=0.02)  # the next sample, or sooner when the requests are answered
    assert all(status == 200 for status, _ in [await t for t in tasks])
    assert running_seen == 3 and queue_seen > 0
