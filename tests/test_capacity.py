"""A server's batch size: discovered from each source real SGLang offers, then corrected from its own queue."""
from __future__ import annotations

import pytest

from engine.servers.capacity import (
    DEFAULT_MAX_RUNNING, BatchSize, BatchSource, ServerCapacity, batch_from_flag, batch_from_log, configured_batch,
    discover, parse_server_info,
)
from engine.config.load import Dispatch, RunConfig
from engine.placement.hosts.remote_worker import RemoteWorker
from engine.servers.metrics_client import ServerMetrics
from engine.run.batch_feedback import corrected, margin_for
from engine.run.dispatch.loop import Dispatcher
from engine.api.wire import WorkerState
from engine.servers.identity_record import IdentityRecord
from engine.servers.launch import WorkerSpec

ARGS = {"model_path": "/models/Qwen3-27B", "dp_size": 1, "tp_size": 1, "max_running_requests": None}


def server_info(version: str, *, flag: int | None = None, effective: int | None = None, dp: int = 1,
                attn_dp: int | None = None) -> dict:
    """/get_server_info as each version shapes it (contract 2.1, 7.1): `{**server_args, **scheduler_info,
    internal_states, version}`; internal_states[i] = the server args plus the scheduler's state."""
    args = dict(ARGS, max_running_requests=flag, dp_size=dp)
    if attn_dp is not None:
        args["attn_dp_size"] = attn_dp
    state = dict(args, last_gen_throughput=0.0, memory_usage={"weight": 51.2, "kvcache": 68.6,
                                                              "token_capacity": 281029, "graph": 0.5})
    if version != "0.5.5":
        state["effective_max_running_requests_per_dp"] = effective
    return {**args, "status": "ready", "max_total_num_tokens": 281029, "max_req_input_len": 40959,
            "internal_states": [dict(state) for _ in range(dp)], "version": version}


# -- /get_server_info ---------------------------------------------------------------------------------------
def test_0_5_5_without_the_flag_reports_no_batch_size():
    cap = parse_server_info(server_info("0.5.5"))
    assert (cap.max_running_requests, cap.batch_source) == (None, BatchSource.DEFAULT)
    # context_length is the launch flag's (null without it); max_req_input_len is the scheduler's own prompt limit
    assert (cap.max_total_num_tokens, cap.context_length, cap.max_req_input_len) == (281029, None, 40959)


def test_0_5_5_with_the_flag_reports_it():
    cap = parse_server_info(server_info("0.5.5", flag=96))
    assert (cap.max_running_requests, cap.batch_source) == (96, BatchSource.SERVER_INFO)


@pytest.mark.parametrize("version", ["0.5.10", "0.5.23"])
def test_0_5_10_and_later_report_the_working_batch_in_internal_states(version):
    cap = parse_server_info(server_info(version, effective=3512))
    assert (cap.max_running_requests, cap.batch_source) == (3512, BatchSource.INTERNAL_STATES)
    # the working value wins over the flag, which the scheduler may have cut to its request slots
    cap = parse_server_info(server_info(version, flag=8192, effective=4096))
    assert (cap.max_running_requests, cap.batch_source) == (4096, BatchSource.INTERNAL_STATES)


def test_the_per_dp_value_counts_every_dp_rank_as_sglangs_own_benchmark_does():
    cap = parse_server_info(server_info("0.5.23", effective=512, dp=2, attn_dp=2))
    assert (cap.max_running_requests, cap.dp_ranks) == (2048, 4)


# -- the start-up log line, the flag ----------------------------------------------------------------------
LOG = """[2026-12-02 13:59:20] server_args=ServerArgs(model_path='/models/Qwen3-27B', max_running_requests=None, dp_size=1)
[2026-12-02 13:59:24] KV Cache is allocated. #tokens: 281029, K size: 34.30 GB, V size: 34.30 GB
[2026-12-02 13:59:25] max_total_num_tokens=281029, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=3512, context_len=40960, available_gpu_mem=15.78 GB
[2026-12-02 13:59:26] The server is fired up and ready to roll!
"""


def test_the_start_up_line_gives_the_batch_and_the_server_args_line_does_not():
    assert batch_from_log(LOG) == 3512
    assert batch_from_log(LOG.splitlines()[0]) is None  # "max_running_requests=None" in server_args
    dp = "[2026-12-02 13:59:25 DP0 TP0] max_total_num_tokens=90000, chunked_prefill_size=8192, " \
         "max_prefill_tokens=16384, max_running_requests=1024, context_len=40960, available_gpu_mem=9.10 GB\n"
    assert batch_from_log(dp) == 1024
    assert batch_from_log("") is None


def test_the_flag_in_a_launch_line():
    assert batch_from_flag(["python", "-m", "sglang.launch_server", "--max-running-requests", "48"]) == 48
    assert batch_from_flag(["--max-running-requests=32"]) == 32
    assert batch_from_flag(["--max-running-requests", "8", "--max-running-requests", "16"]) == 16  # argparse: last
    assert batch_from_flag(["--max-running-requests", "lots"]) is None
    assert batch_from_flag(["--port", "30000"]) is None
    assert configured_batch("{python} -m sglang.launch_server --port {port}", ("--max-running-requests", "24")) == 24


# -- which source wins --------------------------------------------------------------------------------------
def test_discovery_takes_the_first_source_that_says_it():
    reported_055 = parse_server_info(server_info("0.5.5"))
    reported_0523 = parse_server_info(server_info("0.5.23", effective=3512))
    assert discover(reported_0523, 100, 48).batch() == BatchSize(3512, BatchSource.INTERNAL_STATES)
    assert discover(reported_055, 256, 48).batch() == BatchSize(256, BatchSource.LOG)
    assert discover(parse_server_info(server_info("0.5.5", flag=96)), None, 48).batch() == \
        BatchSize(96, BatchSource.SERVER_INFO)
    assert discover(reported_055, None, 48).batch() == BatchSize(48, BatchSource.FLAG)
    assert discover(None, None, None).batch() == BatchSize(DEFAULT_MAX_RUNNING, BatchSource.DEFAULT)
    # the log line is one DP rank's: the ranks /get_server_info names multiply it
    assert discover(parse_server_info(server_info("0.5.5", dp=2)), 256, None).batch() == BatchSize(512, BatchSource.LOG)
    assert discover(reported_055, 256, None).max_req_input_len == 40959  # the rest of what it reported is kept


def test_a_remote_server_s_log_line_travels_in_the_agent_s_identity_record():
    record = IdentityRecord(name="h1.gpu0", state="ready", served_model_name="regen-x", pid=7, port=30000,
                            startup_batch=256)
    assert IdentityRecord.from_json(record.to_json()).startup_batch == 256
    older = '{"name": "h1.gpu0", "state": "ready", "served_model_name": "x", "pid": 7, "port": 30000}'
    assert IdentityRecord.from_json(older).startup_batch is None  # an agent from before the field


# -- feedback -----------------------------------------------------------------------------------------------
def serve(true_batch: int, start: BatchSize, ticks: int, in_flight_of=lambda cap: cap) -> list[BatchSize]:
    """Ticks of a server that runs `true_batch` at most, fed up to the cap (work always left)."""
    seen, batch = [], start
    for _ in range(ticks):
        in_flight = in_flight_of(batch.size + margin_for(batch.size))
        running = min(in_flight, true_batch)
        batch = corrected(batch, margin=margin_for(batch.size), in_flight=in_flight, running=running,
                          queued=in_flight - running)
        seen.append(batch)
    return seen


@pytest.mark.parametrize("true_batch", [256, 3512, 100, 40])
def test_an_unknown_size_is_found_from_the_64_default_in_a_few_ticks_and_holds(true_batch):
    seen = serve(true_batch, BatchSize(DEFAULT_MAX_RUNNING, BatchSource.DEFAULT), ticks=12)
    final = seen[-1]
    assert final.source == BatchSource.FEEDBACK and seen.index(final) <= 11  # x1.5 a reading: thousands in 5 s
    margin = margin_for(final.size)
    cap = final.size + margin
    # the server runs its full batch with a short, non-empty queue (between one and two margins): the
    # estimate is within a margin of its true size
    assert true_batch <= final.size <= true_batch + margin
    assert min(cap, true_batch) == true_batch and 1 <= cap - true_batch <= 2 * margin


def test_a_size_reported_too_big_shrinks_to_what_the_server_runs():
    assert serve(40, BatchSize(4096, BatchSource.FLAG), ticks=2) == [BatchSize(40, BatchSource.FEEDBACK)] * 2


def test_a_right_size_holds_with_its_source():
    assert serve(256, BatchSize(256, BatchSource.LOG), ticks=5) == [BatchSize(256, BatchSource.LOG)] * 5


def test_no_growth_without_work_waiting_or_without_gauges():
    size = BatchSize(64, BatchSource.DEFAULT)
    # the run's last requests: fewer in flight than the cap, nothing waits here
    assert corrected(size, margin=8, in_flight=70, running=70, queued=0) == size
    assert corrected(size, margin=8, in_flight=72, running=None, queued=None) == size  # no /metrics
    # a queue of about the margin is the steady state; a stalled server (nothing running) is not shrunk to 0
    assert corrected(size, margin=8, in_flight=72, running=64, queued=8) == size
    assert corrected(size, margin=8, in_flight=72, running=0, queued=72) == size
    # gauges from before the last growth: the server does not run more than we believed yet
    assert corrected(BatchSize(144, BatchSource.FEEDBACK), margin=18, in_flight=162, running=72, queued=0) == \
        BatchSize(144, BatchSource.FEEDBACK)


def test_growth_starts_before_the_queue_runs_dry_and_between_an_answer_and_its_refill():
    size = BatchSize(64, BatchSource.FEEDBACK)
    grown = BatchSize(96, BatchSource.FEEDBACK)
    # a queue under the margin while the server runs all we believed: SGLang's admission is growing its batch,
    # and at the next reading its queue would have been empty for a while
    assert corrected(size, margin=16, in_flight=80, running=74, queued=6) == BatchSize(111, BatchSource.FEEDBACK)
    assert corrected(size, margin=16, in_flight=80, running=64, queued=16) == size  # about the margin: steady
    # a reading between an answer and its slot's refill sees one or two under the cap: with work waiting in
    # regen's queue the cap is still what limits the server; without, it is the run's last requests
    assert corrected(size, margin=16, in_flight=78, running=64, queued=2, work_waiting=True) == grown
    assert corrected(size, margin=16, in_flight=78, running=64, queued=2) == size


# -- the dispatcher -----------------------------------------------------------------------------------------
def target(name: str, cap: ServerCapacity) -> RemoteWorker:
    w = RemoteWorker(spec=WorkerSpec(name=name, gpus=(0,), host="127.0.0.1", port=30000), host="", url="u", headers={})
    w.state, w.capacity_info = WorkerState.READY, cap
    return w


def dispatcher(workers, **dispatch) -> Dispatcher:
    cfg = RunConfig(run_dir="/r", model="/m", prompts=("p",), dispatch=Dispatch(**dispatch))
    d = Dispatcher(cfg, queue=None, workers=workers, deliver=lambda _: None, renderer=None, session=None,
                   emit=lambda _: None)
    return d


def test_the_dispatcher_grows_an_unreported_server_and_the_snapshot_says_so():
    w = target("gpu0", discover(parse_server_info(server_info("0.5.5")), None, None))
    d = dispatcher([w])
    d.adjust_capacity()
    assert (w.capacity, w.batch) == (80, BatchSize(64, BatchSource.DEFAULT))  # 64 is only where it starts
    d.inflight["gpu0"] = dict.fromkeys(range(80))  # the cap is full
    w.metrics = ServerMetrics(running_reqs=80, queued_reqs=0)
    d.adjust_capacity()
    assert w.batch == BatchSize(120, BatchSource.FEEDBACK) and w.capacity == 150
    ev = w.snapshot()
    assert (ev.batch_size, ev.batch_source, ev.discovered_batch, ev.discovered_source) == (
        120, "feedback", 64, "default")
    assert ev.in_flight == 80 and ev.capacity == 150


def test_a_relaunched_server_starts_again_from_what_it_reports():
    w = target("gpu0", discover(parse_server_info(server_info("0.5.5")), 256, None))
    d = dispatcher([w])
    d.inflight["gpu0"] = dict.fromkeys(range(320))
    w.metrics = ServerMetrics(running_reqs=200, queued_reqs=120)
    d.adjust_capacity()
    assert w.batch == BatchSize(200, BatchSource.FEEDBACK)
    w.state = WorkerState.CRASHED
    d.adjust_capacity()
    assert w.batch is None
    w.state, w.metrics = WorkerState.READY, ServerMetrics()
    d.adjust_capacity()
    # before any answer, a request is expected to hold what SGLang itself first reserves (0.7 x 4,096 tokens):
    # the 281,029-token pool holds 98 of them, fewer than the 256 reported
    assert w.batch == BatchSize(98, BatchSource.KV_POOL) and w.capacity == 98 + 24
    for _ in range(16):  # answers of 400 tokens to prompts of 100: SGLang still reserves its first guess
        d.request_size.sent(100, 32768)
        d.request_size.answered(400)
    d.adjust_capacity()
    assert w.batch == BatchSize(94, BatchSource.KV_POOL)  # 100 + 2,867 each: no jump up, growing is the gauges' business
    # the server runs all it was sent, with no queue and its pool 30% full: it grows by what the pool's free share
    # says, at most 1.5x a reading, never past the 256 it reported
    d.inflight["gpu0"] = dict.fromkeys(range(94 + 23))
    w.metrics = ServerMetrics(running_reqs=94 + 23, queued_reqs=0, token_usage=0.3)
    d.adjust_capacity()
    assert w.batch == BatchSize(175, BatchSource.FEEDBACK)
    d.inflight["gpu0"] = dict.fromkeys(range(175 + 43))
    w.metrics = ServerMetrics(running_reqs=175 + 43, queued_reqs=0, token_usage=0.3)
    d.adjust_capacity()
    assert w.batch == BatchSize(256, BatchSource.FEEDBACK) and w.capacity == 320
    # its pool full: no growth, whatever it runs
    d.inflight["gpu0"] = dict.fromkeys(range(320))
    w.metrics = ServerMetrics(running_reqs=320, queued_reqs=0, token_usage=0.95)
    d.adjust_capacity()
    assert w.batch == BatchSize(256, BatchSource.FEEDBACK)


def test_long_answers_lower_the_kv_estimate_of_a_server_not_yet_corrected():
    w = target("gpu0", discover(parse_server_info(server_info("0.5.23", effective=4096)), None, None))
    d = dispatcher([w])
    d.adjust_capacity()
    assert w.batch == BatchSize(98, BatchSource.KV_POOL)  # 281,029 // (0.7 x 4,096): SGLang's first reservation
    for _ in range(16):  # thinking answers of 9,000 tokens to prompts of 1,000
        d.request_size.sent(1000, 32768)
        d.request_size.answered(9000)
    d.adjust_capacity()
    assert w.batch == BatchSize(28, BatchSource.KV_POOL) and w.capacity == 28 + 7  # 281,029 // 10,000


def test_the_operators_fixed_cap_is_kept_and_the_discovered_size_still_shown():
    w = target("gpu0", discover(parse_server_info(server_info("0.5.23", effective=3512)), None, None))
    d = dispatcher([w], max_in_flight_per_worker=72)
    d.inflight["gpu0"] = dict.fromkeys(range(72))
    w.metrics = ServerMetrics(running_reqs=72, queued_reqs=0)
    for _ in range(3):
        d.adjust_capacity()
    assert w.capacity == 72 and d.capacity_for(w) == 72
    ev = w.snapshot()
    assert (ev.batch_size, ev.batch_source) == (3512, "internal_states")


def test_a_worker_not_yet_discovered_shows_no_batch():
    ev = target("gpu0", ServerCapacity()).snapshot()
    assert (ev.batch_size, ev.batch_source, ev.discovered_batch) == (None, "", None)
