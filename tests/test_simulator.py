"""The SGLang simulator in-process: real aiohttp server on 127.0.0.1, real tokenizer, real HTTP client."""
from __future__ import annotations

import asyncio
import json
import re
import statistics

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.simulator import SimConfig, parse_args, throughput
from tests.sim_fixtures import start_sim  # noqa: F401  (fixture)
from tests.waiting import await_until

pytestmark = pytest.mark.timeout(60)


async def post(url: str, payload: dict, headers: dict | None = None) -> tuple[int, object]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=payload, headers=headers) as resp:
            body = await resp.read()
            try:
                return resp.status, (await resp.json(content_type=None)) if body else None
            except ValueError:
                return resp.status, body.decode()


async def get(url: str, headers: dict | None = None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url, headers=headers) as resp:
            return resp.status, await resp.text()


def metric_samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels.get("le"):
                out[sample.name] = sample.value
    return out


def chat_prompt(tok, content: str, *, enable_thinking: bool = True) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=enable_thinking)
    return tok.encode(text, add_special_tokens=False)


# --- startup and readiness -----------------------------------------------------------------------------
async def test_health_is_503_while_loading_then_200_with_ready_line(start_sim):
    sim = await start_sim(ready=False, sim_load_s=1.5)
    status, _ = await get(sim.url + "/health")
    assert status == 503
    status, body = await get(sim.url + "/get_model_info")
    assert status == 200 and '"is_generation":true' in body
    assert "The server is fired up and ready to roll!" not in sim.log
    await sim.server.wait_ready(15)
    assert (await get(sim.url + "/health"))[0] == 200
    log = sim.log
    assert re.search(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] server_args=ServerArgs\(model_path=", log, re.M)
    assert re.search(r"KV Cache is allocated\. #tokens: \d+, K size: [\d.]+ GB", log)
    line = re.search(r"max_total_num_tokens=(\d+), chunked_prefill_size=\d+, max_prefill_tokens=\d+, "
                     r"max_running_requests=(\d+), context_len=40960, available_gpu_mem=[\d.]+ GB", log)
    assert line, log
    pool, batch = int(line.group(1)), int(line.group(2))
    assert batch == min(pool // 2, min(max(int(pool / 40960 * 512), 2048), 4096)) > 64  # derived from the KV pool
    assert f"Uvicorn running on http://127.0.0.1:{sim.server.port} (Press CTRL+C to quit)" in log
    assert log.index("Uvicorn running on") < log.index("The server is fired up and ready to roll!")


async def test_info_endpoints(start_sim):
    sim = await start_sim(max_running_requests=8, context_length=4096, served_model_name="Qwen/Qwen3-27B")
    status, body = await get(sim.url + "/get_server_info")
    info = json.loads(body)
    assert status == 200
    assert info["max_running_requests"] == 8 and info["context_length"] == 4096
    assert info["status"] == "ready" and info["max_total_num_tokens"] > 0 and info["max_req_input_len"] == 4090  # min(ctx - 1, pool - 1) - 5 (contract 7.4)
    assert info["internal_states"][0]["memory_usage"]["token_capacity"] == info["max_total_num_tokens"]
    assert "last_gen_throughput" in info["internal_states"][0]
    assert info["version"].startswith("0.5.23")  # the default profile: the newest version
    assert (await get(sim.url + "/server_info"))[0] == 200
    status, body = await get(sim.url + "/v1/models")
    models = json.loads(body)
    assert models["data"][0]["id"] == "Qwen/Qwen3-27B" and models["data"][0]["max_model_len"] == 4096
    status, body = await get(sim.url + "/get_load")
    assert json.loads(body) == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert (await get(sim.url + "/ping"))[0] == 200
    status, body = await get(sim.url + "/model_info")
    assert status == 200 and '"architectures":["Qwen3ForCausalLM"]' in body
    assert (await get(sim.url + "/metrics"))[0] == 404  # only with --enable-metrics


# --- /generate ------------------------------------------------------------------------------------------
async def test_generate_fields_ids_end_with_im_end_and_text_has_it_cut(start_sim, tiny_tokenizer):
    sim = await start_sim(sim_output_mean=80, sim_output_sigma=0.3)
    ids = chat_prompt(tiny_tokenizer, "What is two plus two?")
    status, out = await post(sim.url + "/generate", {
        "rid": "job-1", "input_ids": ids,
        "sampling_params": {"max_new_tokens": 4000, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}})
    assert status == 200
    meta = out["meta_info"]
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert meta["id"] == "job-1"
    assert meta["finish_reason"] == {"type": "stop", "matched": im_end}
    assert out["output_ids"][-1] == im_end
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(out["output_ids"])
    assert set(meta) >= {"id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
                         "completion_tokens", "cached_tokens", "e2e_latency", "queue_time", "reasoning_tokens"}
    assert out["text"] == tiny_tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert out["text"].startswith("<think>\n") and "\n</think>\n\n" in out["text"]
    reasoning = out["text"].split("</think>")[0]
    assert len(tiny_tokenizer.encode(reasoning)) > len(tiny_tokenizer.encode(out["text"].split("</think>")[1]))
    assert 0 < meta["reasoning_tokens"] < meta["completion_tokens"]

    status, again = await post(sim.url + "/generate", {
        "rid": "job-1", "input_ids": ids, "sampling_params": {"max_new_tokens": 4000, "skip_special_tokens": False}})
    assert again["output_ids"] == out["output_ids"]  # deterministic per (seed, rid)
    # the matched stop token is cut from text even with the special tokens kept (contract 7.2)
    assert again["text"] == tiny_tokenizer.decode(out["output_ids"][:-1], skip_special_tokens=False)
    status, other = await post(sim.url + "/generate", {"rid": "job-2", "input_ids": ids})
    assert other["output_ids"] != out["output_ids"]


async def test_max_new_tokens_truncates_with_finish_reason_length(start_sim, tiny_tokenizer):
    sim = await start_sim(sim_output_mean=500, sim_output_sigma=0.0)
    status, out = await post(sim.url + "/generate", {"text": "Explain attention.", "sampling_params": {
        "max_new_tokens": 17}})
    assert status == 200
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 17}
    assert len(out["output_ids"]) == 17 and "</think>" not in out["text"]
    assert out["meta_info"]["reasoning_tokens"] == 16  # unclosed thinking: all but <think>
    status, default = await post(sim.url + "/generate", {"text": "Explain attention."})
    assert default["meta_info"]["finish_reason"] == {"type": "length", "length": 128}  # SGLang's default


async def test_thinking_disabled_prompt_gets_no_think_block(start_sim, tiny_tokenizer):
    sim = await start_sim()
    ids = chat_prompt(tiny_tokenizer, "Say hi", enable_thinking=False)
    status, out = await post(sim.url + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 4000}})
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "stop"
    assert "<think>" not in out["text"] and "</think>" not in out["text"]
    assert out["meta_info"]["reasoning_tokens"] == 0


async def test_empty_share_is_exact_and_reproducible(start_sim, tiny_tokenizer):
    sim = await start_sim(sim_empty_share=1.0)
    ids = chat_prompt(tiny_tokenizer, "Anything")
    _, out = await post(sim.url + "/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 100, "skip_special_tokens": False}})
    expected = tiny_tokenizer.encode("<think>\n\n</think>\n\nOK.<|im_end|>", add_special_tokens=False)
    assert out["output_ids"] == expected
    assert out["text"] == "<think>\n\n</think>\n\nOK."  # the matched <|im_end|> is cut from text

    half_a = await start_sim(sim_empty_share=0.5, sim_seed=7)
    half_b = await start_sim(sim_empty_share=0.5, sim_seed=7)
    empties = []
    for sim_x in (half_a, half_b):
        got = []
        for i in range(24):
            _, o = await post(sim_x.url + "/generate", {"rid": f"r{i}", "input_ids": ids,
                                                         "sampling_params": {"max_new_tokens": 3000}})
            got.append(o["text"] == "<think>\n\n</think>\n\nOK.")
        empties.append(got)
    assert empties[0] == empties[1] and 0 < sum(empties[0]) < 24


async def test_batch_text_list_returns_list_with_suffixed_rids(start_sim):
    sim = await start_sim()
    status, out = await post(sim.url + "/generate", {"rid": "b", "text": ["one", "two", "three"],
                                                     "sampling_params": {"max_new_tokens": 4000}})
    assert status == 200 and [o["meta_info"]["id"] for o in out] == ["b_0", "b_1", "b_2"]


async def test_http_400s_context_sampling_duplicate(start_sim, tiny_tokenizer):
    sim = await start_sim(context_length=256, sim_output_mean=2000, sim_output_sigma=0.0, sim_step_ms=5.0)
    long_ids = [5] * 300
    status, body = await post(sim.url + "/generate", {"input_ids": long_ids})
    assert status == 400
    assert body == {"error": {"message": "The input (300 tokens) is longer than the model's context length "
                                         "(256 tokens)."}}
    status, body = await post(sim.url + "/generate", {"input_ids": [5] * 200, "sampling_params": {
        "max_new_tokens": 100}})
    assert status == 400
    assert body["error"]["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 256 tokens. You requested a total of "
        "300 tokens: 200 tokens from the input messages and 100 tokens for the completion.")
    status, body = await post(sim.url + "/generate", {"text": "hi", "return_logprob": True})
    assert status == 400 and "return_logprob is not supported by the SGLang simulator" in body["error"]["message"]
    status, body = await post(sim.url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 5,
                                                                                        "bogus_knob": 1}})
    assert status == 400 and body["error"].startswith("unknown field `bogus_knob`, expected one of ")
    for bad, text in (({"temperature": -1}, "temperature must be non-negative"),
                      ({"top_p": 0}, "top_p must be in (0, 1]"), ({"top_k": 0}, "top_k must be -1"),
                      ({"min_p": 1.5}, "min_p must be in [0, 1]")):
        status, body = await post(sim.url + "/generate", {"text": "hi", "sampling_params": dict(bad,
                                                                                               max_new_tokens=5)})
        assert status == 400 and body["error"]["message"].startswith(text), body

    first = asyncio.create_task(post(sim.url + "/generate", {"rid": "dup", "text": "hi",
                                                             "sampling_params": {"max_new_tokens": 200}}))
    await await_until(lambda: "dup" in sim.server.in_flight_rids, 10, "the first 'dup' request in flight")
    status, body = await post(sim.url + "/generate", {"rid": "dup", "text": "hi"})
    assert status == 400 and body["error"]["message"].startswith("Duplicate request ID(s) detected")
    status, body = await first
    assert status == 200 and body["meta_info"]["id"] == "dup"


# --- continuous batching --------------------------------------------------------------------------------
def test_throughput_formula():
    assert throughput(1, step_ms=10, step_ms_per_req=0) == pytest.approx(100.0)
    assert throughput(4, step_ms=4, step_ms_per_req=1, tokens_per_step=2) == pytest.approx(1000.0)
    # per-step time grows with the batch, so throughput saturates at 1000 * tps / step_ms_per_req
    assert throughput(10_000, step_ms=20, step_ms_per_req=0.5) < 2000.0


async def test_batching_queues_beyond_max_running_and_matches_formula(start_sim):
    step_ms, per_req, batch = 4.0, 1.0, 4
    sim = await start_sim(enable_metrics=True, max_running_requests=batch, sim_step_ms=step_ms,
                          sim_step_ms_per_req=per_req, sim_output_mean=120, sim_output_sigma=0.0,
                          decode_log_interval=20)
    expected = throughput(batch, step_ms=step_ms, step_ms_per_req=per_req)
    tasks = [asyncio.create_task(post(sim.url + "/generate", {"rid": f"q{i}", "text": f"prompt {i}",
                                                              "sampling_params": {"max_new_tokens": 1000}}))
             for i in range(10)]
    queue_seen, running_seen = 0.0, 0.0
    while not all(t.done() for t in tasks):
        _, text = await get(sim.url + "/metrics")
        samples = metric_samples(text)
        queue_seen = max(queue_seen, samples["sglang:num_queue_reqs"])
        running_seen = max(running_seen, samples["sglang:num_running_reqs"])
        await asyncio.wait(tasks, timeout=0.02)  # the next sample, or sooner when the requests are answered
    results = [await t for t in tasks]
    assert all(status == 200 for status, _ in results)
    assert queue_seen > 0 and running_seen <= batch
    assert sim.server.scheduler.num_running == 0

    rates = [float(m.group(1)) for m in re.finditer(
        r"Decode batch, #running-req: 4, #token: \d+, token usage: [\d.]+, cuda graph: True, "
        r"gen throughput \(token/s\): ([\d.]+), #queue-req: \d+,", sim.log)]
    assert len(rates) >= 3, sim.log
    ratio = statistics.median(rates[1:]) / expected  # the first interval starts before the batch filled
    assert 0.6 < ratio < 1.1, (rates, expected)

    _, text = await get(sim.url + "/metrics")
    samples = metric_samples(text)
    completion = sum(body["meta_info"]["completion_tokens"] for _, body in results)
    prompt = sum(body["meta_info"]["prompt_tokens"] for _, body in results)
    assert samples["sglang:generation_tokens_total"] == completion
    assert samples["sglang:prompt_tokens_total"] == prompt
    assert samples["sglang:num_requests_total"] == 10
    assert samples["sglang:e2e_request_latency_seconds_count"] == 10
    assert samples["sglang:time_to_first_token_seconds_count"] == 10
    assert samples["sglang:num_running_reqs"] == 0 and samples["sglang:gen_throughput"] == 0.0  # idle reset
    assert "Prefill batch, #new-seq: " in sim.log


async def test_prefix_cache_counts_shared_prompt_prefix_and_flush(start_sim):
    sim = await start_sim(enable_metrics=True)
    shared = list(range(10, 400))
    _, a = await post(sim.url + "/generate", {"input_ids": shared + [1], "sampling_params": {"max_new_tokens": 5}})
    _, b = await post(sim.url + "/generate", {"input_ids": shared + [2], "sampling_params": {"max_new_tokens": 5}})
    assert a["meta_info"]["cached_tokens"] == 0
    assert 300 <= b["meta_info"]["cached_tokens"] <= len(shared)
    async with aiohttp.ClientSession() as session:
        async with session.post(sim.url + "/flush_cache") as resp:
            assert resp.status == 200 and (await resp.text()).startswith("Cache flushed.")
    _, c = await post(sim.url + "/generate", {"input_ids": shared + [3], "sampling_params": {"max_new_tokens": 5}})
    assert c["meta_info"]["cached_tokens"] == 0
    samples = metric_samples((await get(sim.url + "/metrics"))[1])
    assert samples["sglang:cached_tokens_total"] == b["meta_info"]["cached_tokens"]

    slow = asyncio.create_task(post(sim.url + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 300}}))
    await await_until(lambda: sim.server.scheduler.num_running, 10, "the slow request running")
    async with aiohttp.ClientSession() as session:
        async with session.post(sim.url + "/flush_cache") as resp:
            assert resp.status == 400 and (await resp.text()).startswith("Cache flushed.")
    await slow
    assert "Cache not flushed because there are pending requests. #queue-req: 0, #running-req: 1" in sim.log


def test_the_radix_cache_matches_the_longest_cached_prefix_in_pages_never_the_whole_prompt():
    from engine.simulator.prefix_cache import PrefixCache

    cache = PrefixCache(10_000)
    system = list(range(1000, 1300))
    assert cache.match_and_insert(system + [1, 2, 3]) == 0
    assert cache.match_and_insert(system + [1, 2, 9]) == 302  # token granularity (page size 1)
    assert cache.match(system + [1, 2, 3]) == 302  # the last prompt token is always computed
    assert cache.match(system[:150] + [7]) == 150  # a prefix of an edge
    paged = PrefixCache(10_000, page_size=16)
    paged.insert(system + [1, 2, 3])
    assert paged.match(system + [4]) == 288  # whole pages only: 300 // 16 * 16
    off = PrefixCache(0)
    off.insert(system)
    assert off.match(system + [1]) == 0  # --disable-radix-cache


def test_the_radix_cache_keeps_the_pool_bound_evicting_the_least_recently_used_leaves_first():
    from engine.simulator.prefix_cache import PrefixCache

    cache = PrefixCache(1000)
    shared = list(range(5000, 5200))  # a system prompt every request uses
    convs = [shared + [i] * 200 for i in range(5)]
    for ids in convs[:4]:  # 200 + 4 x 200 tokens: all fit
        cache.insert(ids)
    assert len(cache) == 1000
    cache.match(convs[0] + [1])  # conversation 0 used again: now the most recent
    cache.insert(convs[4])  # 200 more: the least recently used leaf (conversation 1) goes
    assert len(cache) == 1000
    assert cache.match(convs[1] + [1]) == 200  # only the shared part is left of it
    assert cache.match(convs[0] + [1]) == 400 and cache.match(convs[4] + [1]) == 400


def test_the_radix_cache_evicts_the_least_recently_used_leaf_after_many_touches(monkeypatch):
    from engine.simulator import prefix_cache

    monkeypatch.setattr(prefix_cache, "REBUILD_MIN", 8)  # the leaf heap rebuilt many times over
    cache = prefix_cache.PrefixCache(1000)
    convs = [[i] * 200 for i in range(1, 6)]
    for ids in convs:
        cache.insert(ids)
    for _ in range(50):
        for ids in (convs[0], convs[2], convs[3], convs[4]):
            cache.match(ids + [9])
    assert len(cache._leaves) <= 4 * 5 + 1  # stale entries do not pile up
    cache.insert([7] * 200)  # one leaf must go: conversation 1, untouched since it was inserted
    assert cache.match(convs[1] + [9]) == 0
    assert [cache.match(ids + [9]) for ids in (convs[0], convs[2], convs[3], convs[4])] == [200] * 4


async def test_a_later_turn_built_on_the_answer_is_cached_up_to_where_the_answer_ends(start_sim):
    sim = await start_sim(sim_output_mean=40, sim_output_sigma=0.0)
    prompt = list(range(10, 300))
    _, a = await post(sim.url + "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 40}})
    answer = a["output_ids"]
    _, b = await post(sim.url + "/generate", {"input_ids": prompt + answer + [5, 6, 7],
                                              "sampling_params": {"max_new_tokens": 5}})
    # SGLang keeps the prompt and the answer (less its last token, whose KV was never computed)
    assert b["meta_info"]["cached_tokens"] == len(prompt) + len(answer) - 1


# --- abort / pause ------------------------------------------------------------------------------------------
async def test_abort_request_prefix_running_and_waiting(start_sim):
    sim = await start_sim(enable_metrics=True, max_running_requests=1, sim_output_mean=5000, sim_output_sigma=0.0,
                          sim_step_ms=5.0)
    running = asyncio.create_task(post(sim.url + "/generate", {"rid": "job-a", "text": "one",
                                                               "sampling_params": {"max_new_tokens": 6000}}))
    queued = asyncio.create_task(post(sim.url + "/generate", {"rid": "job-b", "text": "two",
                                                              "sampling_params": {"max_new_tokens": 6000}}))
    sch = sim.server.scheduler
    await await_until(lambda: sch.num_running == 1 and sch.num_waiting == 1, 10, "one request running, one waiting")
    await await_until(lambda: any(sch.generated(r) > 0 for r in sch.running), 10, "tokens from the running request")
    status, _ = await post(sim.url + "/abort_request", {"rid": "job", "abort_all": False})
    assert status == 200
    _, a = await running
    _, b = await queued
    assert a["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                               "err_type": None}
    assert 0 < a["meta_info"]["completion_tokens"] < 5000 and len(a["output_ids"]) == a["meta_info"]["completion_tokens"]
    assert b["meta_info"] == {"id": "job-b", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                              "completion_tokens": 0}
    samples = metric_samples((await get(sim.url + "/metrics"))[1])
    assert samples["sglang:num_aborted_requests_total"] == 2


async def test_client_disconnect_aborts_the_request(start_sim):
    sim = await start_sim(sim_output_mean=5000, sim_output_sigma=0.0, sim_step_ms=5.0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as session:
        with pytest.raises(asyncio.TimeoutError):
            await session.post(sim.url + "/generate", json={"rid": "gone", "text": "x",
                                                            "sampling_params": {"max_new_tokens": 6000}})
    await await_until(lambda: sim.server.scheduler.num_running == 0 and "gone" not in sim.server.in_flight_rids, 10,
                      "the disconnected request aborted",
                      describe=lambda: f"running {sim.server.scheduler.num_running}, rids {sim.server.in_flight_rids}")


async def test_pause_aborts_in_flight_and_holds_new_until_continue(start_sim):
    sim = await start_sim(sim_output_mean=3000, sim_output_sigma=0.0, sim_step_ms=5.0)
    first = asyncio.create_task(post(sim.url + "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4000}}))
    await await_until(lambda: sim.server.scheduler.num_running, 10, "the first request running")
    status, body = await post(sim.url + "/pause_generation", {})
    assert (status, body) == (200, {"message": "Generation paused successfully.", "status": "ok"})
    _, aborted = await first
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    held = asyncio.create_task(post(sim.url + "/generate", {"text": "y", "sampling_params": {"max_new_tokens": 3}}))
    # the new request has reached the server and waits there for /continue_generation
    await await_until(lambda: len(getattr(sim.server._continue, "_waiters", None) or ()) == 1, 10,
                      "the new request held by the pause")
    assert not held.done()
    status, body = await post(sim.url + "/continue_generation", {})
    assert body == {"message": "Generation continued successfully.", "status": "ok"}
    status, out = await held
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length"


# --- streaming ----------------------------------------------------------------------------------------------
async def test_stream_generate_cumulative_chunks_then_done(start_sim, tiny_tokenizer):
    sim = await start_sim(sim_output_mean=40, sim_output_sigma=0.0)
    payload = {"rid": "s1", "text": "stream me", "sampling_params": {"max_new_tokens": 1000}, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(sim.url + "/generate", json=payload) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            raw = (await resp.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert len(chunks) > 5
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "stop"
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == last["meta_info"]["completion_tokens"]
    assert last["text"] == tiny_tokenizer.decode(last["output_ids"], skip_special_tokens=True)
    _, plain = await post(sim.url + "/generate", {"rid": "s1", "text": "stream me",
                                                  "sampling_params": {"max_new_tokens": 1000}})
    assert plain["output_ids"] == last["output_ids"]


async def test_stream_interval_sends_the_first_token_then_a_chunk_every_interval(start_sim):
    # the reader is woken only when its next chunk is due (request.wake_at), not on every step of the batch
    sim = await start_sim(sim_output_mean=40, sim_output_sigma=0.0)
    payload = {"text": "stream me", "stream": True, "sampling_params": {"max_new_tokens": 1000, "stream_interval": 8}}
    async with aiohttp.ClientSession() as session:
        async with session.post(sim.url + "/generate", json=payload) as resp:
            raw = (await resp.read()).decode()
    chunks = [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    assert [len(c["output_ids"]) for c in chunks] == [1, 9, 17, 25, 33, 40]


# --- faults ----------------------------------------------------------------------------------------------------
async def test_5xx_rate_is_deterministic_and_retries_can_succeed(start_sim):
    outcomes = []
    for _ in range(2):
        sim = await start_sim(sim_5xx_rate=0.5, sim_seed=3, sim_instant=True, sim_instant_pool=8)
        statuses = []
        for i in range(30):
            status, body = await post(sim.url + "/generate", {"rid": f"r{i}", "text": "hi"})
            statuses.append(status)
            if status == 503:
                assert body["object"] == "error" and body["type"] == "503" and body["code"] == 503
                assert body["param"] is None and "--sim-5xx-rate" in body["message"]
        outcomes.append(statuses)
        for attempt in range(20):  # a rejected rid is drawn anew on every attempt
            status, _ = await post(sim.url + "/generate", {"rid": f"r{statuses.index(503)}", "text": "hi"})
            if status == 200:
                break
        assert status == 200
    assert outcomes[0] == outcomes[1]
    assert 5 < outcomes[0].count(503) < 25


async def test_abort_rate_gives_finish_reason_abort(start_sim):
    sim = await start_sim(sim_abort_rate=1.0)
    _, out = await post(sim.url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4000}})
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                                 "err_type": None}


async def test_hang_after_keeps_port_open_but_never_answers(start_sim):
    sim = await start_sim(sim_hang_after=1, sim_instant=True, sim_instant_pool=4)
    status, _ = await post(sim.url + "/generate", {"text": "hi"})
    assert status == 200
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.7)) as session:
        with pytest.raises(asyncio.TimeoutError):
            await session.get(sim.url + "/health")


async def test_crash_after_in_process_stops_the_server_with_exit_code_1(start_sim):
    sim = await start_sim(sim_crash_after=1, sim_instant=True, sim_instant_pool=4)
    status, _ = await post(sim.url + "/generate", {"text": "hi"})
    assert status == 200
    await asyncio.wait_for(sim.server.wait_stopped(), 5)
    assert sim.server.exit_code == 1
    assert "Scheduler hit an exception: Traceback (most recent call last):" in sim.log
    with pytest.raises(aiohttp.ClientConnectionError):
        await get(sim.url + "/health")


class _FullDisk:
    """A log file on a disk with no space left: every write fails with ENOSPC."""

    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")

    def flush(self) -> None:
        raise OSError(28, "No space left on device")


async def test_a_full_disk_under_the_log_drops_lines_and_the_server_serves_on(start_sim):
    sim = await start_sim(sim_output_mean=20)
    sim.server.log._err = sim.server.log._out = _FullDisk()  # SGLang's logging handlers swallow the error too
    for _ in range(3):
        status, out = await post(sim.url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 64}})
        assert status == 200, out
    status, _ = await get(sim.url + "/health")
    assert status == 200


# --- API key -------------------------------------------------------------------------------------------------
async def test_api_key_required_except_health_and_metrics_and_never_logged(start_sim):
    secret = "sk-sim-very-secret-4242"
    sim = await start_sim(api_key=secret, enable_metrics=True)
    status, body = await post(sim.url + "/generate", {"text": "hi"})
    assert (status, body) == (401, {"error": "Unauthorized"})
    status, body = await post(sim.url + "/generate", {"text": "hi"}, headers={"Authorization": "Bearer wrong"})
    assert status == 401
    status, body = await post(sim.url + "/generate", {"text": "hi"}, headers={"Authorization": f"Bearer {secret}"})
    assert status == 200
    assert (await get(sim.url + "/health"))[0] == 200
    assert (await get(sim.url + "/metrics"))[0] == 200
    assert (await get(sim.url + "/get_server_info"))[0] == 401
    status, info = await get(sim.url + "/get_server_info", headers={"Authorization": f"Bearer {secret}"})
    assert status == 200 and secret not in info
    assert secret not in sim.log and "api_key='<redacted>'" in sim.log


# --- chat completions ---------------------------------------------------------------------------------------
async def test_chat_completions_thinking_on_and_off(start_sim):
    sim = await start_sim(reasoning_parser="qwen3", sim_output_mean=80, sim_output_sigma=0.0)
    base = {"model": "tiny", "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 2000}
    status, off = await post(sim.url + "/v1/chat/completions",
                             dict(base, chat_template_kwargs={"enable_thinking": False}))
    assert status == 200 and off["object"] == "chat.completion"
    choice = off["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["role"] == "assistant"
    assert choice["message"]["reasoning_content"] is None
    assert "<think>" not in choice["message"]["content"] and choice["message"]["content"]
    usage = off["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["reasoning_tokens"] == 0

    status, on = await post(sim.url + "/v1/chat/completions", dict(base, separate_reasoning=True))
    msg = on["choices"][0]["message"]
    assert msg["reasoning_content"] and "<think>" not in msg["content"] and "</think>" not in msg["content"]
    assert on["usage"]["prompt_tokens"] < off["usage"]["prompt_tokens"]  # no pre-filled empty think block

    status, body = await post(sim.url + "/v1/chat/completions", dict(base, temperature=-2))
    assert status == 400 and body["object"] == "error" and body["code"] == 400

    payload = dict(base, stream=True, stream_options={"include_usage": True})
    async with aiohttp.ClientSession() as session:
        async with session.post(sim.url + "/v1/chat/completions", json=payload) as resp:
            raw = (await resp.read()).decode()
    events = [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    assert raw.endswith("data: [DONE]\n\n")
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    reasoning = "".join(e["choices"][0]["delta"].get("reasoning_content") or "" for e in events if e["choices"])
    assert content == msg["content"] and reasoning == msg["reasoning_content"]
    assert events[-1]["usage"]["completion_tokens"] == on["usage"]["completion_tokens"]


# --- instant mode and CLI parsing ------------------------------------------------------------------------
async def test_instant_mode_prebuilt_outputs_match_the_tokenizer(start_sim, tiny_tokenizer):
    sim = await start_sim(sim_instant=True, sim_instant_pool=16, sim_output_mean=300)
    for i, max_new in enumerate((5, 50, 100000 - 100)):
        for skip in (True, False):
            _, out = await post(sim.url + "/generate", {"rid": f"i{i}", "input_ids": [7, 8, 9], "sampling_params": {
                "max_new_tokens": min(max_new, 40000), "skip_special_tokens": skip}})
            stopped = out["meta_info"]["finish_reason"]["type"] == "stop"  # the matched stop is cut from text
            shown = out["output_ids"][:-1] if stopped else out["output_ids"]
            assert out["text"] == tiny_tokenizer.decode(shown, skip_special_tokens=skip)
            assert len(out["output_ids"]) <= max_new


def test_parse_args_accepts_sglang_flags_and_rejects_unknown_sim_flags(tiny_model_dir, capsys):
    cfg = parse_args(["--model-path", str(tiny_model_dir), "--tp", "2", "--trust-remote-code",
                      "--mem-fraction-static", "0.8", "--schedule-policy", "lpm", "--port", "31001",
                      "--sim-step-ms", "7.5", "--sim-instant"])
    assert cfg.tp_size == 2 and cfg.port == 31001 and cfg.mem_fraction_static == 0.8
    assert cfg.sim_step_ms == 7.5 and cfg.sim_instant
    assert cfg.ignored_args == ("--trust-remote-code", "--schedule-policy", "lpm")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model-path", str(tiny_model_dir), "--sim-stepms", "3"])
    assert exc.value.code == 2 and "unknown simulator flag(s): --sim-stepms" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "/nonexistent/model"])
    assert "/nonexistent/model: not a directory" in capsys.readouterr().err


async def test_tp_size_2_prefixes_scheduler_lines_and_halves_weights(start_sim):
    one = await start_sim()
    two = await start_sim(tp_size=2)
    await post(two.url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3}})
    assert re.search(r"^\[[\d\- :]+ TP0\] Load weight begin\.", two.log, re.M)
    assert re.search(r"^\[[\d\- :]+ TP0\] Prefill batch, #new-seq: 1,", two.log, re.M)
    assert re.search(r"^\[[\d\- :]+\] The server is fired up and ready to roll!", two.log, re.M)
    assert " TP0]" not in one.log

    def weights(log: str) -> float:
        return float(re.search(r"Load weight end\. .* mem usage=([\d.]+) GB\.", log).group(1))
    assert weights(two.log) == pytest.approx(weights(one.log) / 2, rel=0.01)
