"""The simulator runs out of KV as SGLang does: admission estimates answers, a full pool retracts mid-decode."""
from __future__ import annotations

import asyncio

from engine.simulator.profiles import PROFILES
from tests.sim_fixtures import start_sim  # noqa: F401  (fixture)
from tests.test_simulator import get, metric_samples, post
from tests.waiting import await_until


def payload(rid: str, max_new: int) -> dict:
    return {"rid": rid, "input_ids": [11, 12, 13, 14], "sampling_params": {"max_new_tokens": max_new}}


async def test_a_pool_too_small_for_the_admitted_answers_retracts_and_every_answer_still_completes(start_sim):
    # a 4,000-token pool; answers of 1,500 tokens. A new request reserves its max_new_tokens in full, but the running
    # ones only x the decaying ratio (kv_budget.py), so admission takes more than the pool can finish: the pool fills
    # mid-decode and requests go back to the waiting queue. (max_new_tokens 1,500, not 4,000: a 4,000-token
    # reservation fits a 4,000-token pool only once, and then one request at a time never retracts.)
    sim = await start_sim(max_total_tokens=4000, sim_output_mean=1500, sim_output_sigma=0.0, sim_tokens_per_step=16,
                          sim_step_ms=1.0, enable_metrics=True)
    replies = await asyncio.wait_for(asyncio.gather(*(post(sim.url + "/generate", payload(f"r{i}", 1500))
                                                      for i in range(12))), timeout=120)
    key = PROFILES["0.5.23"].retractions_key
    assert all(status == 200 for status, _ in replies), replies
    assert all(body["meta_info"]["finish_reason"]["type"] != "abort" for _, body in replies)
    assert all(len(body["output_ids"]) == body["meta_info"]["completion_tokens"] > 0 for _, body in replies)
    assert "KV cache pool is full. Retract requests. #retracted_reqs: " in sim.log
    assert sum(body["meta_info"][key] for _, body in replies) >= 1
    status, text = await get(sim.url + "/metrics")
    samples = metric_samples(text)
    assert status == 200 and samples["sglang:num_retracted_reqs"] >= 1
    # the 0.5.10+ counters (0.5.23 observability/metrics_collector.py:557-572)
    assert samples["sglang:num_retracted_requests_total"] == sim.server.scheduler.retracted_total >= 1
    assert samples["sglang:num_retracted_input_tokens_total"] == 4 * sim.server.scheduler.retracted_total


async def test_a_retracted_request_aborted_while_waiting_ends_in_the_waiting_queue(start_sim):
    sim = await start_sim(max_total_tokens=4000, sim_output_mean=1500, sim_output_sigma=0.0, sim_tokens_per_step=16,
                          sim_step_ms=2.0)
    sch = sim.server.scheduler
    tasks = [asyncio.create_task(post(sim.url + "/generate", payload(f"r{i}", 1500))) for i in range(12)]
    # a retracted request is back in the waiting queue only until its next admission: polled often
    victim = await await_until(lambda: next((r for r in sch.waiting if r.retractions and r.state == "waiting"), None),
                               60, "a request retracted to the waiting queue", interval=0.002)
    status, _ = await post(sim.url + "/abort_request", {"rid": victim.rid})
    assert status == 200
    replies = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
    body = next(b for _, b in replies if b["meta_info"]["id"] == victim.rid)
    assert body["meta_info"] == {"id": victim.rid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                                 "completion_tokens": 0}
