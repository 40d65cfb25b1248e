"""SGLang's tuning guide as a rule (docs/advanced_features/hyperparameter_tuning.md): token usage < 0.9 while requests
queue means admission is too cautious (lower --schedule-conservativeness); more than about one retraction a minute
means the KV pool runs out (raise it). EvidenceWindow gathers a server's /metrics readings; decide() is pure."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.api.tuning import AnswerTail, TuningEvidence, TuningVerdict
from engine.api.wire import duration_text
from engine.servers.metrics_client import ServerMetrics

USAGE_FULL = 0.9  # the guide's "token usage > 0.9 means good utilization"
RETRACTIONS_PER_MIN = 1.0  # "about one retraction a minute is fine" (issue 38, from the guide's "occasionally")
RAISE_STEP = 0.3  # the guide raises SGLang's 1.0 "to a value like 1.3"
MIN_READINGS = 8  # fewer readings than this tell nothing either way
FREQUENT = 0.5  # the guide's "frequently": in at least half the readings
CLIP_ENV = "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION"  # 0.5.23 srt/environ.py:650, default 4096
CLIP_DEFAULT = 4096
CLIP_PAGE = 256  # a chosen clip is rounded up to a multiple of this
# a chosen clip's tail is covered this many times over by the value (tail_value): at once (768 on bench_spread's
# answers at 0.3) the servers retracted 2.2 times a server-minute, over the guide's once (docs/benchmarks.md)
CLIP_COVER = 2.0
# the new-token ratio under load settles at min(INIT x conservativeness, 1) x FLOOR_FACTOR (SGLANG_INIT_NEW_TOKEN_RATIO,
# SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR: 0.5.23 srt/environ.py, new_token_ratio_tracker.py:20-32; the same in 0.5.5, 0.5.10)
RATIO_INIT = 0.7
RATIO_FLOOR_FACTOR = 0.14
VALUE_STEP = 0.05  # a value the tail asks for is rounded up to a multiple of this


@dataclass(frozen=True)
class Bounds:
    """[workers] conservativeness_min / conservativeness_max: a value regen chooses stays within them."""
    low: float
    high: float

    def text(self) -> str:
        return f"[{self.low:g}, {self.high:g}]"


@dataclass(frozen=True)
class Decision:
    value: float
    verdict: TuningVerdict
    why: str  # the measured figures and what they say
    action: str  # "raised from 1 to 1.3", "kept at 1"

    @property
    def reason(self) -> str:
        return f"{self.why}; {self.action}"


class EvidenceWindow:
    """One server's /metrics readings over one window (a pilot, or one launch), kept as sums: a run reads every
    server twice a second for days."""

    def __init__(self, server: str, source: str):
        self.server, self.source = server, source
        self.first_t: float | None = None
        self.last_t = 0.0
        self.readings = self.queued = self.low_usage_queued = self.capped = 0
        self.usage_sum = self.queue_sum = 0.0
        self.first_retracted: float | None = None
        self.last_retracted: float | None = None

    def add(self, m: ServerMetrics, now: float, batch_cap: int | None = None) -> None:
        """One reading (unix time `now`); a reading without the queue or usage gauge is not counted. `batch_cap`: the
        server's max_running_requests where it is known: a queue behind a full batch is the cap's, not admission's."""
        if m.queued_reqs is None or m.token_usage is None:
            return
        if self.first_t is None:
            self.first_t = now
        self.last_t = now
        self.readings += 1
        self.queue_sum += m.queued_reqs
        if m.queued_reqs > 0:
            self.queued += 1
            self.usage_sum += m.token_usage
            if batch_cap and (m.running_reqs or 0) >= batch_cap:
                self.capped += 1
            else:
                self.low_usage_queued += m.token_usage < USAGE_FULL
        if m.retracted is not None:
            if self.first_retracted is None:
                self.first_retracted = m.retracted
            self.last_retracted = m.retracted

    def evidence(self) -> TuningEvidence | None:
        """What the window read; None before its first reading."""
        if self.first_t is None:
            return None
        retractions = None
        if self.first_retracted is not None and self.last_retracted is not None:
            # a counter the server restarted from 0 inside the window cannot happen: a window is one launch
            retractions = max(0.0, self.last_retracted - self.first_retracted)
        return TuningEvidence(
            server=self.server, source=self.source, measured_at=self.last_t, window_s=self.last_t - self.first_t,
            readings=self.readings, queued_readings=self.queued, low_usage_queued=self.low_usage_queued,
            usage_queued=self.usage_sum / self.queued if self.queued else None,
            mean_queue=self.queue_sum / self.readings, retractions=retractions, capped_queued=self.capped)


@dataclass(frozen=True)
class Pooled:
    """Several servers' evidence added up (a pilot's servers run one workload)."""
    readings: int
    queued: int
    low_usage_queued: int
    capped: int
    usage_queued: float | None
    mean_queue: float | None
    retractions: float | None  # None: no server exports the counter
    minutes: float  # server-minutes the retractions were counted over (each window at least one)

    @property
    def rate(self) -> float | None:
        return None if self.retractions is None else self.retractions / self.minutes if self.minutes else 0.0


def pool(evidence: list[TuningEvidence]) -> Pooled:
    readings = sum(e.readings for e in evidence)
    queued = sum(e.queued_readings for e in evidence)
    usage = sum((e.usage_queued or 0.0) * e.queued_readings for e in evidence)
    queue = sum((e.mean_queue or 0.0) * e.readings for e in evidence)
    counted = [e for e in evidence if e.retractions is not None]
    return Pooled(readings, queued, sum(e.low_usage_queued for e in evidence), sum(e.capped_queued for e in evidence),
                  usage / queued if queued else None,
                  queue / readings if readings else None,
                  sum(e.retractions or 0.0 for e in counted) if counted else None,
                  sum(max(e.window_s, 60.0) for e in counted) / 60.0)


def answer_tail(lengths: Sequence[float], clip: int) -> AnswerTail | None:
    """The answers' lengths against `clip`; None without answers."""
    if not lengths:
        return None
    ordered = sorted(lengths)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    past = [n - clip for n in ordered if n > clip]
    return AnswerTail(clip, len(ordered), float(p99), len(past), sum(past) / len(ordered))


def tail_value(tail: AnswerTail | None) -> float | None:
    """The lowest --schedule-conservativeness whose reservation still covers the answers' tokens past the clip; None
    where no answer passes it. SGLang counts a running request's future need as min(max_new - generated, CLIP) x ratio
    (0.5.23 schedule_policy.py:785-795): an answer within the clip needs at most the clipped count, and lowering the
    ratio only bets on how much of that bound it uses (the guide's case). Tokens past the clip are counted at no ratio,
    and the decode that reaches them retracts; so the ratio settled under load, RATIO_INIT x c x RATIO_FLOOR_FACTOR,
    times the CLIP each such request is counted at, must still cover them on average:
    c >= mean tokens past the clip / (0.7 x 0.14 x CLIP), rounded up to VALUE_STEP."""
    if tail is None or tail.past_clip_mean <= 0:
        return None
    need = tail.past_clip_mean / (RATIO_INIT * RATIO_FLOOR_FACTOR * tail.clip)
    return round(math.ceil(round(need / VALUE_STEP, 6)) * VALUE_STEP, 2)


def tail_text(tail: AnswerTail, value: float) -> str:
    settled = RATIO_INIT * value * RATIO_FLOOR_FACTOR
    return (f"answers' p99 {tail.p99:,.0f} tokens is over SGLang's clip {tail.clip:,} ({tail.past_clip:,} of "
            f"{tail.answers:,} answers past it, {tail.past_clip_mean:,.0f} tokens each past it on average, which no "
            f"ratio counts)" if tail.p99 > tail.clip else
            f"{tail.past_clip:,} of {tail.answers:,} answers are longer than SGLang's clip {tail.clip:,} "
            f"({tail.past_clip_mean:,.0f} tokens each past it on average, which no ratio counts)") + (
        f": at {value:g} the settled ratio {settled:.3f} x {tail.clip:,} = {settled * tail.clip:,.0f} tokens a running "
        "request still covers them")


def decide(current: float, evidence: list[TuningEvidence], bounds: Bounds, floor: float | None = None,
           tail: AnswerTail | None = None) -> Decision:
    """The value for the next launch. `floor`: the highest value this server retracted too often at (never lowered to it
    again). `tail`: the pilot's answers against the clip; a lowered value stays where the reservation still covers
    their tokens past it (tail_value). Retractions come first: a pool that runs out costs the recomputation of every
    retracted request."""
    p = pool(evidence)
    rate = p.rate
    kept = f"kept at {current:g}"
    if rate is not None and rate > RETRACTIONS_PER_MIN and (p.retractions or 0) >= 2:
        why = (f"{p.retractions:.0f} requests retracted in {duration_text(p.minutes * 60)} of serving ({rate:.1f} a "
               f"minute, more than {RETRACTIONS_PER_MIN:g}): the KV pool runs out")
        new = round(min(bounds.high, current + RAISE_STEP), 2)
        if new <= current:
            return Decision(current, TuningVerdict.KEEP, why, f"{kept}, conservativeness_max {bounds.high:g}")
        return Decision(new, TuningVerdict.RAISE, why, f"raised from {current:g} to {new:g}")
    retracted = ("retractions N/A (the servers export no retraction counter)" if rate is None
                 else f"{p.retractions:.0f} retractions ({rate:.1f} a minute)")
    if p.queued < MIN_READINGS:
        return Decision(current, TuningVerdict.KEEP, f"requests queued in {p.queued} of {p.readings} /metrics readings "
                                                     f"(fewer than {MIN_READINGS}): nothing waited on admission", kept)
    if p.capped >= FREQUENT * p.queued:
        return Decision(current, TuningVerdict.KEEP, f"in {p.capped} of {p.queued} readings with requests queued the "
                                                     "servers ran their whole batch (max_running_requests): the cap, not "
                                                     "admission, held them back", kept)
    usage = p.usage_queued or 0.0
    if p.low_usage_queued < FREQUENT * p.queued:
        return Decision(current, TuningVerdict.KEEP, f"token usage {usage:.2f} while requests queued (>= "
                                                     f"{USAGE_FULL:g} in {p.queued - p.low_usage_queued - p.capped} of "
                                                     f"{p.queued} readings): the KV pool limits, {retracted}", kept)
    why = (f"token usage {usage:.2f} (< {USAGE_FULL:g}) in {p.low_usage_queued} of {p.queued} readings with requests "
           f"queued (mean #queue-req {p.mean_queue or 0:.0f}), {retracted}: admission holds requests back")
    target = bounds.low if floor is None else max(bounds.low, round(floor + RAISE_STEP, 2))
    needed = tail_value(tail)
    if tail is not None and needed is not None and needed > target:
        plain, target = target, min(needed, bounds.high)
        if target >= current:
            return Decision(current, TuningVerdict.KEEP, why, f"{kept}: {tail_text(tail, needed)} only at {needed:g} "
                                                              "or above")
        return Decision(target, TuningVerdict.LOWER, why,
                        f"{tail_text(tail, target)}: lowered only to {target:g} (from {current:g}), not to "
                        f"{plain:g}")
    if target >= current:
        at = (f"conservativeness_min {bounds.low:g}" if floor is None or target == bounds.low
              else f"{target:g}, one step above {floor:g} where it retracted too often")
        return Decision(current, TuningVerdict.KEEP, why, f"{kept}, {at}")
    return Decision(target, TuningVerdict.LOWER, why, f"lowered from {current:g} to {target:g}")


def clip_tails(lengths: Sequence[float], clip_now: int) -> list[AnswerTail]:
    """The answers against each clip regen may choose: the multiples of CLIP_PAGE under `clip_now` (a higher clip than
    SGLang's only slows admission: issue 38, 0.82x at 16,384)."""
    return [t for k in range(CLIP_PAGE, clip_now, CLIP_PAGE) if (t := answer_tail(lengths, k)) is not None]


def choose_clip(max_new_tokens: int, clip_now: int, value: float,
                tails: Sequence[AnswerTail]) -> tuple[AnswerTail | None, str]:
    """SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION where it helps: SGLang admits a new request only where its clipped
    max_new_tokens fits in full (0.5.23 schedule_policy.py:1344-1348, 1407-1412) and counts a running one at
    min(max_new - generated, CLIP) x ratio (:785-795); a lower clip admits more. The lowest clip whose tail the settled
    ratio at `value` covers CLIP_COVER times over (tail_value, the rule that bounds the value itself) is chosen: under
    it, answers' tokens past the clip go uncounted and the pool runs out. (the answers at the clip chosen, why);
    (None, why) where no clip under what SGLang now reserves keeps them covered."""
    reserved = min(max_new_tokens, clip_now)
    for tail in sorted(tails, key=lambda t: t.clip):
        if tail.clip >= reserved:
            break
        needed = tail_value(tail)
        if needed is None or needed * CLIP_COVER <= value:
            covered = ("no answer is longer" if needed is None else
                       f"{tail.past_clip:,} of {tail.answers:,} answers are longer, {tail.past_clip_mean:,.1f} tokens "
                       f"each past it on average, covered {CLIP_COVER:g} times over at {value:g} (it needs "
                       f"{needed:g})")
            return tail, (f"SGLang reserves {reserved:,} tokens for each new request (min(max_new_tokens "
                          f"{max_new_tokens:,}, clip {clip_now:,})); answers' p99 {tail.p99:,.0f} tokens: clip set to "
                          f"{tail.clip:,}, the lowest multiple of {CLIP_PAGE} where {covered}")
    return None, (f"SGLang reserves {reserved:,} tokens for each new request (min(max_new_tokens {max_new_tokens:,}, "
                  f"clip {clip_now:,})), and under it the answers' tokens past a lower clip would not be covered "
                  f"{CLIP_COVER:g} times over at {value:g}: SGLang's clip kept")
