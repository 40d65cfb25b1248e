"""SimRequest: one /generate request as the simulated scheduler holds it, from submission to its answer."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import StrEnum

from engine.simulator.generator import OutputPlan


class RequestState(StrEnum):
    NEW = "new"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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
    # streaming: its reader is woken once this many tokens are out (0: every step), so a step over a large batch does
    # not wake every reader only for it to find its next chunk not due yet
    wake_at: int = 0
    max_new_tokens: int = 4096  # what admission estimates the answer from (it does not know plan)
    log_metrics: bool = True
    created: float = field(default_factory=time.time)
    created_mono: float = field(default_factory=time.monotonic)
    state: RequestState = RequestState.NEW
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
