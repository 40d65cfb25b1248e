"""A server's HTTP readings: /health, /metrics (engine.servers.metrics_client) and /get_server_info (its size)."""
from __future__ import annotations

import asyncio
import logging

import aiohttp

from engine.servers.capacity import ServerCapacity, parse_server_info
from engine.servers.metrics_client import ServerMetrics, parse_metrics

log = logging.getLogger("regen.workers")


async def health_ok(session: aiohttp.ClientSession, url: str, headers: dict[str, str], timeout: float) -> bool:
    try:
        async with session.get(url + "/health", headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


async def scrape_metrics(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> tuple[ServerMetrics, str | None]:
    """The server's gauges, and the error of the reading (None: read)."""
    try:
        async with session.get(url + "/metrics", headers=headers, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            text = await resp.text()
            if resp.status != 200:
                return ServerMetrics(), f"/metrics -> HTTP {resp.status} (is --enable-metrics set?)"
        return parse_metrics(text), None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return ServerMetrics(), f"/metrics failed: {type(exc).__name__}: {exc}"


async def read_server_info(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                           name: str) -> ServerCapacity | None:
    """The server's batch size and context length (/get_server_info, or /server_info in newer SGLang);
    None, with the reason logged, if neither answers."""
    for path in ("/get_server_info", "/server_info"):
        try:
            async with session.get(url + path, headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status == 200:
                    info = parse_server_info(await resp.json(content_type=None))
                    log.info("worker %s: %s", name, info)
                    return info
                text = await resp.text()
                log.warning("worker %s: GET %s -> %d %s", name, path, resp.status, text[:200])
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.warning("worker %s: GET %s failed: %s", name, path, exc)
    return None
