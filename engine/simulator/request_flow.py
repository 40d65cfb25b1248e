"""A generation request's way through the server, shared by /generate and the OpenAI chat route."""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from engine.simulator.protocol import ApiError, GenerateItem
from engine.simulator.request import RequestState, SimRequest
from engine.simulator.server_state import ServerStatus

if TYPE_CHECKING:
    from engine.simulator.server import SimServer


class RequestFlow:
    """Admit (validate, plan, hold the rid), run to the end, answer with SGLang's meta_info, release."""

    def __init__(self, server: SimServer):
        self.server = server

    def unavailable(self) -> ApiError | None:
        status = self.server.status  # draining still serves (contract 7.4)
        if status in (ServerStatus.STOPPED, ServerStatus.CRASHED):
            return ApiError(503, {"object": "error", "message": "The scheduler is dead.", "type": "503",
                                  "param": None, "code": 503})
        return None

    async def submit(self, items: list[GenerateItem]) -> list[SimRequest]:
        """Validate, plan and schedule; the caller owns the in-flight rids until it calls release()."""
        s = self.server
        s.intake.check_request(items)
        s.intake.check_5xx(items)
        if s.paused:
            await s.wait_unpaused()  # 0.5.5: new requests block until /continue_generation
        s.intake.check_request(items)  # a duplicate may have arrived while we waited
        reqs = []
        for item in items:
            plan = s.intake.plan_for(item)
            reqs.append(SimRequest(rid=item.rid, prompt_ids=item.prompt_ids, plan=plan,
                                   max_new_tokens=s.intake.max_new_for(item),
                                   skip_special_tokens=item.sampling["skip_special_tokens"],
                                   no_stop_trim=item.sampling["no_stop_trim"], priority=item.priority))
        for req in reqs:
            earlier = s.in_flight_rids.get(req.rid)
            if earlier is not None:  # 0.5.5 (0.5.10+ refused it in check_request): the new state replaces it
                earlier.overwritten = True
            s.in_flight_rids[req.rid] = req
        return reqs

    def release(self, reqs: list[SimRequest]) -> None:
        for req in reqs:
            if self.server.in_flight_rids.get(req.rid) is req:
                del self.server.in_flight_rids[req.rid]
            if req.state in (RequestState.WAITING, RequestState.RUNNING):
                self.server.started_scheduler.abort_one(req)  # the client went away: SGLang aborts the request

    async def never_answered(self, reqs: list[SimRequest]) -> None:
        """0.5.5: a request whose rid a later one took over gets no answer; it waits until its client leaves."""
        if any(req.overwritten for req in reqs):
            await self.server.wait_stopped()
            raise self.unavailable() or ApiError(503, {"object": "error", "message": "The server stopped.",
                                                       "type": "503", "param": None, "code": 503})

    def text_of(self, req: SimRequest) -> str:
        return self.server.intake.text_of(req)

    def meta_info(self, req: SimRequest, *, final: bool = True, completion_tokens: int | None = None) -> dict:
        if final and req.aborted_in_queue:
            return {"id": req.rid, "finish_reason": req.finish_reason, "completion_tokens": 0}
        n = len(req.final_ids()) if completion_tokens is None else completion_tokens
        now = time.time()
        profile = self.server.profile
        meta: dict[str, Any] = {"id": req.rid, "finish_reason": req.finish_reason if final else None,
                "prompt_tokens": req.prompt_len, "weight_version": "default", profile.retractions_key: req.retractions,
                "completion_tokens": n, "cached_tokens": req.cached_tokens}
        if profile.reports_reasoning_tokens:
            meta["reasoning_tokens"] = self._reasoning_tokens(req, completion_tokens)
        meta.update(e2e_latency=time.monotonic() - req.created_mono, queue_time=req.queue_time,
                    response_sent_to_client_ts=now)
        if self.server.metrics is not None:
            meta["prefill_launch_delay"] = req.queue_time
            meta["prefill_launch_latency"] = 0.0
        return meta

    def _reasoning_tokens(self, req: SimRequest, completion_tokens: int | None) -> int:
        if completion_tokens is None and req.output_ids is req.plan.output_ids:
            return req.plan.reasoning_tokens
        ids = req.final_ids() if completion_tokens is None else req.plan.output_ids[:completion_tokens]
        return self.server.loaded_generator.reasoning_count(ids, req.plan.prompt_opened)

    def result(self, req: SimRequest) -> dict:
        return {"text": self.text_of(req), "output_ids": req.output_ids, "meta_info": self.meta_info(req)}

    async def run(self, reqs: list[SimRequest]) -> None:
        """Run to completion (scheduler or instant path)."""
        s = self.server
        if s.cfg.sim_instant:
            for req in reqs:
                s.finish_instant(req)
            return
        scheduler = s.started_scheduler
        for req in reqs:
            scheduler.submit(req)
        await asyncio.gather(*(req.done_future() for req in reqs))
