"""POST/PUT /generate: one or a batch of requests, answered whole or streamed as server-sent events."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from engine.simulator.protocol import ApiError, GenerateItem, parse_generate
from engine.simulator.request import RequestState, SimRequest
from engine.simulator.request_flow import RequestFlow
from engine.simulator.responses import json_response, read_json

if TYPE_CHECKING:
    from engine.simulator.server import SimServer


def _value_error(exc: ApiError) -> bool:
    """A 400 raised by SGLang's tokenizer manager as a ValueError (its body {"error": {"message": ...}}), which a
    streamed request gets as an error event; 0.5.23's schema gate (a plain-string error) answers before streaming."""
    return exc.status == 400 and isinstance(exc.body, dict) and isinstance(exc.body.get("error"), dict)


class GenerateRoute:
    def __init__(self, server: SimServer, flow: RequestFlow):
        self.server = server
        self.flow = flow
        self.dropped = 0  # --sim-drop-first: connections closed unanswered so far

    async def generate(self, request: web.Request) -> web.StreamResponse:
        s = self.server
        err = self.flow.unavailable()
        if err is not None:
            raise err
        if self.dropped < s.cfg.sim_drop_first:
            self.dropped += 1
            if request.transport is not None:
                request.transport.abort()  # the client reads "Server disconnected", no answer
            raise web.HTTPServiceUnavailable()  # never written: the connection is gone
        body = await read_json(request)
        streamed = isinstance(body, dict) and bool(body.get("stream"))
        try:
            items, is_batch = parse_generate(body, s.loaded_tokenizer.encode, s.profile)
            reqs = await self.flow.submit(items)
        except ApiError as exc:
            if streamed and _value_error(exc):
                return await self.stream_error(request, exc)
            raise
        try:
            if isinstance(body, dict) and body.get("stream"):
                return await self.stream(request, reqs, items, is_batch)
            await self.flow.run(reqs)
            await self.flow.never_answered(reqs)
            out = [self.flow.result(req) for req in reqs]
            return json_response(out if is_batch else out[0])
        finally:
            self.flow.release(reqs)

    async def stream_error(self, request: web.Request, exc: ApiError) -> web.StreamResponse:
        """A streamed request that fails SGLang's validation: the checks run inside the response's generator, so
        the answer is HTTP 200 with an error event, then [DONE] (0.5.5 http_server.py stream_results; 0.5.23 adds
        type, code and retryable to the error object; contract 2.4)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        error = dict(exc.body["error"])
        if self.server.profile.stream_error_details:
            error.update(type="invalid_request_error", code=400, retryable=False)
        await response.write(b"data: " + orjson.dumps({"error": error}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def stream(self, request: web.Request, reqs: list[SimRequest], items: list[GenerateItem],
                     is_batch: bool) -> web.StreamResponse:
        """finish_reason null until the last chunk; `text` cumulative and `output_ids` per the version (contract
        2.4): only the new ids in 0.5.5, cumulative from 0.5.10; both deltas with incremental streaming output."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        if self.server.cfg.sim_instant:
            await self.flow.run(reqs)
            for index, req in enumerate(reqs):
                chunk = self.flow.result(req)
                if is_batch:
                    chunk["index"] = index
                await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        else:
            queue: asyncio.Queue = asyncio.Queue()
            for req, item in zip(reqs, items):
                req.stream = True
                req.stream_interval = max(1, item.sampling.get("stream_interval") or 1)
                self.server.started_scheduler.submit(req)
            tasks = [asyncio.create_task(self._stream_one(req, i if is_batch else None, queue))
                     for i, req in enumerate(reqs)]
            try:
                pending = len(tasks)
                while pending:
                    chunk = await queue.get()
                    if chunk is None:
                        pending -= 1
                        continue
                    await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            finally:
                for task in tasks:
                    task.cancel()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _stream_one(self, req: SimRequest, index: int | None, queue: asyncio.Queue) -> None:
        s = self.server
        sch, gen = s.started_scheduler, s.loaded_generator
        deltas = s.cfg.incremental_streaming_output
        cumulative_ids = s.profile.stream_ids_cumulative and not deltas
        sent = 0  # ids already sent
        decoded = ""  # text of the ids so far
        sent_text = ""  # text already sent
        while True:
            progress = req.progress_event()
            await progress.wait()
            progress.clear()
            finished = req.state == RequestState.FINISHED
            n = len(req.final_ids()) if finished else sch.generated(req)
            if not finished and sent and n - sent < req.stream_interval:
                continue  # stream_interval: the first tokens at once, then a chunk every `interval` new tokens
            ids = req.final_ids() if finished else req.plan.output_ids[:n]
            new_ids = list(ids[sent:n])
            if n > sent:
                decoded += gen.decode(new_ids, req.skip_special_tokens)
            if finished:
                decoded = self.flow.text_of(req)  # the matched stop cut from the final text
            if finished or n > sent:
                if deltas:
                    text = decoded[len(sent_text):] if decoded.startswith(sent_text) else ""
                else:
                    text = decoded
                meta = self.flow.meta_info(req, final=finished, completion_tokens=None if finished else n)
                chunk: dict[str, Any] = {"text": text, "output_ids": list(ids) if cumulative_ids else new_ids,
                                         "meta_info": meta}
                sent, sent_text = n, decoded
                req.wake_at = n + req.stream_interval if req.stream_interval > 1 else 0
                if index is not None:
                    chunk["index"] = index
                await queue.put(chunk)
            if finished:
                await queue.put(None)
                return
