"""SGLang's tuning guide as regen applies it (engine/servers/tuning_rule.py): the choice of --schedule-conservativeness
from token usage, queue and retractions, and of the clip env, each expected value worked out by hand in the comment."""
from __future__ import annotations

import pytest

from engine.api.tuning import AnswerTail, TuningEvidence, TuningVerdict
from engine.servers.metrics_client import ServerMetrics
from engine.servers.tuning_rule import (Bounds, EvidenceWindow, answer_tail, choose_clip, clip_tails, decide,
                                        tail_value)

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


def test_the_clip_is_the_lowest_whose_tail_the_chosen_value_still_covers():
    # 100 answers: 90 of 300 tokens, 6 of 700, 4 of 900; max_new_tokens 2,048 under SGLang's clip 4,096: 2,048 reserved.
    # At 0.3 the settled ratio is 0.7 x 0.3 x 0.14 = 0.0294: a clip K covers a mean past it up to 0.0294 x K.
    #   K = 256: (90 x 44 + 6 x 444 + 4 x 644) / 100 = 92 past -> needs 92 / (0.098 x 256) = 3.67
    #   K = 512: (6 x 188 + 4 x 388) / 100 = 26.8 -> needs 26.8 / 50.18 = 0.534 -> 0.55
    #   K = 768: 4 x 132 / 100 = 5.28 -> needs 5.28 / 75.26 = 0.070 -> 0.1, twice over 0.2 <= 0.3: chosen
    lengths = [300] * 90 + [700] * 6 + [900] * 4
    tails = clip_tails(lengths, 4096)
    assert [t.clip for t in tails] == list(range(256, 4096, 256))
    tail, why = choose_clip(2048, 4096, 0.3, tails)
    assert tail == AnswerTail(clip=768, answers=100, p99=900.0, past_clip=4, past_clip_mean=5.28)
    assert why == ("SGLang reserves 2,048 tokens for each new request (min(max_new_tokens 2,048, clip 4,096)); answers' "
                   "p99 900 tokens: clip set to 768, the lowest multiple of 256 where 4 of 100 answers are longer, 5.3 "
                   "tokens each past it on average, covered 2 times over at 0.3 (it needs 0.1)")
    # 512's tail needs 0.55: covered twice over only from 1.1
    assert choose_clip(2048, 4096, 0.6, tails)[0].clip == 768
    assert choose_clip(2048, 4096, 1.1, tails)[0].clip == 512
    # 0.1 twice over is over 0.15: 768 is not covered, 1,024 (no answer longer) is
    assert choose_clip(2048, 4096, 0.15, tails)[0].clip == 1024


def test_every_answer_within_a_lower_clip_sets_it_and_a_heavy_tail_keeps_sglangs():
    # every answer 3,000 tokens: 2,816 leaves 184 each past it (needs 184 / 275.97 = 0.67: 0.7 > 0.3); 3,072 none
    tail, why = choose_clip(32768, 4096, 0.3, clip_tails([3000] * 50, 4096))
    assert tail.clip == 3072 and why.endswith("clip set to 3,072, the lowest multiple of 256 where no answer is longer")
    tail, why = choose_clip(32768, 4096, 0.3, clip_tails([5000] * 50, 4096))
    assert tail is None
    assert why == ("SGLang reserves 4,096 tokens for each new request (min(max_new_tokens 32,768, clip 4,096)), and "
                   "under it the answers' tokens past a lower clip would not be covered 2 times over at 0.3: SGLang's "
                   "clip kept")
    # only clips under what SGLang reserves: max_new_tokens 512 with answers of 600 (truncated at 512 in a real run)
    assert choose_clip(512, 4096, 0.3, clip_tails([600] * 50, 4096))[0] is None
    assert choose_clip(32768, 4096, 0.3, [])[0] is None  # no pilot answers


SEED_TAIL = AnswerTail(clip=4096, answers=2000, p99=9300.0, past_clip=132, past_clip_mean=190.0)


def test_answers_past_the_clip_lower_only_as_far_as_the_reservation_still_covers_them():
    # SGLang counts a running request at min(max_new - generated, 4,096) x ratio, the ratio settling at 0.7 x c x 0.14;
    # 190 tokens past the clip per answer need c >= 190 / (0.098 x 4,096 = 401.4) = 0.473 -> 0.5 (a multiple of 0.05)
    assert tail_value(SEED_TAIL) == 0.5
    d = decide(1.0, [ev()], GUIDE, tail=SEED_TAIL)
    assert (d.value, d.verdict) == (0.5, TuningVerdict.LOWER)
    # at 0.5 the settled ratio is 0.7 x 0.5 x 0.14 = 0.049; 0.049 x 4,096 = 200.7 tokens
    assert d.action == ("answers' p99 9,300 tokens is over SGLang's clip 4,096 (132 of 2,000 answers past it, 190 "
                        "tokens each past it on average, which no ratio counts): at 0.5 the settled ratio 0.049 x 4,096 "
                        "= 201 tokens a running request still covers them: lowered only to 0.5 (from 1), not to 0.3")
    assert d.why.endswith("admission holds requests back")


def test_answers_within_the_clip_or_a_thin_tail_lower_as_the_guide_says():
    within = AnswerTail(clip=4096, answers=2000, p99=1100.0, past_clip=0, past_clip_mean=0.0)  # bench_spread's
    assert tail_value(within) is None
    assert decide(1.0, [ev()], GUIDE, tail=within) == decide(1.0, [ev()], GUIDE)
    # 20 past the clip per answer: 20 / 401.4 = 0.0498 -> 0.05, under conservativeness_min 0.3: the guide's 0.3
    thin = AnswerTail(clip=4096, answers=2000, p99=3900.0, past_clip=10, past_clip_mean=20.0)
    assert tail_value(thin) == 0.05
    assert decide(1.0, [ev()], GUIDE, tail=thin).action == "lowered from 1 to 0.3"
    # the floor's one step above where it retracted (0.6 + 0.3 = 0.9) is above the tail's 0.5: the floor decides
    assert decide(1.2, [ev()], GUIDE, floor=0.6, tail=SEED_TAIL).value == 0.9


def test_a_tail_that_needs_more_than_the_current_value_keeps_it():
    # 450 past the clip: 450 / 401.4 = 1.121 -> 1.15 >= 1: not lowered; a pool that runs out still raises
    heavy = AnswerTail(clip=4096, answers=2000, p99=14000.0, past_clip=300, past_clip_mean=450.0)
    d = decide(1.0, [ev()], GUIDE, tail=heavy)
    assert (d.value, d.verdict) == (1.0, TuningVerdict.KEEP)
    assert d.action.startswith("kept at 1: answers' p99 14,000 tokens is over SGLang's clip 4,096")
    assert d.action.endswith("only at 1.15 or above")
    assert decide(1.0, [ev(retractions=5)], GUIDE, tail=heavy).verdict == TuningVerdict.RAISE


def test_the_tail_is_measured_from_the_answers_against_the_clip():
    # 100 answers: 98 of 100 tokens, one of 5,000 and one of 9,096; p99 = the 99th of 100 sorted = 5,000;
    # past the clip 4,096: 904 + 5,000 = 5,904 over 100 answers = 59.04 each
    t = answer_tail([100] * 98 + [9096, 5000], 4096)
    assert t == AnswerTail(clip=4096, answers=100, p99=5000.0, past_clip=2, past_clip_mean=59.04)
    assert answer_tail([], 4096) is None
