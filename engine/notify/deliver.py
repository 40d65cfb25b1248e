"""Delivery of one notification to one destination (a webhook or a command), with bounded retries.

Each destination raises DeliveryError with what went wrong in words; `with_retries` tries again
with exponential backoff unless the error is permanent (an HTTP 4xx, a program that does not
exist), and never past a deadline (the bounded flush at exit)."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import aiohttp
import orjson

from engine.config.load import NotifyConfig, redact_url
from engine.notify.formats import webhook_request
from engine.notify.message import Notification

log = logging.getLogger("regen.notify")

OUTPUT_MAX = 2000  # characters of a command's stdout/stderr kept in the log line


class DeliveryError(Exception):
    def __init__(self, message: str, *, permanent: bool = False):
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True)
class Destination:
    name: str  # for the log and the alert, secrets left out: "webhook https://hooks.slack.com/…"
    send: Callable[[Notification, float], Awaitable[str]]  # (notification, timeout_s) -> what answered


def destinations(cfg: NotifyConfig, session_factory: Callable[[], aiohttp.ClientSession]) -> list[Destination]:
    out = []
    if cfg.url:
        url = cfg.url

        async def send_webhook(n: Notification, timeout_s: float) -> str:
            return await post_webhook(session_factory(), url, cfg.format, cfg.headers, n, timeout_s)

        out.append(Destination(f"webhook {redact_url(url)} ({cfg.format})", send_webhook))
    if cfg.command:
        argv = list(cfg.command)

        async def send_command(n: Notification, timeout_s: float) -> str:
            return await run_command(argv, n, timeout_s)

        out.append(Destination(f"command {argv[0]}", send_command))
    return out


async def post_webhook(session: aiohttp.ClientSession, url: str, fmt: str, headers: dict[str, str],
                       n: Notification, timeout_s: float) -> str:
    req = webhook_request(n, fmt, headers)
    try:
        async with session.post(url, json=req.json, data=req.data, headers=req.headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if 200 <= resp.status < 300:
                return f"HTTP {resp.status}"
            body = (await resp.text(errors="replace")).strip()[:300]
            # a 4xx other than 408/429 will not change by asking again (wrong URL, bad token, body refused)
            permanent = 400 <= resp.status < 500 and resp.status not in (408, 429)
            hint = "; check notify.url, notify.headers and notify.format" if permanent else ""
            raise DeliveryError(f"HTTP {resp.status} {resp.reason}: {body or '(empty body)'}{hint}",
                                permanent=permanent)
    except asyncio.TimeoutError as exc:
        raise DeliveryError(f"no answer within {timeout_s:.1f} s (notify.timeout_s)") from exc
    except aiohttp.ClientError as exc:
        raise DeliveryError(f"{type(exc).__name__}: {exc}") from exc


def command_env(n: Notification) -> dict[str, str]:
    return {f"REGEN_NOTIFY_{k.upper()}": str(v) for k, v in n.to_dict().items()}


async def run_command(argv: list[str], n: Notification, timeout_s: float) -> str:
    """Run argv with the notification JSON on stdin and REGEN_NOTIFY_* in the environment; its
    stdout and stderr go to the log whatever the outcome. Exit 0 is delivered."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **command_env(n)}, start_new_session=True)
    except OSError as exc:
        raise DeliveryError(f"cannot run {argv[0]}: {exc}; check notify.command", permanent=True) from exc
    try:
        out, err = await asyncio.wait_for(proc.communicate(orjson.dumps(n.to_dict())), timeout_s)
    except asyncio.TimeoutError as exc:
        # the whole group: a child left holding the pipes would keep communicate() waiting
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            log.info("notify command %s (pid %d) exited as its timeout hit", argv[0], proc.pid)
        out, err = await proc.communicate()
        _log_output(argv, proc.returncode, out, err)
        raise DeliveryError(f"{argv[0]} still running after {timeout_s:.1f} s (notify.timeout_s): killed") from exc
    _log_output(argv, proc.returncode, out, err)
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip()[-300:] or out.decode(errors="replace").strip()[-300:]
        raise DeliveryError(f"{argv[0]} exited with {proc.returncode}: {tail or '(no output)'}")
    return f"{argv[0]} exit 0"


def _log_output(argv: list[str], code: int | None, out: bytes, err: bytes) -> None:
    def show(b: bytes) -> str:
        text = b.decode(errors="replace").strip()
        return (text if len(text) <= OUTPUT_MAX else "…" + text[-OUTPUT_MAX:]) or "(empty)"

    log.log(logging.INFO if code == 0 else logging.WARNING, "notify command %s exited with %s; stdout: %s; stderr: %s",
            argv[0], code, show(out), show(err))


async def with_retries(dest: Destination, n: Notification, cfg: NotifyConfig,
                       deadline: Callable[[], float | None] = lambda: None) -> str:
    """Deliver or raise DeliveryError naming the tries made and the last error. `deadline()` (monotonic,
    None: none) is read before each try: the exit flush sets it while a delivery is under way."""
    last: DeliveryError | None = None
    tries = 0
    for attempt in range(cfg.retries):
        limit = deadline()
        remaining = None if limit is None else limit - time.monotonic()
        if remaining is not None and remaining <= 0.05:
            break
        tries += 1
        try:
            return await dest.send(n, cfg.timeout_s if remaining is None else min(cfg.timeout_s, remaining))
        except DeliveryError as exc:
            last = exc
            log.warning("notification %r to %s: try %d of %d failed: %s", n.title, dest.name, attempt + 1,
                        cfg.retries, exc)
            if exc.permanent or attempt + 1 == cfg.retries:
                break
        backoff = cfg.retry_backoff_s * 2 ** attempt
        limit = deadline()
        if limit is not None:
            backoff = min(backoff, max(0.0, limit - time.monotonic()))
        await asyncio.sleep(backoff)
    if last is None:
        raise DeliveryError("not tried: the exit flush deadline (notify.flush_timeout_s) had passed")
    cut = " (the exit flush deadline, notify.flush_timeout_s, cut the retries)" if (
        tries < cfg.retries and not last.permanent) else ""
    raise DeliveryError(f"{tries} {'try' if tries == 1 else 'tries'}{cut}: {last}", permanent=last.permanent)
