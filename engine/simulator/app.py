"""aiohttp application: SGLang's routes (paths, methods) and its middleware (API key, access log, a hung server)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from engine.simulator.control_routes import ControlRoutes
from engine.simulator.generate_route import GenerateRoute
from engine.simulator.info_routes import InfoRoutes
from engine.simulator.openai_chat import ChatHandler
from engine.simulator.protocol import ApiError
from engine.simulator.request_flow import RequestFlow
from engine.simulator.responses import error_response, json_response

if TYPE_CHECKING:
    from engine.simulator.server import SimServer


def build_app(server: SimServer) -> web.Application:
    info, control = InfoRoutes(server), ControlRoutes(server)
    flow = RequestFlow(server)
    generate = GenerateRoute(server, flow)

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
    r.add_get("/health", info.health)
    r.add_get("/health_generate", info.health)
    r.add_get("/ping", info.ping)
    r.add_get("/get_model_info", info.model_info)
    r.add_get("/get_server_info", info.server_info)
    if server.profile.new_info_paths:  # 0.5.10+: the new paths, the /get_* ones kept as aliases
        r.add_get("/model_info", info.model_info)
        r.add_get("/server_info", info.server_info)
    r.add_get("/get_load", info.get_load)
    r.add_get("/sim/gpu", info.sim_gpu)  # the simulator's own: its modelled GPUs (engine/simulator/gpu.py)
    r.add_get("/get_weight_version", info.weight_version)
    r.add_get("/v1/models", info.models)
    r.add_post("/generate", generate.generate)
    r.add_put("/generate", generate.generate)
    r.add_post("/abort_request", control.abort_request)
    r.add_route("GET", "/flush_cache", control.flush_cache)
    r.add_post("/flush_cache", control.flush_cache)
    r.add_post("/pause_generation", control.pause_generation)
    r.add_post("/continue_generation", control.continue_generation)
    r.add_post("/separate_reasoning", control.separate_reasoning)
    r.add_post("/v1/chat/completions", ChatHandler(server, flow).handle)
    if server.metrics is not None:
        r.add_get("/metrics", info.metrics)
    return app


def _peer(request: web.Request) -> str:
    peer = request.transport.get_extra_info("peername") if request.transport else None
    return f"{peer[0]}:{peer[1]}" if peer else "unknown:0"
