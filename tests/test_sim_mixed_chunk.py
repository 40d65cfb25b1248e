"""--enable-mixed-chunk in the simulator: a prefill batch mixed with the running batch, as SGLang schedules it.

Expected numbers are worked by hand from SGLang's rules; each test names the release file:line it models
(0.5.23 unless said: managers/scheduler.py, managers/schedule_policy.py, mem_cache/prefill_budget.py).
"""
from __future__ import annotations

import asyncio
import io
import re
from pathlib import Path

import pytest

from engine.simulator.config import parse_args
from engine.simulator.generator import OutputPlan
from engine.simulator.kv_policy import StepKind, next_step
from engine.simulator.profiles import PROFILES
from engine.simulator.request import RequestState, SimRequest
from engine.simulator.scheduler import Scheduler
from engine.simulator.simlog import SimLog
from tests.sim_fixtures import start_sim  # noqa: F401  (fixture)
from tests.test_simulator_profiles import get_json

pytestmark = pytest.mark.timeout(60)


def scheduler(pool: int, *, mixed: bool = True, version: str = "0.5.23", tps: int = 1, max_prefill: int = 16384,
              err: io.StringIO | None = None, **kw) -> Scheduler:
    costs = {"step_ms": 0.0, "step_ms_per_req": 0.0, "prefill_ms_per_1k": 0.0, "decode_log_interval": 40, **kw}
    return Scheduler(log=SimLog(err=err or io.StringIO(), out=io.StringIO()), metrics=None, max_running=64,
                     max_total_tokens=pool, max_prefill_tokens=max_prefill, tokens_per_step=tps,
                     on_finish=lambda req: None, profile=PROFILES[version], mixed_chunk=mixed, **costs)


def request(rid: str, prompt: int, max_new: int, planned: int | None = None) -> SimRequest:
    base = 100_000 * (1 + sum(map(ord, rid)))  # no two prompts share a prefix: nothing is cached
    plan = OutputPlan(output_ids=[7] * (planned or max_new), finish_reason={"type": "length"}, reasoning_tokens=0)
    return SimRequest(rid=rid, prompt_ids=list(range(base, base + prompt)), plan=plan, max_new_tokens=max_new,
                      state=RequestState.WAITING)


def queue(sch: Scheduler, *reqs: SimRequest) -> None:
    sch.waiting.extend(reqs)


def run_step(sch: Scheduler) -> StepKind:
    """One step as the scheduler's loop takes it (without its clock and log interval)."""
    step = next_step(sch)
    sch._complete(step)
    return step.kind


def test_a_mixed_step_gives_the_running_requests_a_token_and_the_new_ones_their_first():
    # 0.5.23 scheduler.py:4375-4410: the prefill batch takes the running batch along (mix_with_running), so a decodes
    # in the step that prefills b; without the flag the prefill batch runs instead of a's decode step (:3975-4005)
    for mixed, a_after, kind in ((True, 6, StepKind.MIXED), (False, 5, StepKind.PREFILL)):
        sch = scheduler(100_000, mixed=mixed)
        a, b = request("a", 10, 50), request("b", 10, 50)
        queue(sch, a)
        assert run_step(sch) == StepKind.PREFILL  # an empty running batch: nothing to mix (:4377)
        for _ in range(4):
            assert run_step(sch) == StepKind.DECODE
        assert sch.generated_running(a) == 5  # 1 from its prefill + 4 decode steps
        queue(sch, b)
        step = next_step(sch)
        assert (step.kind, step.admitted, step.decoding, step.batch) == (kind, [b], 1 if mixed else 0,
                                                                         2 if mixed else 1)
        sch._complete(step)
        assert (sch.generated_running(a), sch.generated_running(b)) == (a_after, 1)
        assert sch.used_tokens() == 20 + a_after + 1
        # a mixed step is a prefill step, not a decode step: SGLang counts it in neither forward_ct_decode
        # (batch_result_processor.py:1102) nor the ratio's decay (:4541-4542, update_running_batch only)
        assert (sch.decode_steps, sch.prefill_steps) == (4, 2)
        assert sch.ratio.current == pytest.approx(0.7 - 4 * 0.602 / 600)
        run_step(sch)
        assert (sch.generated_running(a), sch.generated_running(b)) == (a_after + 1, 2)


def test_a_request_admitted_in_a_mixed_step_finishes_after_its_planned_tokens():
    sch = scheduler(100_000)
    a, b = request("a", 10, 50), request("b", 10, 3)
    queue(sch, a)
    run_step(sch)
    queue(sch, b)
    assert run_step(sch) == StepKind.MIXED  # b: 1 token
    run_step(sch)  # b: 2
    assert b.state == RequestState.RUNNING
    run_step(sch)  # b: 3, its last
    assert b.state == RequestState.FINISHED and len(b.final_ids()) == 3
    assert sch.generated_running(a) == 4


def test_the_mixed_step_costs_one_forward_pass_over_both_batches():
    # one forward pass: the fixed step cost once, per request over the decode rows and the admitted ones, plus the
    # prefill's per-token cost: (10 + 1 x 2) ms + 2 ms x 10 / 1,000 tokens
    sch = scheduler(100_000, step_ms=10.0, step_ms_per_req=1.0, prefill_ms_per_1k=2.0)
    queue(sch, request("a", 10, 50))
    run_step(sch)
    queue(sch, request("b", 10, 50))
    step = next_step(sch)
    assert sch._step_seconds(step) == pytest.approx(0.012 + 0.00002)


@pytest.mark.parametrize("mixed", [False, True])
def test_the_admission_budget_is_reduced_by_the_running_batch_size(mixed):
    # the adder's num_mixed_decode_tokens = running_bs (scheduler.py:4165) comes off the KV budget
    # (prefill_budget.py:70-71, total_offset) and the prefill's token cap (schedule_policy.py:638, :654-655).
    # Four running, prompt 10, max_new 100, one token each: used 4 x 10 + 4 = 44; their expected rest
    # 4 x min(100 - 1, 4,096) x 0.7 = 277.2 (schedule_policy.py:785-795); remaining 10,000 - 44 - 277.2 = 9,678.8,
    # less 4 when mixed = 9,674.8. e (prompt 5,675, max_new 4,000) needs 5,675 + 4,000 + 1 = 9,676
    # (schedule_policy.py:1404-1412, strictly below, prefill_budget.py:128): admitted only without the flag.
    sch = scheduler(10_000, mixed=mixed)
    queue(sch, *(request(f"r{i}", 10, 100) for i in range(4)))
    assert run_step(sch) == StepKind.PREFILL and len(sch.running) == 4
    assert sch.used_tokens() == 44
    e = request("e", 5675, 4000)
    queue(sch, e)
    step = next_step(sch)
    assert (step.kind, list(sch.waiting)) == ((StepKind.DECODE, [e]) if mixed else (StepKind.PREFILL, []))


@pytest.mark.parametrize("mixed", [False, True])
def test_the_prefill_token_cap_is_reduced_by_the_running_batch_size(mixed):
    # max_prefill_tokens 16,384 less 4 running = 16,380 (schedule_policy.py:638): two prompts of 8,191 (16,382) fit
    # the cap only without the flag
    sch = scheduler(100_000, mixed=mixed)
    queue(sch, *(request(f"r{i}", 10, 100) for i in range(4)))
    run_step(sch)
    x, y = request("x", 8191, 10), request("y", 8191, 10)
    queue(sch, x, y)
    step = next_step(sch)
    assert step.admitted == ([x] if mixed else [x, y])


def test_a_spent_prefill_cap_admits_no_one():
    # a cap of 4 less 4 running rows is 0: budget_state() is OTHER before the first candidate (scheduler.py:4206-4208)
    sch = scheduler(100_000, max_prefill=4)
    queue(sch, *(request(f"r{i}", 10, 100) for i in range(4)))
    assert run_step(sch) == StepKind.PREFILL  # an idle server takes the first whatever the cap
    while sch.waiting:  # one a step: with r running the cap is 4 - r, and the first candidate is taken above it
        run_step(sch)
    assert len(sch.running) == 4
    queue(sch, request("z", 1, 10))
    assert next_step(sch).kind == StepKind.DECODE
    assert [r.rid for r in sch.waiting] == ["z"]


@pytest.mark.parametrize("version,kind", [("0.5.23", StepKind.PREFILL), ("0.5.10", StepKind.MIXED),
                                          ("0.5.5", StepKind.MIXED)])
def test_decode_rows_that_do_not_fit_sit_out_the_step_without_a_retraction(version, kind):
    # 0.5.23 scheduler.py:4390-4393: after the prefill's KV, the running rows mix only if check_decode_mem() passes,
    # else they sit this step out, not retracted; 0.5.10 (:2525-2540) and 0.5.5 (:1872-1885) mix them regardless.
    # Four steps of 4 tokens each (tokens_per_step 4; the adder reserves one a row): prompt 10, max_new 5, 4 out:
    # used 4 x 10 + 16 = 56, their expected rest 4 x 1 x 0.7 = 2.8, remaining 75 - 56 - 2.8 - 4 = 12.2.
    # e (prompt 10, max_new 1) needs 10 + 1 + 1 = 12 < 12.2 (0.5.23; 11 without the page, 0.5.5/0.5.10): admitted.
    # After its prefill used is 66, and four rows of 4 tokens make 82 > 75: they do not fit.
    sch = scheduler(75, version=version, tps=4)
    runners = [request(f"r{i}", 10, 5) for i in range(4)]
    queue(sch, *runners)
    assert run_step(sch) == StepKind.PREFILL and sch.used_tokens() == 56
    e = request("e", 10, 1)
    queue(sch, e)
    step = next_step(sch)
    assert (step.kind, step.admitted) == (kind, [e])
    made = sch._complete(step)
    assert (sch.retracted_total, list(sch.waiting)) == (0, [])
    if kind == StepKind.PREFILL:  # sat out: still 4 tokens each, e its first
        assert [(r.state, sch.generated_running(r)) for r in runners] == [(RequestState.RUNNING, 4)] * 4
        assert made == 1
    else:  # decoded: their 5th and last token each (4 + 4 capped at the 5 planned), e its first
        assert [(r.state, len(r.final_ids())) for r in runners] == [(RequestState.FINISHED, 5)] * 4
        assert made == 5


def test_without_chunked_prefill_the_flag_does_nothing(tiny_model_dir):
    # is_mixed_chunk = chunked_prefill_size is not None and enable_mixed_chunk; a size <= 0 is None
    # (scheduler.py:1372-1378; 0.5.10 :878-884; 0.5.5 :445-451)
    from engine.simulator.server import SimServer

    def mixed(*flags: str) -> bool:
        return SimServer(parse_args(["--model-path", str(tiny_model_dir), *flags])).mixed_chunk

    assert mixed("--enable-mixed-chunk") is True
    assert mixed("--enable-mixed-chunk", "--chunked-prefill-size", "4096") is True
    assert mixed("--enable-mixed-chunk", "--chunked-prefill-size", "-1") is False
    assert mixed() is False


async def test_the_flag_is_in_server_args_and_server_info(start_sim):
    # enable_mixed_chunk: bool = False (arg_groups/fields/schedule.py:208-211; 0.5.5 server_args.py:482, :3246)
    sim = await start_sim(enable_mixed_chunk=True)
    assert re.search(r"server_args=ServerArgs\(.*enable_mixed_chunk=True", sim.log)
    _, info = await get_json(sim.url + "/get_server_info")
    assert info["enable_mixed_chunk"] is True and info["internal_states"][0]["enable_mixed_chunk"] is True
    plain = await start_sim()
    _, info = await get_json(plain.url + "/get_server_info")
    assert info["enable_mixed_chunk"] is False


async def test_the_loop_logs_a_mixed_step_as_a_prefill_batch_and_counts_only_decode_steps():
    # a mixed step logs its Prefill batch line with #running-req the running batch (PrefillStats.from_adder before
    # the mix, scheduler.py:4364-4367) and no Decode batch line; the decode log interval counts decode steps only
    # (batch_result_processor.py:510 vs :1102-1108)
    err = io.StringIO()
    sch = scheduler(100_000, err=err, decode_log_interval=1)
    a, b = request("a", 10, 200, planned=60), request("b", 10, 200, planned=20)
    sch.start()
    try:
        sch.submit(a)
        deadline = asyncio.get_running_loop().time() + 20
        while sch.step < 5:
            assert asyncio.get_running_loop().time() < deadline, "a never decoded"
            await asyncio.sleep(0)
        sch.submit(b)
        await asyncio.wait_for(asyncio.gather(a.done_future(), b.done_future()), 20)
    finally:
        await sch.stop()
    log = err.getvalue()
    prefills = re.findall(r"Prefill batch, #new-seq: 1, .*#running-req: (\d+),", log)
    assert prefills == ["0", "1"] and sch.prefill_steps == 2
    assert log.count("Decode batch") == sch.decode_steps == sch.step - 1  # one step advanced the batch mixed
    assert (len(a.final_ids()), len(b.final_ids())) == (60, 20)
    assert f"{sch.decode_steps + sch.prefill_steps} steps" in log  # the simulator's accounting line
