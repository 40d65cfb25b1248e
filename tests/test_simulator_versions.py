"""The simulator's per-version behaviours of the contract's section 7 (stops, seeds, limits, streaming,
duplicate rids, /health, keep-alive, metric series), each as a client sees it.

shared/reference/sglang_contract.md 7.2-7.6; tests/test_simulator_conformance.py checks the same facts as a
table per profile, field by field; this file covers what needs a sequence of requests or a clock.
"""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.simulator import parse_args
from engine.simulator.profiles import PROFILES
from tests.sim_fixtures import start_sim  # noqa: F401  (fixture)
from tests.test_simulator import chat_prompt, get, post
from tests.waiting import await_until

pytestmark = pytest.mark.timeout(90)
VERSIONS = sorted(PROFILES, key=lambda v: tuple(map(int, v.split("."))))


def series(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every labelled sample of one metric: {sorted label items: value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


async def stream(url: str, payload: dict) -> list[dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/generate", json=dict(payload, stream=True)) as resp:
            assert resp.status == 200
            body = (await resp.read()).decode()
    events = [line[len("data: "):] for line in body.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# --- stops (7.2) -----------------------------------------------------------------------------------------------
async def test_stop_token_ids_cut_the_output_keep_the_token_in_ids_and_trim_it_from_text(start_sim, tiny_tokenizer):
    sim = await start_sim(sim_output_mean=80, sim_output_sigma=0.0)
    ids = chat_prompt(tiny_tokenizer, "Tell me something.")
    base = {"rid": "s1", "input_ids": ids}
    _, full = await post(sim.url + "/generate", dict(base, sampling_params={"max_new_tokens": 500,
                                                                            "skip_special_tokens": False}))
    out = full["output_ids"]
    k = next(i for i in range(len(out) // 2, len(out) - 1) if out[i] not in out[:i])  # a first occurrence
    stop_id = out[k]
    for no_trim in (False, True):
        _, cut = await post(sim.url + "/generate", dict(base, sampling_params={
            "max_new_tokens": 500, "skip_special_tokens": False, "stop_token_ids": [stop_id], "no_stop_trim": no_trim}))
        assert cut["output_ids"] == out[: k + 1]  # the matched token stays in output_ids ...
        assert cut["meta_info"]["completion_tokens"] == k + 1  # ... and is counted
        assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
        shown = out[: k + 1] if no_trim else out[:k]  # ... but is cut from text unless no_stop_trim
        assert cut["text"] == tiny_tokenizer.decode(shown, skip_special_tokens=False)


async def test_stop_strings_cut_at_the_first_match_and_text_ends_before_it(start_sim, tiny_tokenizer):
    sim = await start_sim(sim_output_mean=80, sim_output_sigma=0.0)
    base = {"rid": "s2", "input_ids": chat_prompt(tiny_tokenizer, "Tell me more.")}
    _, full = await post(sim.url + "/generate", dict(base, sampling_params={"max_new_tokens": 500}))
    words = full["text"].split("</think>")[-1].split()
    word = next(w for w in words[2:] if w.isalpha() and len(w) > 3)
    pos = full["text"].find(word)
    _, cut = await post(sim.url + "/generate", dict(base, sampling_params={"max_new_tokens": 500, "stop": [word, "zzzz"]}))
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert cut["text"] == full["text"][:pos]
    n = len(cut["output_ids"])
    assert cut["output_ids"] == full["output_ids"][:n] and cut["meta_info"]["completion_tokens"] == n
    assert word in tiny_tokenizer.decode(cut["output_ids"]) and word not in tiny_tokenizer.decode(cut["output_ids"][:-1])
    _, kept = await post(sim.url + "/generate", dict(base, sampling_params={"max_new_tokens": 500, "stop": word,
                                                                            "no_stop_trim": True}))
    assert kept["output_ids"] == cut["output_ids"] and kept["text"] == tiny_tokenizer.decode(cut["output_ids"])

    # stop_regex: matched is the pattern, and the detokenizer looks the pattern up literally, so nothing is cut
    _, rx = await post(sim.url + "/generate", dict(base, sampling_params={"max_new_tokens": 500,
                                                                          "stop_regex": f"{word[:2]}[a-z]+"}))
    assert rx["meta_info"]["finish_reason"] == {"type": "stop", "matched": f"{word[:2]}[a-z]+"}
    assert len(rx["output_ids"]) <= n and rx["text"] == tiny_tokenizer.decode(rx["output_ids"])

    status, body = await post(sim.url + "/generate", dict(base, sampling_params={"stop_token_ids": "7"}))
    assert status == 400 and "stop_token_ids must be a list of integers" in body["error"]["message"]


async def test_stops_apply_on_the_instant_path_too(start_sim, tiny_tokenizer):
    sim = await start_sim(sim_instant=True, sim_instant_pool=8, sim_output_mean=80)
    _, full = await post(sim.url + "/generate", {"rid": "i1", "input_ids": [5, 6, 7],
                                                 "sampling_params": {"max_new_tokens": 500, "skip_special_tokens": False}})
    assert full["text"] == tiny_tokenizer.decode(full["output_ids"][:-1], skip_special_tokens=False)
    stop_id = full["output_ids"][3]
    _, cut = await post(sim.url + "/generate", {"rid": "i1", "input_ids": [5, 6, 7], "sampling_params": {
        "max_new_tokens": 500, "stop_token_ids": [stop_id]}})
    k = full["output_ids"].index(stop_id)
    assert cut["output_ids"] == full["output_ids"][: k + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


# --- seeds (7.3) ---------------------------------------------------------------------------------------------------
async def test_sampling_seed_is_ignored_unless_deterministic_inference(start_sim, tiny_tokenizer):
    ids = chat_prompt(tiny_tokenizer, "Seeds?")

    async def answer(sim, rid: str, seed: int) -> list[int]:
        _, out = await post(sim.url + "/generate", {"rid": rid, "input_ids": ids,
                                                    "sampling_params": {"max_new_tokens": 300, "sampling_seed": seed}})
        return out["output_ids"]

    plain = await start_sim()
    assert await answer(plain, "a", 1) == await answer(plain, "a", 2)  # the seed changes nothing
    assert await answer(plain, "a", 1) != await answer(plain, "b", 1)  # (sampling differs per request)
    det = await start_sim(enable_deterministic_inference=True)
    assert await answer(det, "a", 1) == await answer(det, "b", 1)  # same prompt, same seed: same output
    assert await answer(det, "a", 1) != await answer(det, "a", 2)
    assert parse_args(["--model-path", str(plain.server.cfg.model_path),
                       "--enable-deterministic-inference"]).enable_deterministic_inference


# --- limits (7.4) --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pool, context", [(100_000, 64), (40, 4096)])
async def test_prompt_limit_is_min_context_and_pool_less_5_and_max_new_tokens_is_capped(start_sim, pool, context):
    sim = await start_sim(max_total_tokens=pool, context_length=context)
    max_req_len = min(context - 1, pool - 1)
    limit = max_req_len - 5
    status, body = await post(sim.url + "/generate", {"input_ids": [9] * limit, "sampling_params": {"max_new_tokens": None}})
    assert status == 400
    assert body == {"error": {"message": f"Input length ({limit} tokens) exceeds the maximum allowed length "
                                         f"({limit} tokens). Use a shorter input or enable --allow-auto-truncate."}}
    status, out = await post(sim.url + "/generate", {"input_ids": [9] * (limit - 1), "sampling_params": {
        "max_new_tokens": None if context < pool else 1000, "ignore_eos": True}})
    cap = max_req_len - (limit - 1) - 1
    assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": cap}
    assert len(out["output_ids"]) == cap


@pytest.mark.parametrize("version", VERSIONS)
async def test_repetition_penalty_range_per_version(start_sim, version):
    sim = await start_sim(sim_sglang_version=version)
    status, body = await post(sim.url + "/generate", {"text": "x", "sampling_params": {"repetition_penalty": 0}})
    if PROFILES[version].repetition_penalty_excludes_zero:
        assert status == 400 and body["error"]["message"] == ("repetition_penalty must be in (0, 2] (1.0 = "
                                                                "no penalty), got 0.")
    else:
        assert status == 200
    status, body = await post(sim.url + "/generate", {"text": "x", "sampling_params": {"repetition_penalty": 2.5}})
    assert status == 400 and "repetition_penalty must be in" in body["error"]["message"]


# --- streaming (7.6) -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", VERSIONS)
async def test_streamed_ids_are_new_ids_in_0_5_5_and_cumulative_after(start_sim, version):
    sim = await start_sim(sim_sglang_version=version)
    payload = {"rid": "st", "text": "stream me", "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
    _, whole = await post(sim.url + "/generate", payload)
    chunks = await stream(sim.url, payload)
    assert len(chunks) > 2 and chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 30}
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["text"] == whole["text"]  # text is cumulative in every version
    if PROFILES[version].stream_ids_cumulative:
        assert chunks[-1]["output_ids"] == whole["output_ids"]
        assert all(whole["output_ids"][: len(c["output_ids"])] == c["output_ids"] for c in chunks)
    else:
        assert [i for c in chunks for i in c["output_ids"]] == whole["output_ids"]
        assert len(chunks[-1]["output_ids"]) < 30


@pytest.mark.parametrize("version", VERSIONS)
async def test_incremental_streaming_output_streams_deltas(start_sim, tiny_model_dir, version):
    flag = "--incremental-streaming-output" if PROFILES[version].has_incremental_streaming_flag else "--stream-output"
    cfg = parse_args(["--model-path", str(tiny_model_dir), "--sim-sglang-version", version, flag])
    assert cfg.incremental_streaming_output
    sim = await start_sim(sim_sglang_version=version, incremental_streaming_output=True)
    payload = {"rid": "inc", "text": "stream me", "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
    _, whole = await post(sim.url + "/generate", payload)
    chunks = await stream(sim.url, payload)
    assert [i for c in chunks for i in c["output_ids"]] == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]


def test_0_5_5_has_no_incremental_streaming_output_flag(tiny_model_dir, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tiny_model_dir), "--sim-sglang-version", "0.5.5",
                    "--incremental-streaming-output"])
    assert "--incremental-streaming-output: not a flag of SGLang 0.5.5" in capsys.readouterr().err


# --- duplicate in-flight rid (7.4) ----------------------------------------------------------------------------------
@pytest.mark.parametrize("version", VERSIONS)
async def test_duplicate_in_flight_rid_overwritten_in_0_5_5_refused_after(start_sim, version):
    sim = await start_sim(sim_sglang_version=version, sim_step_ms=5.0)
    first = asyncio.create_task(post(sim.url + "/generate", {"rid": "dup", "text": "one", "sampling_params": {
        "max_new_tokens": 200, "ignore_eos": True}}))
    await await_until(lambda: "dup" in sim.server.in_flight_rids, 10, "the first 'dup' request in flight")
    status, body = await post(sim.url + "/generate", {"rid": "dup", "text": "two", "sampling_params": {
        "max_new_tokens": 5, "ignore_eos": True}})
    if PROFILES[version].refuses_duplicate_rid:
        assert status == 400 and body == {"error": {"message": "Duplicate request ID(s) detected: dup"}}
        status, _ = await first
        assert status == 200
        return
    assert status == 200 and body["meta_info"]["id"] == "dup"
    # the earlier request's state was replaced: it runs to the end but its client never gets an answer
    await await_until(lambda: sim.server.scheduler.num_running == 0, 20, "the first request to finish running")
    assert not first.done()
    first.cancel()


# --- /health (7.4) -----------------------------------------------------------------------------------------------------
async def test_health_waits_a_second_and_runs_a_one_token_generation(start_sim):
    sim = await start_sim(enable_metrics=True)
    before = sim.log.count("Prefill batch, #new-seq: 1, #new-token: 1,")
    started = time.monotonic()
    status, _ = await get(sim.url + "/health")
    assert status == 200 and time.monotonic() - started >= 1.0
    assert sim.log.count("Prefill batch, #new-seq: 1, #new-token: 1,") == before + 1  # the scheduler ran it
    _, text = await get(sim.url + "/metrics")
    assert series(text, "sglang:num_requests_total") == {(("model_name", sim.server.cfg.model_name),): 0.0}


# --- keep-alive (7.4) ------------------------------------------------------------------------------------------------
async def test_an_idle_keep_alive_connection_is_closed_after_5_s(start_sim):
    sim = await start_sim()
    reader, writer = await asyncio.open_connection("127.0.0.1", sim.server.port)
    writer.write(b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    idle_from = time.monotonic()
    rest = await asyncio.wait_for(reader.read(), 15)  # returns at EOF: the server closed the pooled connection
    idle = time.monotonic() - idle_from
    writer.close()
    assert rest == b"" and 4.5 <= idle <= 10, idle


# --- metric series (7.5) -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["0.5.10", "0.5.23"])
async def test_priority_scheduling_exports_a_total_and_per_priority_series(start_sim, version):
    sim = await start_sim(sim_sglang_version=version, enable_metrics=True, enable_priority_scheduling=True,
                          decode_log_interval=2, sim_step_ms=5.0)
    tasks = [asyncio.create_task(post(sim.url + "/generate", {"text": f"p{i}", "priority": p, "sampling_params": {
        "max_new_tokens": 400, "ignore_eos": True}})) for i, p in enumerate((1, 2, 2))]

    async def running() -> dict:
        _, text = await get(sim.url + "/metrics")
        # (a priority with nothing running, e.g. the warmup's default one, stays exported at 0)
        return {dict(k).get("priority"): v for k, v in series(text, "sglang:num_running_reqs").items() if v}

    if PROFILES[version].priority_labelled_metrics:
        seen = await await_until(lambda: _ready(running, {"": 3.0, "1": 1.0, "2": 2.0}), 10, "per-priority series")
        assert seen == {"": 3.0, "1": 1.0, "2": 2.0}
    else:
        assert await await_until(lambda: _ready(running, {None: 3.0}), 10, "one unlabelled series") == {None: 3.0}
    for t in tasks:
        t.cancel()


async def _ready(probe, expected: dict):
    got = await probe()
    return got if got == expected else None


@pytest.mark.parametrize("all_schedulers", [False, True])
async def test_every_tp_rank_exports_with_metrics_for_all_schedulers(start_sim, all_schedulers):
    sim = await start_sim(enable_metrics=True, tp_size=2, enable_metrics_for_all_schedulers=all_schedulers)
    _, text = await get(sim.url + "/metrics")
    ranks = sorted(dict(k)["tp_rank"] for k in series(text, "sglang:token_usage"))
    assert ranks == (["0", "1"] if all_schedulers else ["0"])
