"""Continuous batching as SGLang schedules it: each step is a prefill batch or a decode step (or, with
--enable-mixed-chunk, a prefill batch mixed with the running batch), over a KV pool.

Cost model (`regen plan --pilot` relies on it): a step over B requests takes (step_ms + step_ms_per_req * B) / 1000 s,
a prefill step plus prefill_ms_per_1k per 1000 uncached tokens; a decode step gives each `tokens_per_step` tokens.
Admission, retraction and the new-token ratio follow SGLang rule for rule (kv_budget.py cites each).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from typing import Callable

from engine.simulator.batch_report import BatchReporter
from engine.simulator.generator import abort_finish
from engine.simulator.kv_budget import AdmissionRules, SchedulingDefaults, TokenRatio
from engine.simulator.kv_policy import Step, StepKind, next_step
from engine.simulator.metrics import SimMetrics
from engine.simulator.prefix_cache import PrefixCache
from engine.simulator.profiles import DEFAULT_VERSION, PROFILES, Profile
from engine.simulator.request import RequestState, SimRequest
from engine.simulator.simlog import SimLog

WAITING_ABORT = {"type": "abort", "message": "Abort in waiting queue"}


class Scheduler:
    def __init__(self, *, log: SimLog, metrics: SimMetrics | None, max_running: int, max_total_tokens: int,
                 max_prefill_tokens: int, step_ms: float, step_ms_per_req: float, tokens_per_step: int,
                 prefill_ms_per_1k: float, decode_log_interval: int,
                 on_finish: Callable[[SimRequest], None], page_size: int = 1, radix_cache: bool = True,
                 profile: Profile | None = None, scheduling: SchedulingDefaults | None = None,
                 conservativeness: float = 1.0, mixed_chunk: bool = False):
        profile = profile or PROFILES[DEFAULT_VERSION]
        scheduling = scheduling or profile.scheduling
        self.log = log
        self.report = BatchReporter(log, metrics, profile)
        self.max_running = max_running
        self.max_total_tokens = max_total_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.step_ms = step_ms
        self.step_ms_per_req = step_ms_per_req
        self.tps = tokens_per_step
        self.prefill_ms_per_1k = prefill_ms_per_1k
        self.decode_log_interval = decode_log_interval
        self.on_finish = on_finish
        self.cache = PrefixCache(max_total_tokens if radix_cache else 0, page_size)
        self.rules = AdmissionRules(clip=scheduling.clip_max_new_tokens, page_size=page_size,
                                    page_in_check=profile.admission_page_in_check,
                                    page_in_reserve=profile.admission_page_in_reserve)
        self.retract_decode_steps = scheduling.retract_decode_steps
        # --enable-mixed-chunk with chunked prefill on (SGLang's is_mixed_chunk, 0.5.23 scheduler.py:1376-1378)
        self.mixed_chunk = mixed_chunk
        self.mixed_decode_fit_check = profile.mixed_decode_fit_check
        self.ratio = TokenRatio.from_defaults(scheduling, conservativeness)

        self.waiting: deque[SimRequest] = deque()
        self.running: dict[SimRequest, None] = {}  # insertion-ordered set
        self.heap: list[tuple[int, int, SimRequest]] = []
        self.seq = itertools.count()
        self.streaming: set[SimRequest] = set()
        self.step = 0  # completed steps that advanced the running batch: decode steps and mixed ones
        self.decode_steps = 0  # SGLang's forward_ct_decode: a mixed step is a prefill step, not counted here
        self.prefill_steps = 0  # mixed ones included
        self.sum_start = 0
        self.prompt_sum = 0
        self.retracted_total = 0  # requests retracted since the start
        self._wake = asyncio.Event()
        self._frozen = False
        self._held = False
        self._task: asyncio.Task | None = None
        self._idle_reported = True
        self.last_output_mono = 0.0  # when a step last produced output (what /health waits for)
        # the simulator's own accounting (no SGLang figure): simulated GPU time spent in steps, by the cost model,
        # whatever the wall clock did; logged as a "Simulator:" line when the server goes idle and when it stops
        self.busy_s = 0.0
        self.tokens_made = 0

    # --- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="sim-scheduler")

    def add_done_callback(self, callback: Callable[[asyncio.Task], object]) -> None:
        if self._task is None:
            raise RuntimeError("Scheduler.add_done_callback() before start()")
        self._task.add_done_callback(callback)

    def accounting_line(self) -> str:
        steps = self.decode_steps + self.prefill_steps
        return (f"Simulator: simulated GPU time {self.busy_s:.3f} s busy, {steps} steps, "
                f"{self.tokens_made} tokens generated (the simulator's cost model; not an SGLang line)")

    async def stop(self) -> None:
        if self._task is not None:
            self.log.info(self.accounting_line())
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass  # the cancellation we asked for
            self._task = None

    def freeze(self) -> None:
        """--sim-hang-after: no more steps; running requests never finish."""
        self._frozen = True

    @property
    def last_gen_throughput(self) -> float:
        return self.report.last_gen_throughput

    # --- requests -----------------------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        loop = asyncio.get_running_loop()
        req.done = loop.create_future()
        if req.stream:
            req.progress = asyncio.Event()
        req.state = RequestState.WAITING
        self.waiting.append(req)
        self._wake.set()

    def generated(self, req: SimRequest) -> int:
        """Tokens produced so far."""
        if req.state == RequestState.FINISHED:
            return len(req.output_ids or ())
        if req.state != RequestState.RUNNING:
            return req.resume_tokens  # waiting: 0, or what it had when it was retracted
        return self.generated_running(req)

    def generated_running(self, req: SimRequest) -> int:
        return min(req.planned_len, (self.step - req.start_step) * self.tps)

    def abort(self, rid: str, abort_all: bool = False) -> int:
        """Abort requests whose rid starts with `rid` (SGLang's scheduler matches prefixes)."""
        matched = [r for r in (*self.waiting, *self.running) if abort_all or r.rid.startswith(rid)]
        for req in matched:
            self.abort_one(req)
        return len(matched)

    def abort_one(self, req: SimRequest) -> None:
        """Abort one request (its client went away)."""
        if req.state == RequestState.WAITING:
            self.waiting.remove(req)
            req.aborted_in_queue = True
            self._finish(req, [], dict(WAITING_ABORT))
        elif req.state == RequestState.RUNNING:
            self._leave(req)
            self._finish(req, req.plan.output_ids[: self.generated_running(req)], abort_finish())

    def hold(self, held: bool) -> None:
        """pause_generation mode in_place/retract: keep the batch but take no steps until released."""
        self._held = held
        self._wake.set()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def used_tokens(self) -> int:
        generated = self.tps * (len(self.running) * self.step - self.sum_start)
        return self.prompt_sum + generated

    def token_usage(self) -> float:
        return min(1.0, self.used_tokens() / self.max_total_tokens) if self.max_total_tokens else 0.0

    def flush_cache(self) -> bool:
        if self.running or self.waiting:
            self.log.sched(f"Cache not flushed because there are pending requests. #queue-req: {len(self.waiting)}, "
                           f"#running-req: {len(self.running)}")
            return False
        self.cache.clear()
        self.log.sched("Cache flushed successfully!")
        return True

    # --- internals ------------------------------------------------------------------------------------
    def _leave(self, req: SimRequest) -> None:
        # its KV stays in the radix cache: the prompt and what it generated, less the last token (never fed back)
        self.cache.insert(req.prompt_ids + req.plan.output_ids[: self.generated_running(req)][:-1])
        self.free(req)

    def free(self, req: SimRequest) -> None:
        del self.running[req]
        self.streaming.discard(req)
        self.sum_start -= req.start_step
        self.prompt_sum -= req.prompt_len

    def _finish(self, req: SimRequest, output_ids: list[int], finish_reason: dict) -> None:
        req.state = RequestState.FINISHED
        req.output_ids = output_ids
        req.finish_reason = finish_reason
        if req.progress is not None:
            req.progress.set()
        if req.done is not None and not req.done.done():
            req.done.set_result(None)
        self.on_finish(req)

    def _finish_due(self) -> int:
        """Finish the requests whose last token the step produced; returns the tokens they were over-credited."""
        over = 0
        while self.heap and self.heap[0][0] <= self.step:
            finish_step, _, req = heapq.heappop(self.heap)
            if req.state != RequestState.RUNNING or finish_step != req.finish_step:
                continue  # aborted or retracted earlier (a retracted one has a newer entry); lazily dropped
            over += (req.finish_step - req.start_step) * self.tps - req.planned_len
            self._leave(req)
            self._finish(req, req.plan.output_ids, req.plan.finish_reason)
        return over

    def _complete_prefill(self, admitted: list[SimRequest]) -> int:
        """Account a prefill step: only the new requests got tokens. Returns tokens made."""
        self.prefill_steps += 1
        now = self.last_output_mono = time.monotonic()
        made = 0
        for req in admitted:
            if req.state != RequestState.RUNNING:
                continue  # aborted during the step
            before = self.generated_running(req)
            req.start_step -= 1
            self.sum_start -= 1
            made += self.generated_running(req) - before
            req.first_token_mono = now
            if req.stream:
                req.progress_event().set()
        self._finish_due()
        return made

    def _complete_decode(self, admitted: list[SimRequest] | None = None) -> int:
        """Account a decode step: every running request got its tokens. Returns tokens made. A mixed step passes
        the requests it admitted: they are running already and get their first tokens with the others."""
        self.step += 1
        if admitted is None:
            self.decode_steps += 1
        else:
            self.prefill_steps += 1
        made = len(self.running) * self.tps
        now = self.last_output_mono = time.monotonic()
        for req in admitted or ():
            if req.state == RequestState.RUNNING:
                req.first_token_mono = now
                # admit() timed its finish for a prefill step, which moves its start back a step instead of
                # advancing the batch: its last token comes one step later on this clock
                req.finish_step += 1
                heapq.heappush(self.heap, (req.finish_step, next(self.seq), req))
        made -= self._finish_due()
        for req in self.streaming:
            if req.first_token_mono is None:
                req.first_token_mono = now
            if req.wake_at <= 0 or self.generated_running(req) >= req.wake_at:
                req.progress_event().set()
        return made

    def _report_idle(self) -> None:
        """Idle: the accounting line, zeroed gauges, and the ratio back to its start (0.5.23 scheduler.py:5318)."""
        self.log.info(self.accounting_line())
        self.ratio.reset()
        self.report.idle(len(self.waiting), self.report.by_priority(self.running, self.waiting))
        self._idle_reported = True

    def _step_seconds(self, step: Step) -> float:
        # a mixed step is one forward pass: its fixed cost once, per request over the decode rows and the admitted
        # ones alike, plus the prefill's per-token cost
        return ((self.step_ms + self.step_ms_per_req * step.batch) / 1000.0
                + self.prefill_ms_per_1k * step.new_tokens / 1e6)

    def _complete(self, step: Step) -> int:
        if step.kind == StepKind.PREFILL:
            return self._complete_prefill(step.admitted)
        return self._complete_decode(step.admitted if step.kind == StepKind.MIXED else None)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if self._frozen:
                await asyncio.Event().wait()  # hung for good (cancelled by stop())
            if self._held or (not self.running and not self.waiting):
                if not self._idle_reported and not self._held:
                    self._report_idle()
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
                self.report.restart_interval()
                continue
            self._idle_reported = False
            step = next_step(self)
            step_s = self._step_seconds(step)
            deadline += step_s
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)  # let the HTTP side run even when the steps are free
                if delay < -step_s:
                    deadline = loop.time()  # fell behind (loaded machine): do not burst to catch up
            if self._frozen:
                continue
            made = self._complete(step)
            self.busy_s += step_s
            self.tokens_made += made
            self.report.interval_tokens += made
            # a mixed step logs its Prefill batch line only and is no decode step for the interval (0.5.23
            # batch_result_processor.py:510 vs :1102-1108; 0.5.5 scheduler_output_processor_mixin.py:424)
            if step.kind == StepKind.DECODE and self.decode_steps % self.decode_log_interval == 0:
                self.report.decode(running=len(self.running), queued=len(self.waiting),
                                   used_tokens=self.used_tokens(), usage=self.token_usage(),
                                   by_priority=self.report.by_priority(self.running, self.waiting))
