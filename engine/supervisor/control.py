"""The control socket's server: run_dir/control.sock (0600), one JSON request per line (a supervisor op of
engine.api.ops, read by engine.api.op_codec), one JSON reply per line: {"ok": true, "result": {...}} or
{"ok": false, "error": "text"}. Its client: engine.api.control_socket.request.
"""
from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any, Awaitable, Callable

import orjson

from engine.api.ops import ControlError, Op, WireReply, is_supervisor_op
from engine.api.control_socket import socket_address
from engine.api.op_codec import decode_op, encode_reply_of

log = logging.getLogger("regen.control")

MAX_REQUEST_BYTES = 1 << 20


Handler = Callable[[Op], Awaitable[WireReply | dict[str, Any]]]  # the op's reply type (a dict: its JSON form)


class ControlServer:
    def __init__(self, path: Path, handler: Handler):
        self.path = path
        self.handler = handler
        self._server: asyncio.base_events.Server | None = None
        self._connections: dict[asyncio.Task, asyncio.StreamWriter] = {}

    async def start(self) -> None:
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()  # a stale socket of a dead supervisor (the pid file check ran first)
        old_umask = os.umask(0o177)  # the socket is created 0600, never briefly wider
        try:
            with socket_address(self.path) as address:
                self._server = await asyncio.start_unix_server(self._serve, path=address, limit=MAX_REQUEST_BYTES)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        log.info("control socket %s", self.path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            # end open connections with EOF so their handlers return normally before the loop ends
            for writer in self._connections.values():
                writer.close()
            if self._connections:
                await asyncio.wait(list(self._connections), timeout=2.0)
        try:
            self.path.unlink()
        except FileNotFoundError:
            log.info("control socket %s already removed", self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is None:  # asyncio.start_unix_server runs each connection's handler as a task
            raise RuntimeError("a control connection handled outside a task")
        self._connections[task] = writer
        try:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    writer.write(_reply_error(f"request longer than {MAX_REQUEST_BYTES} bytes"))
                    break
                if not line:
                    break
                if not line.strip():
                    continue
                writer.write(await self._handle_line(line))
                await writer.drain()
        except (ConnectionResetError, BrokenPipeError) as exc:
            log.info("control client went away: %s", exc)
        finally:
            self._connections.pop(task, None)
            writer.close()

    async def _handle_line(self, line: bytes) -> bytes:
        try:
            request = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            return _reply_error(f"request is not JSON: {exc}")
        try:
            op = decode_op(request)
            if not is_supervisor_op(op):
                raise ControlError(f"{op.op} is answered by engine.ctl, not the supervisor's control socket")
        except ControlError as exc:
            return _reply_error(str(exc))
        try:
            result = encode_reply_of(op, await self.handler(op))
        except ControlError as exc:
            return _reply_error(str(exc))
        except Exception as exc:  # a bug in an op must reach the operator, not kill the supervisor
            log.exception("control op %s failed", op.op)
            return _reply_error(f"{op.op} failed: {type(exc).__name__}: {exc}")
        return orjson.dumps({"ok": True, "result": result}) + b"\n"


def _reply_error(text: str) -> bytes:
    return orjson.dumps({"ok": False, "error": text}) + b"\n"
