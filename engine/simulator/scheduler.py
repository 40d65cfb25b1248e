"""Continuous batching: one asyncio task per server steps a running batch, fed from a waiting queue.

Cost model (the formula `regen plan --pilot` and the tests rely on). With B running requests a
decode step takes

    step_s = (step_ms + step_ms_per_req * B) / 1000      (+ prefill_ms_per_1k * new_uncached_tokens / 1e6
                                                            on steps that admit requests)

and gives every running request `tokens_per_step` tokens, so

    throughput(B) = B * tokens_per_step / step_s   tokens/s

which grows with B and saturates at 1000 * tokens_per_step / step_ms_per_req.

Requests join at step boundaries while fewer than max_running_requests run, the KV pool has room
for their prompt plus their *estimated* output, and the step's new prompt tokens stay under
max_prefill_tokens; a finished request leaves at the end of the step that produced its last
token. Per-request progress is never stepped token by token: each running request records the
step it joined and the step it will finish, kept in a heap.

The KV pool, as SGLang runs it (contract 1.3): admission does not know an answer's length, it reserves
`min(max_new_tokens, CLIP_MAX_NEW_TOKENS) * new_token_ratio` per request, the ratio starting at
INIT_NEW_TOKEN_RATIO and decaying each step towards its floor, so the batch grows past what the pool can
finish. When a decode step finds no room for the running batch's next tokens, requests are retracted
back to the front of the waiting queue (the least advanced first), their KV freed: their output so far
is recomputed (prefilled again) when they are admitted again, and the ratio is raised to what the batch
really used. The log says `KV cache pool is full. Retract requests. #retracted_reqs: N, #new_token_ratio:
a -> b`; meta_info counts a request's retractions under the profile's key. An abort of a retracted request
still waiting ends it "Abort in waiting queue", with no output, like any waiting request.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from engine.simulator.generator import OutputPlan, abort_finish
from engine.simulator.metrics import SimMetrics
from engine.simulator.prefix_cache import PrefixCache
from engine.simulator.simlog import SimLog

CUDA_GRAPH_MAX_BS = 256
# SGLang's defaults (SGLANG_INIT_NEW_TOKEN_RATIO, ..._MIN_NEW_TOKEN_RATIO_FACTOR, ..._NEW_TOKEN_RATIO_DECAY_STEPS,
# CLIP_MAX_NEW_TOKENS, SGLANG_RETRACT_DECODE_STEPS), as values: the mechanism is modelled, not copied
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
CLIP_MAX_NEW_TOKENS = 4096
RETRACT_DECODE_STEPS = 20


@dataclass(eq=False)
class SimRequest:
    rid: str
    prompt_ids: list[int]
    plan: OutputPlan
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    priority: int | None = None
    stream: bool = False
    stream_interval: int = 1  # streaming: a chunk once this many new tokens are out (sampling_params.stream_interval)
    max_new_tokens: int = CLIP_MAX_NEW_TOKENS  # what admission estimates the answer from (it does not know plan)
    log_metrics: bool = True
    created: float = field(default_factory=time.time)
    created_mono: float = field(default_factory=time.monotonic)
    state: str = "new"  # new | waiting | running | finished
    cached_tokens: int = 0
    start_step: int = 0
    finish_step: int = 0
    queue_time: float = 0.0
    first_token_mono: float | None = None
    output_ids: list[int] | None = None  # set when finished
    finish_reason: dict | None = None
    aborted_in_queue: bool = False
    retractions: int = 0  # times the KV pool ran out while it ran (meta_info's retraction count)
    resume_tokens: int = 0  # retracted: the output it had, recomputed when it runs again
    overwritten: bool = False  # 0.5.5: a later request with the same rid took its place (no answer)
    done: asyncio.Future | None = None
    progress: asyncio.Event | None = None  # streaming: set after every step that advanced it

    def final_ids(self) -> list[int]:
        """Its output, once finished (asking before is a bug)."""
        if self.output_ids is None:
            raise RuntimeError(f"request {self.rid!r} has no output yet: it has not finished")
        return self.output_ids

    def done_future(self) -> asyncio.Future:
        """Resolved when it finishes; Scheduler.submit gives it one (waiting on one never submitted is a bug)."""
        if self.done is None:
            raise RuntimeError(f"request {self.rid!r} is waited on before it was submitted")
        return self.done

    def progress_event(self) -> asyncio.Event:
        """Set after every step that advanced it; Scheduler.submit gives a streamed request one."""
        if self.progress is None:
            raise RuntimeError(f"request {self.rid!r} is followed as a stream but was not submitted as one")
        return self.progress

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def planned_len(self) -> int:
        return len(self.plan.output_ids)


class Scheduler:
    def __init__(self, *, log: SimLog, metrics: SimMetrics | None, max_running: int, max_total_tokens: int,
                 max_prefill_tokens: int, step_ms: float, step_ms_per_req: float, tokens_per_step: int,
                 prefill_ms_per_1k: float, decode_log_interval: int,
                 on_finish: Callable[[SimRequest], None], page_size: int = 1, radix_cache: bool = True):
        self.log = log
        self.metrics = metrics
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

        self.waiting: deque[SimRequest] = deque()
        self.running: dict[SimRequest, None] = {}  # insertion-ordered set
        self._heap: list[tuple[int, int, SimRequest]] = []
        self._seq = itertools.count()
        self._streaming: set[SimRequest] = set()
        self.step = 0  # completed decode steps
        self._sum_start = 0
        self._prompt_sum = 0
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.min_new_token_ratio = INIT_NEW_TOKEN_RATIO * MIN_NEW_TOKEN_RATIO_FACTOR
        self._ratio_decay = (self.new_token_ratio - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.retracted_total = 0  # requests retracted since the start
        self.last_retracted = 0  # in the last retraction (sglang:num_retracted_reqs)
        self._wake = asyncio.Event()
        self._frozen = False
        self._held = False
        self._task: asyncio.Task | None = None
        self.last_gen_throughput = 0.0
        self._interval_tokens = 0
        self._interval_t0 = time.monotonic()
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
        return (f"Simulator: simulated GPU time {self.busy_s:.3f} s busy, {self.step} steps, {self.tokens_made} tokens"
                " generated (the simulator's cost model; not an SGLang line)")

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

    # --- requests -----------------------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        loop = asyncio.get_running_loop()
        req.done = loop.create_future()
        if req.stream:
            req.progress = asyncio.Event()
        req.state = "waiting"
        self.waiting.append(req)
        self._wake.set()

    def generated(self, req: SimRequest) -> int:
        """Tokens produced so far."""
        if req.state == "finished":
            return len(req.output_ids or ())
        if req.state != "running":
            return req.resume_tokens  # waiting: 0, or what it had when it was retracted
        return min(req.planned_len, (self.step - req.start_step) * self.tps)

    def abort(self, rid: str, abort_all: bool = False) -> int:
        """Abort requests whose rid starts with `rid` (SGLang's scheduler matches prefixes)."""
        count = 0
        for req in list(self.waiting):
            if abort_all or req.rid.startswith(rid):
                self.waiting.remove(req)
                req.aborted_in_queue = True
                self._finish(req, [], {"type": "abort", "message": "Abort in waiting queue"})
                count += 1
        for req in list(self.running):
            if abort_all or req.rid.startswith(rid):
                self._leave(req)
                self._finish(req, req.plan.output_ids[: self.generated_running(req)], abort_finish())
                count += 1
        return count

    def abort_one(self, req: SimRequest) -> None:
        """Abort one request (its client went away)."""
        if req.state == "waiting":
            self.waiting.remove(req)
            req.aborted_in_queue = True
            self._finish(req, [], {"type": "abort", "message": "Abort in waiting queue"})
        elif req.state == "running":
            self._leave(req)
            self._finish(req, req.plan.output_ids[: self.generated_running(req)], abort_finish())

    def hold(self, held: bool) -> None:
        """pause_generation mode in_place/retract: keep the batch but take no steps until released."""
        self._held = held
        self._wake.set()

    def generated_running(self, req: SimRequest) -> int:
        return min(req.planned_len, (self.step - req.start_step) * self.tps)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def used_tokens(self) -> int:
        generated = self.tps * (len(self.running) * self.step - self._sum_start)
        return self._prompt_sum + generated

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
        self._free(req)

    def _free(self, req: SimRequest) -> None:
        del self.running[req]
        self._streaming.discard(req)
        self._sum_start -= req.start_step
        self._prompt_sum -= req.prompt_len

    def _finish(self, req: SimRequest, output_ids: list[int], finish_reason: dict) -> None:
        req.state = "finished"
        req.output_ids = output_ids
        req.finish_reason = finish_reason
        if req.progress is not None:
            req.progress.set()
        if req.done is not None and not req.done.done():
            req.done.set_result(None)
        self.on_finish(req)

    def _admit(self) -> tuple[list[SimRequest], int]:
        """Move waiting requests into the batch; returns (the admitted requests, #new-token)."""
        admitted: list[SimRequest] = []
        new_seq = new_tokens = cached = 0
        running_before = len(self.running)
        now = time.monotonic()
        ratio = self.new_token_ratio
        promised = self.used_tokens() + ratio * sum(  # what the running batch is expected to need still
            max(0, min(r.max_new_tokens, CLIP_MAX_NEW_TOKENS) - self.generated_running(r)) for r in self.running) \
            if self.waiting else 0.0
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            recompute = req.resume_tokens
            need = req.prompt_len + recompute + ratio * max(0, min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS) - recompute)
            if self.running and promised + need > self.max_total_tokens:
                break  # KV pool full (as estimated): wait for requests to leave
            if new_seq and new_tokens + req.prompt_len + recompute > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            promised += need
            req.cached_tokens = self.cache.match_and_insert(req.prompt_ids)
            req.state = "running"
            # a retracted request goes on from the output it had (recomputed in this prefill)
            req.start_step = self.step - recompute // self.tps
            req.resume_tokens = 0
            req.finish_step = req.start_step + max(1, math.ceil(req.planned_len / self.tps))
            req.queue_time = now - req.created_mono
            self.running[req] = None
            if req.stream:
                self._streaming.add(req)
            heapq.heappush(self._heap, (req.finish_step, next(self._seq), req))
            self._sum_start += req.start_step
            self._prompt_sum += req.prompt_len
            admitted.append(req)
            new_seq += 1
            new_tokens += req.prompt_len + recompute - req.cached_tokens
            cached += req.cached_tokens
            if self.metrics is not None and req.log_metrics:
                self.metrics.queue_time.observe(req.queue_time)
        if new_seq:
            usage = self.token_usage()
            self.log.sched(f"Prefill batch, #new-seq: {new_seq}, #new-token: {new_tokens}, #cached-token: {cached}, "
                          f"token usage: {usage:.2f}, #running-req: {running_before}, #queue-req: {len(self.waiting)},")
            if self.metrics is not None:
                total = new_tokens + cached
                self.metrics.set_scheduler_gauges(
                    running=running_before, queued=len(self.waiting), used_tokens=self.used_tokens(),
                    token_usage=usage, cache_hit_rate=(cached / total if total else 0.0),
                    by_priority=self._by_priority())
        return admitted, new_tokens

    def _complete_step(self, admitted: list[SimRequest]) -> int:
        """Account one finished step: finish requests whose last token it produced. Returns tokens made."""
        self.step += 1
        made = len(self.running) * self.tps
        self.last_output_mono = time.monotonic()
        heap = self._heap
        now = time.monotonic()
        for req in admitted:  # the prefill step produced their first token
            req.first_token_mono = now
        while heap and heap[0][0] <= self.step:
            finish_step, _, req = heapq.heappop(heap)
            if req.state != "running" or finish_step != req.finish_step:
                continue  # aborted or retracted earlier (a retracted one has a newer entry); lazily dropped
            made -= (req.finish_step - req.start_step) * self.tps - req.planned_len
            self._leave(req)
            self._finish(req, req.plan.output_ids, req.plan.finish_reason)
        for req in self._streaming:
            if req.first_token_mono is None:
                req.first_token_mono = now
            req.progress_event().set()
        return made

    def _retract_if_full(self) -> None:
        """Before a decode step: no room in the pool for the batch's next tokens -> retract the least advanced
        requests (the longest prompt first among equals) to the front of the waiting queue until the rest can run
        RETRACT_DECODE_STEPS more steps, and raise the admission ratio to what the batch really used."""
        if not self.running or not self.max_total_tokens:
            return
        if self.used_tokens() + len(self.running) * self.tps <= self.max_total_tokens:
            return
        order = sorted(self.running, key=lambda r: (self.generated_running(r), -r.prompt_len))
        retracted: list[SimRequest] = []
        for req in order:
            if len(self.running) <= 1 or \
                    self.used_tokens() + len(self.running) * self.tps * RETRACT_DECODE_STEPS <= self.max_total_tokens:
                break
            req.resume_tokens = self.generated_running(req)
            req.retractions += 1
            self._free(req)  # its KV is freed (not kept in the radix cache): its output is recomputed later
            req.state = "waiting"
            retracted.append(req)
        if not retracted:
            return
        self.waiting.extendleft(reversed(retracted))
        old = self.new_token_ratio
        decoded = sum(self.generated_running(r) for r in self.running)
        wanted = sum(min(r.max_new_tokens, CLIP_MAX_NEW_TOKENS) for r in self.running)
        if wanted:
            self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * self.tps * len(self.running)) / wanted)
        self.retracted_total += len(retracted)
        self.last_retracted = len(retracted)
        self.log.sched(f"KV cache pool is full. Retract requests. #retracted_reqs: {len(retracted)}, "
                       f"#new_token_ratio: {old:.4f} -> {self.new_token_ratio:.4f}")
        if self.metrics is not None:
            self.metrics.set_retracted(len(retracted))

    def _by_priority(self) -> dict[str, tuple[int, int]] | None:
        """(running, queued) per request priority, when the metrics export per-priority series."""
        if self.metrics is None or not self.metrics.priority:
            return None
        split: dict[str, list[int]] = {}
        for req in self.running:
            split.setdefault(str(req.priority or 0), [0, 0])[0] += 1
        for req in self.waiting:
            split.setdefault(str(req.priority or 0), [0, 0])[1] += 1
        return {p: (r, q) for p, (r, q) in split.items()}

    def _log_decode(self) -> None:
        now = time.monotonic()
        elapsed = now - self._interval_t0
        self.last_gen_throughput = self._interval_tokens / elapsed if elapsed > 0 else 0.0
        self._interval_tokens = 0
        self._interval_t0 = now
        usage = self.token_usage()
        cuda_graph = len(self.running) <= CUDA_GRAPH_MAX_BS
        self.log.sched(f"Decode batch, #running-req: {len(self.running)}, #token: {self.used_tokens()}, "
                      f"token usage: {usage:.2f}, cuda graph: {cuda_graph}, "
                      f"gen throughput (token/s): {self.last_gen_throughput:.2f}, #queue-req: {len(self.waiting)},")
        if self.metrics is not None:
            self.metrics.set_scheduler_gauges(
                running=len(self.running), queued=len(self.waiting), used_tokens=self.used_tokens(),
                token_usage=usage, gen_throughput=self.last_gen_throughput, cache_hit_rate=0.0,
                cuda_graph=cuda_graph, by_priority=self._by_priority())

    def _report_idle(self) -> None:
        self.log.info(self.accounting_line())
        self.last_gen_throughput = 0.0
        if self.metrics is not None:
            self.metrics.set_scheduler_gauges(running=0, queued=len(self.waiting), used_tokens=0, token_usage=0.0,
                                              gen_throughput=0.0, by_priority=self._by_priority())
        self._idle_reported = True

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
                self._interval_t0 = time.monotonic()
                self._interval_tokens = 0
                continue
            self._idle_reported = False
            admitted, new_tokens = self._admit()
            self._retract_if_full()
            self.new_token_ratio = max(self.min_new_token_ratio, self.new_token_ratio - self._ratio_decay)
            batch = len(self.running)
            step_s = (self.step_ms + self.step_ms_per_req * batch) / 1000.0
            step_s += self.prefill_ms_per_1k * new_tokens / 1e6
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
            made = self._complete_step(admitted)
            self.busy_s += step_s
            self.tokens_made += made
            self._interval_tokens += made
            if self.step % self.decode_log_interval == 0:
                self._log_decode()
