"""Console side of the control socket: runs `<host_python> -m engine.ctl --run-dir D ...` on the host
through a Transport and parses its JSON; follow() streams telemetry events (one stream: the loop that reconnects
and backfills is console/follow.py)."""
from __future__ import annotations

import json
from typing import AsyncIterator

from console.transport import Transport, TransportError, quote_argv
from engine.telemetry_events import Event, parse_event

CTL_TIMEOUT_S = 60.0
EXIT_ERROR_REPLY, EXIT_UNREACHABLE = 1, 2


class RunClientError(Exception):
    """The host answered with an error (kind "error") or no supervisor could be reached ("unreachable")."""

    def __init__(self, message: str, kind: str = "error", stderr: str = ""):
        super().__init__(message)
        self.kind = kind
        self.stderr = stderr


class NoSupervisor(RunClientError):
    """Nothing answers at the run dir's control socket: the run is stopped, finished, or its supervisor died."""

    def __init__(self, message: str, stderr: str = ""):
        super().__init__(message, kind="unreachable", stderr=stderr)


def engine_command(host_python: str, engine_path: str | None, argv: list[str]) -> str:
    """A shell command running `host_python argv...` with the deployed engine on PYTHONPATH."""
    cmd = quote_argv([host_python, *argv])
    if engine_path:
        cmd = f"PYTHONPATH={quote_argv([engine_path])} {cmd}"
    return cmd


class RunClient:
    def __init__(self, transport: Transport, run_dir: str, host_python: str = "python3",
                 engine_path: str | None = None):
        self.transport = transport
        self.run_dir = run_dir
        self.host_python = host_python
        self.engine_path = engine_path
        self._ctl_lacks_no_shards = False

    def _command(self, *args: str) -> str:
        return engine_command(self.host_python, self.engine_path, ["-m", "engine.ctl", "--run-dir", self.run_dir, *args])

    async def _ctl(self, *args: str) -> dict:
        command = self._command(*args)
        try:
            result = await self.transport.run(command, timeout=CTL_TIMEOUT_S)
        except TransportError as exc:
            raise RunClientError(f"cannot reach {self.transport.name}: {exc}", kind="unreachable") from exc
        where = f"{self.transport.name}:{self.run_dir}"
        stderr = result.stderr.strip()
        if result.exit_status is None:
            why = "timed out" if result.timed_out else (result.error or "no exit status")
            raise RunClientError(f"`{command}` on {self.transport.name}: {why}; stderr: {stderr or '(empty)'}",
                                 kind="unreachable", stderr=stderr)
        if result.exit_status == EXIT_UNREACHABLE:
            raise NoSupervisor(f"no supervisor at {where}: {stderr or '(no stderr)'}", stderr=stderr)
        reply = None
        for line in reversed(result.stdout.splitlines()):
            if line.strip().startswith("{"):
                try:
                    reply = json.loads(line)
                except json.JSONDecodeError:
                    continue
                break
        if reply is None:
            raise RunClientError(
                f"`{command}` on {self.transport.name} exited {result.exit_status} without a JSON reply;"
                f" stderr: {stderr or '(empty)'}; stdout: {result.stdout.strip()[:500] or '(empty)'}",
                kind="unreachable" if result.exit_status != EXIT_ERROR_REPLY else "error", stderr=stderr)
        if not reply.get("ok"):
            raise RunClientError(f"{where}: {reply.get('error') or stderr or 'error reply'}", kind="error",
                                 stderr=stderr)
        return reply.get("result") or {}

    async def status(self, shards: bool = True) -> dict:
        """shards=False: without the shard list (a console that folds the shard events has it); an engine deployed
        before the option existed refuses it (argparse), and the full status is asked for from then on."""
        if shards or self._ctl_lacks_no_shards:
            return await self._ctl("status")
        try:
            return await self._ctl("status", "--no-shards")
        except NoSupervisor as exc:
            if "unrecognized arguments: --no-shards" not in exc.stderr:
                raise
            self._ctl_lacks_no_shards = True
            return await self._ctl("status")

    async def last_status(self) -> dict:
        """What the run dir last recorded, without a supervisor (a finished or killed run)."""
        return await self._ctl("last-status")

    async def pause(self, shards: list[str] | None) -> dict:
        return await self._ctl("pause", *(["--all"] if shards is None else shards))

    async def resume(self, shards: list[str] | None) -> dict:
        return await self._ctl("resume", *(["--all"] if shards is None else shards))

    async def restart_worker(self, name: str) -> dict:
        return await self._ctl("restart-worker", name)

    async def drain(self) -> dict:
        return await self._ctl("drain")

    async def drain_host(self, host: str, undo: bool = False) -> dict:
        return await self._ctl("undrain-host" if undo else "drain-host", host)

    async def stop(self) -> dict:
        return await self._ctl("stop")

    async def follow(self, since: float | None = None) -> AsyncIterator[Event]:
        args = ["follow"] + (["--since", repr(float(since))] if since is not None else [])
        async for line in self.transport.stream_lines(self._command(*args)):
            if not line.strip():
                continue
            try:
                yield parse_event(line)
            except ValueError:
                continue  # an event type newer than this console: skipped, the rest still shows
