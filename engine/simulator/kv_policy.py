"""SGLang's KV policy for the simulated scheduler: what the next step runs (a prefill batch, a decode step, or with
--enable-mixed-chunk both in one), which waiting requests a prefill batch takes, and the retraction (or ratio decay)
before a decode step. The arithmetic is kv_budget.py's; file:line per rule there."""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from engine.simulator.kv_budget import TokenRatio
from engine.simulator.request import RequestState, SimRequest

if TYPE_CHECKING:
    from engine.simulator.scheduler import Scheduler


class StepKind(StrEnum):
    PREFILL = "prefill"  # the admitted requests only: the running ones wait this step out
    DECODE = "decode"  # every running request
    MIXED = "mixed"  # a prefill batch mixed with the running batch (--enable-mixed-chunk): both in one forward pass


@dataclass(frozen=True)
class Step:
    """What one step runs: the requests it admits (their #new-token) and how many running requests decode in it."""
    kind: StepKind
    admitted: list[SimRequest]
    new_tokens: int
    decoding: int

    @property
    def batch(self) -> int:
        """The requests in its forward pass (what the cost model charges per request)."""
        return len(self.admitted) + self.decoding


def next_step(sch: Scheduler) -> Step:
    """A prefill batch runs instead of a decode step whenever one forms (0.5.23 scheduler.py:3975-4005; 0.5.10
    :2255-2270; 0.5.5 :1709-1728). With --enable-mixed-chunk and chunked prefill on (0.5.23 scheduler.py:1376-1378)
    a prefill batch takes the running batch along, each running request decoding in it (:4375-4410; 0.5.10
    :2525-2540; 0.5.5 :1872-1885); from 0.5.23 only when their decode tokens fit the pool after the prefill's, else
    they sit out this step, not retracted (check_decode_mem, :4390-4393); 0.5.5 and 0.5.10 mix them regardless."""
    decoding = len(sch.running)
    admitted, new_tokens = admit(sch)
    if not admitted:
        prepare_decode(sch)
        return Step(StepKind.DECODE, [], 0, len(sch.running))
    if sch.mixed_chunk and decoding and (not sch.mixed_decode_fit_check or rows_fit(sch, decoding)):
        return Step(StepKind.MIXED, admitted, new_tokens, decoding)
    return Step(StepKind.PREFILL, admitted, new_tokens, 0)


def remaining_budget(sch: Scheduler) -> float:
    """The pool less what runs and what the running batch is still expected to need
    (0.5.23 schedule_policy.py:670-680 with :785-795; prefill_budget.py:99-105)."""
    ratio = sch.ratio.current
    expected = sum(sch.rules.running_reserve(r.max_new_tokens, sch.generated_running(r), ratio)
                   for r in sch.running)
    return sch.max_total_tokens - sch.used_tokens() - expected


def admit(sch: Scheduler) -> tuple[list[SimRequest], int]:
    """A prefill batch: waiting requests in order while each fits the budget; returns (them, #new-token).
    With --enable-mixed-chunk the running batch's decode tokens, one a request, come off the KV budget and the
    prefill's token cap first (the adder's num_mixed_decode_tokens = running_bs, 0.5.23 scheduler.py:4165,
    schedule_policy.py:638, prefill_budget.py:70-71; 0.5.10 scheduler.py:2386, schedule_policy.py:398-408; 0.5.5
    scheduler.py:1755, schedule_policy.py:334-340); a spent cap admits no one (0.5.23 scheduler.py:4206-4208)."""
    if not sch.waiting or len(sch.running) >= sch.max_running:
        return [], 0
    admitted: list[SimRequest] = []
    new_tokens = cached = 0
    running_before = len(sch.running)
    mixed_decode = running_before if sch.mixed_chunk else 0
    prefill_cap = sch.max_prefill_tokens - mixed_decode
    if prefill_cap <= 0:
        return [], 0
    now = time.monotonic()
    remaining = remaining_budget(sch) - mixed_decode
    while sch.waiting and len(sch.running) < sch.max_running:
        req = sch.waiting[0]
        resume = req.resume_tokens
        extend = req.prompt_len + resume - sch.cache.match(req.prompt_ids)
        # an idle server always takes the first (max_new_tokens is capped so that it fits, as SGLang caps it)
        if sch.running and sch.rules.need(extend, req.max_new_tokens, resume) >= remaining:
            break  # NO_TOKEN: wait for requests to leave
        if admitted and new_tokens + extend > prefill_cap:
            break
        sch.waiting.popleft()
        remaining -= sch.rules.reservation(extend, req.max_new_tokens)
        req.cached_tokens = sch.cache.match_and_insert(req.prompt_ids)
        req.state = RequestState.RUNNING
        # a retracted request goes on from the output it had (recomputed in this prefill); the prefill step
        # gives it its next tokens and moves start_step one back (_complete_prefill)
        req.start_step = sch.step - resume // sch.tps
        req.resume_tokens = 0
        req.finish_step = req.start_step - 1 + max(1, math.ceil(req.planned_len / sch.tps))
        req.queue_time = now - req.created_mono
        sch.running[req] = None
        if req.stream:
            sch.streaming.add(req)
        heapq.heappush(sch.heap, (req.finish_step, next(sch.seq), req))
        sch.sum_start += req.start_step
        sch.prompt_sum += req.prompt_len
        admitted.append(req)
        new_tokens += req.prompt_len + resume - req.cached_tokens
        cached += req.cached_tokens
        if sch.report.metrics is not None and req.log_metrics:
            sch.report.metrics.queue_time.observe(req.queue_time)
    if admitted:
        sch.report.prefill(new_seq=len(admitted), new_tokens=new_tokens, cached=cached,
                            usage=sch.token_usage(), used_tokens=sch.used_tokens(),
                            running_before=running_before, queued=len(sch.waiting),
                            by_priority=sch.report.by_priority(sch.running, sch.waiting))
    return admitted, new_tokens


def decode_fits(sch: Scheduler) -> bool:
    """The next decode step's tokens fit the pool (0.5.23 schedule_batch.py:3403-3449; 0.5.5 :1491-1501)."""
    return rows_fit(sch, len(sch.running))


def rows_fit(sch: Scheduler, rows: int) -> bool:
    """`rows` requests' decode tokens fit the pool as it is now (check_decode_mem, 0.5.23 schedule_batch.py:3432)."""
    return not sch.max_total_tokens or sch.used_tokens() + rows * sch.tps <= sch.max_total_tokens


def prepare_decode(sch: Scheduler) -> None:
    """Before a decode step: retract when the pool cannot take its tokens, else decay the ratio
    (0.5.23 scheduler.py:4469-4542)."""
    if sch.max_total_tokens and sch.running and not decode_fits(sch):
        retract(sch)
    else:
        sch.ratio.decay_step()


def retract(sch: Scheduler) -> None:
    """Retract the least advanced (the longest prompt first among equals), at least one, until the next step
    fits, always keeping one (0.5.23 schedule_batch.py:3451-3467, order :3542-3580; 0.5.5 :1503-1550)."""
    order = sorted(sch.running, key=lambda r: (sch.generated_running(r), -r.prompt_len))
    retracted: list[SimRequest] = []
    gained = 0
    for req in order:
        if len(sch.running) <= 1 or (retracted and decode_fits(sch)):
            break
        req.resume_tokens = sch.generated_running(req)
        req.retractions += 1
        gained += req.prompt_len + req.resume_tokens
        sch.free(req)  # its KV is freed (not kept in the radix cache): its output is recomputed later
        req.state = RequestState.WAITING
        retracted.append(req)
    if not retracted:
        return
    sch.waiting.extendleft(reversed(retracted))
    old = sch.ratio.current
    sch.ratio.current = TokenRatio.after_retract(
        decoded=sum(sch.generated_running(r) for r in sch.running),
        max_new_unclipped=sum(r.max_new_tokens for r in sch.running), kept=len(sch.running),
        retract_decode_steps=sch.retract_decode_steps)
    sch.retracted_total += len(retracted)
    sch.report.retracted(retracted, tokens_gained=gained, old_ratio=old, new_ratio=sch.ratio.current)

