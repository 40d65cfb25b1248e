"""aiohttp application: SGLang's endpoints (paths, status codes and JSON shapes of http_server.py)."""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from engine.simulator.metrics import CONTENT_TYPE
from engine.simulator.protocol import ApiError, GenerateItem, bad_request, parse_generate
from engine.simulator.request import RequestState, SimRequest

if TYPE_CHECKING:
    from engine.simulator.server import SimServer

FLUSH_TEXT = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
              "requests, the operation will not be performed.)\n")


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error_response(exc: ApiError) -> web.Response:
    return json_response(exc.body, exc.status)


async def read_json(request: web.Request, *, allow_empty: bool = False) -> Any:
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise bad_request("The request body is empty; a JSON object is expected.")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from exc


def build_app(server: "SimServer") -> web.Application:
    handlers = Handlers(server)

    @web.middleware
    async def sglang_middleware(request: web.Request, handler):
        if server.faults.hung:
            await server.faults.hang_future()  # --sim-hang-after: the port stays open, nothing answers
        key = server.cfg.api_key
        path = request.path
        if key and not (path.startswith("/health") or path.startswith("/metrics")):
            if request.headers.get("Authorization", "") != f"Bearer {key}":
                response = json_response({"error": "Unauthorized"}, 401)
                server.log.access(_peer(request), request.method, path, 401)
                return response
        try:
            response = await handler(request)
        except ApiError as exc:
            response = error_response(exc)
        except web.HTTPException as exc:  # 404/405 from the router
            server.log.access(_peer(request), request.method, request.path_qs, exc.status)
            raise
        server.log.access(_peer(request), request.method, request.path_qs, response.status)
        return response

    app = web.Application(middlewares=[sglang_middleware], client_max_size=512 * 1024 * 1024)
    r = app.router
    r.add_get("/health", handlers.health)
    r.add_get("/health_generate", handlers.health)
    r.add_get("/ping", handlers.ping)
    r.add_get("/get_model_info", handlers.model_info)
    r.add_get("/get_server_info", handlers.server_info)
    if server.profile.new_info_paths:  # 0.5.10+: the new paths, the /get_* ones kept as aliases
        r.add_get("/model_info", handlers.model_info)
        r.add_get("/server_info", handlers.server_info)
    r.add_get("/get_load", handlers.get_load)
    r.add_get("/sim/gpu", handlers.sim_gpu)  # the simulator's own: its modelled GPUs (engine/simulator/gpu.py)
    r.add_get("/get_weight_version", handlers.weight_version)
    r.add_get("/v1/models", handlers.models)
    r.add_post("/generate", handlers.generate)
    r.add_put("/generate", handlers.generate)
    r.add_post("/abort_request", handlers.abort_request)
    r.add_route("GET", "/flush_cache", handlers.flush_cache)
    r.add_post("/flush_cache", handlers.flush_cache)
    r.add_post("/pause_generation", handlers.pause_generation)
    r.add_post("/continue_generation", handlers.continue_generation)
    r.add_post("/separate_reasoning", handlers.separate_reasoning)
    from engine.simulator.openai_chat import ChatHandler

    r.add_post("/v1/chat/completions", ChatHandler(server, handlers).handle)
    if server.metrics is not None:
        r.add_get("/metrics", handlers.metrics)
    return app


def _value_error(exc: ApiError) -> bool:
    """A 400 raised by SGLang's tokenizer manager as a ValueError (its body {"error": {"message": ...}}), which a
    streamed request gets as an error event; 0.5.23's schema gate (a plain-string error) answers before streaming."""
    return exc.status == 400 and isinstance(exc.body, dict) and isinstance(exc.body.get("error"), dict)


def _peer(request: web.Request) -> str:
    peer = request.transport.get_extra_info("peername") if request.transport else None
    return f"{peer[0]}:{peer[1]}" if peer else "unknown:0"


class Handlers:
    def __init__(self, server: "SimServer"):
        self.server = server

    # --- health / info ----------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=await self.server.health())

    async def ping(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        """0.5.5's fields; 0.5.10 adds the model type and architectures, 0.5.23 the served name and parsers."""
        s = self.server
        cfg = s.cfg
        info = {"model_path": cfg.model_path, "tokenizer_path": cfg.tokenizer, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False}
        if s.profile.new_info_paths:
            info["model_type"] = s.model_cfg.get("model_type")
            info["architectures"] = s.model_cfg.get("architectures")
        if s.profile.model_info_names_server:
            info.update(served_model_name=cfg.model_name, load_format="auto", reasoning_parser=cfg.reasoning_parser,
                        tool_call_parser=None, disaggregation_mode="null")
        return json_response(info)

    async def weight_version(self, request: web.Request) -> web.Response:
        return json_response({"weight_version": "default"})

    async def server_info(self, request: web.Request) -> web.Response:
        """`{**server_args, **scheduler_info, internal_states, version}`. `max_running_requests` is the launch
        flag (null when not passed); the batch the scheduler works with is in internal_states from 0.5.10 only."""
        s = self.server
        args = s.cfg.server_args_dict()
        args["context_length"] = s.context_len
        args["max_total_tokens"] = s.max_total_tokens
        args["chunked_prefill_size"] = s.chunked_prefill_size
        kv_gb = s.max_total_tokens * s.mem.kv_bytes_per_token / (1 << 30)
        state = dict(args, last_gen_throughput=s.started_scheduler.last_gen_throughput,
                     memory_usage={"weight": round(s.mem.weight_gb, 2), "kvcache": round(kv_gb, 2),
                                   "token_capacity": s.max_total_tokens, "graph": 0.5})
        if s.profile.reports_effective_max_running:
            state["effective_max_running_requests_per_dp"] = s.running_per_dp
        states = [dict(state) for _ in range(max(1, s.cfg.dp_size))]  # one per DP rank's scheduler
        return json_response({**args, "status": "ready" if s.status == "ready" else s.status,
                              "max_total_num_tokens": s.max_total_tokens, "max_req_input_len": s.max_req_input_len,
                              "internal_states": states, "version": s.profile.reported_version + "+sim"})

    async def sim_gpu(self, request: web.Request) -> web.Response:
        s = self.server
        busy_s = s.scheduler.busy_s if s.scheduler is not None else 0.0
        return json_response(s.gpus.readings(s.status in ("ready", "draining"), busy_s))

    async def get_load(self, request: web.Request) -> web.Response:
        sch = self.server.started_scheduler
        return json_response([{"dp_rank": 0, "num_reqs": sch.num_running + sch.num_waiting,
                               "num_waiting_reqs": sch.num_waiting, "num_tokens": sch.used_tokens()}])

    async def models(self, request: web.Request) -> web.Response:
        name = self.server.cfg.model_name
        return json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(self.server.started_at), "owned_by": "sglang",
            "root": name, "parent": None, "max_model_len": self.server.context_len}]})

    async def metrics(self, request: web.Request) -> web.Response:
        metrics = self.server.metrics
        if metrics is None:  # the route exists only with --enable-metrics (build_app)
            raise RuntimeError("GET /metrics routed to a server without --enable-metrics")
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    # --- control -------------------------------------------------------------------------------------------
    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request, allow_empty=True)
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object.")
        rid = body.get("rid") or ""
        abort_all = bool(body.get("abort_all", False))
        if rid or abort_all:
            self.server.started_scheduler.abort(str(rid), abort_all=abort_all)
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = self.server.started_scheduler.flush_cache()
        return web.Response(text=FLUSH_TEXT, status=200 if ok else 400)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await read_json(request, allow_empty=True)
        mode = body.get("mode", "abort") if isinstance(body, dict) else "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise bad_request(f"mode must be one of abort, retract, in_place; got {mode!r}")
        self.server.pause(mode)
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.server.resume()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def separate_reasoning(self, request: web.Request) -> web.Response:
        from engine.simulator.openai_chat import split_reasoning

        body = await read_json(request)
        reasoning, text = split_reasoning(str(body.get("text", "")), force=body.get("reasoning_parser") in
                                          ("qwen3-thinking", "deepseek-r1"))
        return json_response({"reasoning_text": reasoning, "text": text})

    # --- generation -------------------------------------------------------------------------------------------
    def unavailable(self) -> ApiError | None:
        status = self.server.status  # draining still serves (contract 7.4)
        if status in ("stopped", "crashed"):
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

    async def generate(self, request: web.Request) -> web.StreamResponse:
        s = self.server
        err = self.unavailable()
        if err is not None:
            raise err
        body = await read_json(request)
        streamed = isinstance(body, dict) and bool(body.get("stream"))
        try:
            items, is_batch = parse_generate(body, s.loaded_tokenizer.encode, s.profile)
            reqs = await self.submit(items)
        except ApiError as exc:
            if streamed and _value_error(exc):
                return await self.stream_error(request, exc)
            raise
        try:
            if isinstance(body, dict) and body.get("stream"):
                return await self.stream(request, reqs, items, is_batch)
            await self.run(reqs)
            await self.never_answered(reqs)
            out = [self.result(req) for req in reqs]
            return json_response(out if is_batch else out[0])
        finally:
            self.release(reqs)

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
            await self.run(reqs)
            for index, req in enumerate(reqs):
                chunk = self.result(req)
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
                decoded = self.text_of(req)  # the matched stop cut from the final text
            if finished or n > sent:
                if deltas:
                    text = decoded[len(sent_text):] if decoded.startswith(sent_text) else ""
                else:
                    text = decoded
                chunk: dict[str, Any] = {"text": text, "output_ids": list(ids) if cumulative_ids else new_ids,
                         "meta_info": self.meta_info(req, final=finished, completion_tokens=None if finished else n)}
                sent, sent_text = n, decoded
                if index is not None:
                    chunk["index"] = index
                await queue.put(chunk)
            if finished:
                await queue.put(None)
                return
