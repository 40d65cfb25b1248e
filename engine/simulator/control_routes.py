"""Endpoints that steer the server: /abort_request, /flush_cache, pause and continue, /separate_reasoning."""
from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from engine.simulator.openai_chat import FORCED_REASONING_PARSERS, split_reasoning
from engine.simulator.protocol import bad_request
from engine.simulator.responses import json_response, read_json
from engine.simulator.server_state import PauseMode

if TYPE_CHECKING:
    from engine.simulator.server import SimServer

FLUSH_TEXT = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
              "requests, the operation will not be performed.)\n")


class ControlRoutes:
    def __init__(self, server: SimServer):
        self.server = server

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
        if mode not in tuple(PauseMode):
            raise bad_request(f"mode must be one of abort, retract, in_place; got {mode!r}")
        self.server.pause(PauseMode(mode))
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.server.resume()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def separate_reasoning(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        reasoning, text = split_reasoning(str(body.get("text", "")),
                                          force=body.get("reasoning_parser") in FORCED_REASONING_PARSERS)
        return json_response({"reasoning_text": reasoning, "text": text})
