"""SGLang's tuning guide as regen applies it (engine/servers/tuning_rule.py): the choice of --schedule-conservativeness
from token usage, queue and retractions, and of the clip env, each expected value worked out by hand in the comment."""
from __future__ import annotations

import pytest

from engine.api.tuning import TuningEvidence, TuningVerdict
from engine.servers.metrics_client import ServerMetrics
from engine.servers.tuning_rule import Bounds, EvidenceWindow, choose_clip, decide

GUIDE = Bounds(0.3, 1.3)  # the config's defaults: the guide's "a value like 0.3" and "a value like 1.3"


def ev(*, readings=40, queued=30, low=27, usage=0.5, queue=12.0, retractions=0.0, window_s=120.0, capped=0,
       server="gpu0") -> TuningEvidence:
    return TuningEvidence(server=server, source=f"{server} /metrics", measured_at=1000.0, window_s=window_s,
                          readings=readings, queued_readings=queued, low_usage_queued=low, usage_queued=usage,
                          mean_queue=queue, retractions=retractions, capped_queued=capped)


def test_low_usage_while_requests_queue_lowers_to_the_minimum():
    # 27 of 30 queued readings under 0.9 (27 >= 0.5 x 30), no retraction: admission is too cautious -> the minimum
    d = decide(1.0, [ev()], GUIDE)
    assert (d.value, d.verdict) == (0.3, TuningVerdict.LOWER)
    assert d.reason == ("token usage 0.50 (< 0.9) in 27 of 30 readings with requests queued (mean #queue-req 12), "
                        "0 retractions (0.0 a minute): admission holds requests back; lowered from 1 to 0.3")


def test_more_than_one_retraction_a_minute_raises_one_step():
    # 5 retractions in 120 s = 2.5 a minute > 1: 1.0 + 0.3 = 1.3; from 0.3: 0.6; from 1.2: capped at 1.3
    d = decide(1.0, [ev(retractions=5)], GUIDE)
    assert (d.value, d.verdict) == (1.3, TuningVerdict.RAISE)
    assert d.why == "5 requests retracted in 2m00s of serving (2.5 a minute, more than 1): the KV pool runs out"
    assert decide(0.3, [ev(retractions=5)], GUIDE).value == 0.6
    assert decide(1.2, [ev(retractions=5)], GUIDE).value == 1.3
    at_max = decide(1.3, [ev(retractions=5)], GUIDE)
    assert (at_max.value, at_max.verdict, at_max.action) == (1.3, TuningVerdict.KEEP,
                                                             "kept at 1.3, conservativeness_max 1.3")


def test_a_window_under_a_minute_counts_as_one_minute():
    # 2 retractions in 10 s: 2 / max(10 s, 60 s) = 2 a minute -> raise; 1 in 10 s: 1 a minute, not more than 1
    assert ev(retractions=2, window_s=10).retractions_per_min == 2.0
    assert decide(0.3, [ev(retractions=2, window_s=10)], GUIDE).verdict == TuningVerdict.RAISE
    one = decide(1.0, [ev(retractions=1, window_s=10, usage=0.95, low=0)], GUIDE)
    assert one.verdict == TuningVerdict.KEEP and "1 retractions (1.0 a minute)" in one.why


def test_retractions_are_counted_over_every_servers_minutes():
    # gpu0: 3 in 30 s (one minute counted), gpu1: 0 in 120 s (two): 3 / 3 server-minutes = 1.0 a minute: not raised
    d = decide(1.0, [ev(retractions=3, window_s=30, usage=0.95, low=0), ev(retractions=0, window_s=120, usage=0.95,
                                                                          low=0, server="gpu1")], GUIDE)
    assert d.verdict == TuningVerdict.KEEP and "3 retractions (1.0 a minute)" in d.why


def test_a_full_pool_a_batch_cap_or_no_queue_keep_the_value():
    full = decide(1.0, [ev(usage=0.95, low=3)], GUIDE)  # 3 of 30 under 0.9 < 15: the pool limits
    assert full.verdict == TuningVerdict.KEEP
    assert full.why == ("token usage 0.95 while requests queued (>= 0.9 in 27 of 30 readings): the KV pool limits, 0 "
                        "retractions (0.0 a minute)")
    capped = decide(1.0, [ev(low=5, capped=25)], GUIDE)  # 25 of 30 queued readings at max_running_requests
    assert capped.verdict == TuningVerdict.KEEP and "the cap, not admission, held them back" in capped.why
    idle = decide(1.0, [ev(queued=7, low=7)], GUIDE)  # 7 queued readings: fewer than 8
    assert idle.verdict == TuningVerdict.KEEP and idle.why.startswith("requests queued in 7 of 40 /metrics readings")


def test_lowering_stops_one_step_above_where_the_server_retracted_too_often():
    # it retracted too often at 0.6 (raised to 0.9, then 1.2): low usage lowers it to 0.6 + 0.3 = 0.9, never to 0.3
    d = decide(1.2, [ev()], GUIDE, floor=0.6)
    assert (d.value, d.verdict) == (0.9, TuningVerdict.LOWER)
    again = decide(0.9, [ev()], GUIDE, floor=0.6)
    assert again.verdict == TuningVerdict.KEEP and again.action == "kept at 0.9, 0.9, one step above 0.6 where it " \
                                                                    "retracted too often"


def test_without_a_retraction_counter_the_rule_still_lowers_and_says_na():
    d = decide(1.0, [ev(retractions=None)], GUIDE)
    assert d.verdict == TuningVerdict.LOWER and "retractions N/A (the servers export no retraction counter)" in d.why


def test_the_window_keeps_sums_and_counts_the_retraction_counters_growth():
    w = EvidenceWindow("gpu0", "gpu0 /metrics since its launch")
    assert w.evidence() is None
    w.add(ServerMetrics(running_reqs=10, queued_reqs=0, token_usage=0.2, retracted=4), 100.0)
    w.add(ServerMetrics(running_reqs=10, queued_reqs=6, token_usage=0.4, retracted=4), 101.0)
    w.add(ServerMetrics(running_reqs=32, queued_reqs=2, token_usage=0.3, retracted=7), 102.0, batch_cap=32)
    w.add(ServerMetrics(running_reqs=12, queued_reqs=4, token_usage=0.95, retracted=9), 104.0)
    w.add(ServerMetrics(running_reqs=None, queued_reqs=None, token_usage=None), 105.0)  # a failed reading: not counted
    e = w.evidence()
    # 4 readings over 4 s; queued in 3 (6, 2, 4), usage mean (0.4 + 0.3 + 0.95) / 3 = 0.55; under 0.9 and below the
    # batch cap in 1 (0.4: the 0.3 ran its whole batch of 32); mean queue (0 + 6 + 2 + 4) / 4 = 3; retractions 9 - 4 = 5
    assert (e.readings, e.queued_readings, e.low_usage_queued, e.capped_queued, e.window_s, e.retractions) == (
        4, 3, 1, 1, 4.0, 5.0)
    assert e.usage_queued == pytest.approx(0.55) and e.mean_queue == 3.0 and e.measured_at == 104.0
    none = EvidenceWindow("gpu0", "x")
    none.add(ServerMetrics(running_reqs=1, queued_reqs=0, token_usage=0.1, retracted=None), 1.0)
    assert none.evidence().retractions is None  # SGLang 0.5.5: N/A, not 0


def test_the_clip_is_set_only_where_answers_are_far_shorter_than_what_sglang_reserves():
    # max_new_tokens 32,768, clip 4,096: 4,096 reserved; p99 700 -> 2 x 700 = 1,400 -> 1,536 (a multiple of 256),
    # and 2 x 1,536 = 3,072 <= 4,096: set
    clip, why = choose_clip(32768, 4096, 700)
    assert clip == 1536 and "clip set to 1,536 (twice the p99, rounded up to 256)" in why
    # p99 1,200 -> 2,560, 2 x 2,560 = 5,120 > 4,096: not worth it
    assert choose_clip(32768, 4096, 1200)[0] is None
    # the demo: max_new_tokens 1,024 reserved, p99 458 -> 1,024, 2 x 1,024 > 1,024: SGLang's clip kept
    assert choose_clip(1024, 4096, 458) == (None, "answers' p99 458 tokens: twice it (1,024) is not under half the "
                                                  "1,024 reserved per new request; SGLang's clip kept")
    assert choose_clip(32768, 4096, None)[0] is None
