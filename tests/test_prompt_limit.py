"""SGLang's prompt-length rule applied up front: a prompt at the limit is a context_overflow reject naming the
limit and where it came from; one token shorter is sent, its max_new_tokens capped where SGLang caps it.

Rule (contract 7.4): refused when len >= min(context_len - 1, max_total_num_tokens - 1) - 5; max_new_tokens
capped at min(context_len - 1, max_total_num_tokens - 1) - len - 1.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from engine.servers.capacity import ServerCapacity, parse_server_info
from engine.config.load import RunConfig, Sampling
from engine.text.ingest import Conversation
from engine.run.feed import Feed
from engine.run.items import WorkItem
from engine.run.conversations import Unfit
from engine.run.prompt_limit import from_context, tightest
from tests.run_helpers import events, make_config, read_rows, rejects, sample_accounting
from tests.run_helpers import renderer_for, supervisors  # noqa: F401  (fixtures)


def test_the_context_alone_sets_the_limit_at_context_minus_6():
    limit = from_context(4096, "run.toml")
    assert (limit.max_req_len, limit.max_input_len) == (4095, 4090)
    assert limit.fits(4089) and not limit.fits(4090)
    assert limit.room(4089) == 5  # 4095 - 4089 - 1


def test_the_smallest_kv_pool_over_the_servers_bounds_it_and_is_named():
    tokenizer = from_context(4096, "run.toml")
    servers = [("gpu0", ServerCapacity(max_total_num_tokens=9000, context_length=4096)),
               ("gpu1", ServerCapacity(max_total_num_tokens=2000)), ("gpu2", ServerCapacity())]
    limit = tightest(tokenizer, servers)
    assert (limit.max_req_len, limit.max_input_len) == (1999, 1994)
    assert limit.fits(1993) and not limit.fits(1994)
    assert limit.source == "max_total_num_tokens 2000 of gpu1"
    assert tightest(tokenizer, servers[:1]) == tokenizer  # a tie keeps what the feed had


def test_a_real_0_5_5_report_gives_the_servers_own_max_req_input_len():
    # /get_server_info of 0.5.5: context_length is the launch flag's (null); scheduler_info says the limit
    info = {"context_length": None, "max_total_num_tokens": 281029, "max_req_input_len": 40954,
            "internal_states": [{"context_length": None, "max_running_requests": None}]}
    limit = tightest(from_context(131072, "the model's config / tokenizer"), [("gpu0", parse_server_info(info))])
    assert limit.max_input_len == 40954 and limit.source == "max_req_input_len 40954 reported by gpu0"


def _feed(context_length: int, max_new_tokens: int = 32768) -> Feed:
    cfg = RunConfig(run_dir="/nonexistent", model="/m", prompts=("/p",), context_length=context_length,
                    sampling=Sampling(max_new_tokens=max_new_tokens))
    return Feed(cfg, SimpleNamespace(context_length=context_length, opens_think=lambda ids: False), prompts=None)


def _progress() -> SimpleNamespace:
    conv = Conversation(conversation_id="c1", source="/p/a.jsonl", origin="a.jsonl:7", index=0,
                        messages=({"role": "user", "content": "hi"},))
    return SimpleNamespace(conv=conv, shard_id="s00000", turns=[0])


@pytest.mark.parametrize("servers,at_limit,source", [
    ((), 4090, "context_length 4096 (run.toml)"),
    ((("gpu0", ServerCapacity(max_total_num_tokens=3000)), ("gpu1", ServerCapacity(max_total_num_tokens=2500))),
     2494, "max_total_num_tokens 2500 of gpu1"),
])
def test_feed_rejects_at_the_limit_and_sends_one_token_below(servers, at_limit, source):
    feed = _feed(4096)
    try:
        feed.use_limit(tightest(feed.limit, servers))
        below = feed._item(_progress(), 0, [1] * (at_limit - 1))
        assert isinstance(below, WorkItem)
        assert below.max_new_tokens == 5  # (at_limit + 5) - (at_limit - 1) - 1: where SGLang would cap it
        at = feed._item(_progress(), 0, [1] * at_limit)
        assert isinstance(at, Unfit) and at.reject.kind == "context_overflow"
        assert at.reject.file == "/p/a.jsonl" and at.reject.line == 7
        assert at.reject.reason == (f"turn 0: prompt of {at_limit} tokens is over SGLang's input limit: prompts of"
                                    f" {at_limit} tokens or more are refused (min(context_len - 1,"
                                    f" max_total_num_tokens - 1) - 5; the bound here: {source})")
    finally:
        feed.close()


def test_feed_keeps_the_configured_max_new_tokens_when_there_is_room():
    feed = _feed(4096, max_new_tokens=100)
    try:
        assert feed._item(_progress(), 0, [1] * 50).max_new_tokens == 100
    finally:
        feed.close()


def test_a_simulated_server_with_a_small_kv_pool_gets_no_prompt_it_would_refuse(tmp_path, tiny_model_dir, supervisors,
                                                                                 renderer_for):
    """End to end: the simulator's KV pool (--max-total-tokens) is below its context, so its own
    max_total_num_tokens sets the limit; the prompt at it is a reject, the one a token shorter commits."""
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=4, gpus=1)
    renderer = renderer_for(cfg)

    def rendered_len(words: int) -> int:
        return len(renderer.prompt_ids([{"role": "user", "content": " ".join(["token"] * words)}]))

    words = 80
    while rendered_len(words + 1) != rendered_len(words) + 1:
        words += 1
    limit = rendered_len(words + 1)  # the prompt of `words + 1` words is exactly at the limit
    pool = limit + 6  # max_input_len = (pool - 1) - 5
    rows = [{"id": f"short-{i}", "messages": [{"role": "user", "content": f"a short question {i}"}]} for i in range(4)]
    rows += [{"id": "below-limit", "messages": [{"role": "user", "content": " ".join(["token"] * words)}]},
             {"id": "at-limit", "messages": [{"role": "user", "content": " ".join(["token"] * (words + 1))}]}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = cfg.model_copy(update=dict(prompts=(str(prompts),), workers=cfg.workers.model_copy(update=dict(
        extra_args=cfg.workers.extra_args + ("--max-total-tokens", str(pool))))))
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(120) == 0, sup.log_text()[-3000:]

    over = [r for r in rejects(run_dir) if r["kind"] == "context_overflow"]
    assert [r["conversation_id"] for r in over] == ["at-limit"]
    assert f"prompt of {limit} tokens is over SGLang's input limit: prompts of {limit} tokens or more" \
        in over[0]["reason"]
    assert f"the bound here: max_total_num_tokens {pool} of gpu0" in over[0]["reason"]
    committed = {r["conversation_id"]: r for r in read_rows(run_dir)}
    assert "below-limit" in committed and committed["below-limit"]["prompt_len"] == limit - 1
    assert set(committed) == {"below-limit", "short-0", "short-1", "short-2", "short-3"}
    assert not [r for r in rejects(run_dir) if "HTTP 400" in r["reason"]]
    final = [e for e in events(run_dir) if e["type"] == "dispatch"][-1]
    assert final["state"] == "done"
    acc = sample_accounting(run_dir, cfg, renderer)
    assert acc["lost"] == acc["duplicated"] == 0
