"""The JSON bodies the simulator's endpoints answer and read, encoded as SGLang's (orjson) does."""
from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from engine.simulator.protocol import ApiError, bad_request


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
