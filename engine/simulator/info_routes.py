"""GET endpoints that report on the server: /health, /ping, model and server info, load, models, metrics."""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from engine.simulator.metrics import CONTENT_TYPE
from engine.simulator.responses import json_response
from engine.simulator.server_state import ServerStatus
from engine.simulator.sizing import BYTES_PER_GB

if TYPE_CHECKING:
    from engine.simulator.server import SimServer


class InfoRoutes:
    def __init__(self, server: SimServer):
        self.server = server

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
        kv_gb = s.max_total_tokens * s.mem.kv_bytes_per_token / BYTES_PER_GB
        state = dict(args, last_gen_throughput=s.started_scheduler.last_gen_throughput,
                     memory_usage={"weight": round(s.mem.weight_gb, 2), "kvcache": round(kv_gb, 2),
                                   "token_capacity": s.max_total_tokens, "graph": 0.5})
        if s.profile.reports_effective_max_running:
            state["effective_max_running_requests_per_dp"] = s.running_per_dp
        states = [dict(state) for _ in range(max(1, s.cfg.dp_size))]  # one per DP rank's scheduler
        return json_response({**args, "status": s.status,
                              "max_total_num_tokens": s.max_total_tokens, "max_req_input_len": s.max_req_input_len,
                              "internal_states": states, "version": s.profile.reported_version + "+sim"})

    async def sim_gpu(self, request: web.Request) -> web.Response:
        s = self.server
        busy_s = s.scheduler.busy_s if s.scheduler is not None else 0.0
        return json_response(s.gpus.readings(s.status in (ServerStatus.READY, ServerStatus.DRAINING), busy_s))

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
