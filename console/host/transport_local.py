"""Transport to this machine: every command is `/bin/sh -c COMMAND` in its own session.

Each command runs as the leader of a new session (process group), so a timeout or a
closed stream kills the command and everything it started, not only the shell.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path
from typing import AsyncIterator

from console.host.transport import Ended, TransportError
from probes.model import CommandResult, ConnectErrorKind

# After the group is killed, how long to wait for its pipes to reach EOF. A process that
# escaped the group (setsid) and holds our pipes would otherwise block us forever.
_DRAIN_AFTER_KILL_S = 2.0
PROCESS_LINE_LIMIT = 1 << 28  # the longest stdout line an open_process may send


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _kill_group(pid: int) -> str | None:
    """SIGKILL the process group led by `pid`; returns the OS error text if that failed."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None  # already gone: nothing left to kill
    except OSError as exc:
        return f"could not kill process group {pid}: {exc}"
    return None


async def _read_all(stream: asyncio.StreamReader | None, sink: bytearray) -> None:
    if stream is None:
        return
    while chunk := await stream.read(65536):
        sink += chunk


class LocalTransport:
    """Runs commands on this machine; implements console.host.transport.Transport."""

    def __init__(self, name: str = "local"):
        self.name = name
        self._live: set[asyncio.subprocess.Process] = set()
        self._processes: set[LocalProcess] = set()  # open_process's, until closed

    async def _spawn(self, command: str, *, stdin_pipe: bool, line_limit: int = 1 << 16) -> asyncio.subprocess.Process:
        try:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", command,
                stdin=asyncio.subprocess.PIPE if stdin_pipe else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                limit=line_limit,
            )
        except OSError as exc:
            raise TransportError(f"could not start /bin/sh for {command!r}: {exc}",
                                 kind=ConnectErrorKind.ERROR) from exc
        self._live.add(proc)
        return proc

    async def run(self, command: str, *, timeout: float, stdin: bytes | None = None) -> CommandResult:
        started = time.monotonic()
        try:
            proc = await self._spawn(command, stdin_pipe=stdin is not None)
        except TransportError as exc:
            return CommandResult(command, None, "", "", time.monotonic() - started, error=str(exc))
        out, err = bytearray(), bytearray()
        readers = [
            asyncio.ensure_future(_read_all(proc.stdout, out)),
            asyncio.ensure_future(_read_all(proc.stderr, err)),
        ]
        feed_error: str | None = None

        async def feed_and_wait() -> int:
            nonlocal feed_error
            if stdin is not None and proc.stdin is not None:
                try:
                    proc.stdin.write(stdin)
                    await proc.stdin.drain()
                except (BrokenPipeError, ConnectionResetError) as exc:
                    feed_error = f"the command closed its stdin before reading all input: {exc}"
                finally:
                    proc.stdin.close()
            await asyncio.wait(readers)  # wait, not gather: a timeout must not cancel the readers
            return await proc.wait()

        timed_out = False
        error: str | None = None
        try:
            returncode: int | None = await asyncio.wait_for(feed_and_wait(), timeout)
        except asyncio.TimeoutError:
            timed_out = True
            returncode = None
            kill_error = _kill_group(proc.pid)
            error = f"timed out after {timeout:g} s; killed process group {proc.pid}"
            if kill_error:
                error += f" ({kill_error})"
            await proc.wait()
            _done, pending = await asyncio.wait(readers, timeout=_DRAIN_AFTER_KILL_S)
            for task in pending:
                task.cancel()
            if pending:
                error += "; a process outside the group still held its output open, output may be cut"
        finally:
            self._live.discard(proc)
        exit_status = returncode
        if returncode is not None and returncode < 0:
            exit_status = None
            error = f"killed by {signal_name(-returncode)}"
        if feed_error and error is None:
            error = feed_error
        return CommandResult(
            command=command,
            exit_status=exit_status,
            stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"),
            duration_s=time.monotonic() - started,
            timed_out=timed_out,
            error=error,
        )

    async def stream_lines(self, command: str) -> AsyncIterator[str]:
        proc = await self._spawn(command, stdin_pipe=False)
        err = bytearray()
        err_reader = asyncio.ensure_future(_read_all(proc.stderr, err))
        finished = False
        try:
            assert proc.stdout is not None
            while line := await proc.stdout.readline():
                yield line.decode("utf-8", errors="replace").rstrip("\n")
            returncode = await proc.wait()
            await asyncio.wait([err_reader], timeout=_DRAIN_AFTER_KILL_S)
            finished = True
            if returncode != 0:
                how = f"exited with status {returncode}" if returncode > 0 else f"was killed by {signal_name(-returncode)}"
                stderr = err.decode("utf-8", errors="replace").strip()
                raise TransportError(
                    f"`{command}` on {self.name} {how}; stderr: {stderr or '(empty)'}",
                    kind=ConnectErrorKind.ERROR
                )
        finally:
            if not finished:  # the caller stopped reading (or was cancelled): end the command
                _kill_group(proc.pid)
                # read what is left while waiting: asyncio's wait() returns only once the pipes are closed
                drain = asyncio.ensure_future(_read_all(proc.stdout, bytearray()))
                await proc.wait()
                await asyncio.wait([drain], timeout=_DRAIN_AFTER_KILL_S)
            err_reader.cancel()
            self._live.discard(proc)

    async def open_process(self, command: str) -> "LocalProcess":
        # one reply is one line: a status with 10,000 shards is ~2 MB
        process = LocalProcess(self, command, await self._spawn(command, stdin_pipe=True, line_limit=PROCESS_LINE_LIMIT))
        self._processes.add(process)
        return process

    async def put(self, local: Path, remote: str) -> None:
        await asyncio.to_thread(_copy, Path(local), Path(remote), f"put {local} -> {self.name}:{remote}")

    async def get(self, remote: str, local: Path) -> None:
        await asyncio.to_thread(_copy, Path(remote), Path(local), f"get {self.name}:{remote} -> {local}")

    async def close(self) -> None:
        for process in list(self._processes):
            await process.close()  # killed, its pipes closed and its exit waited for: nothing outlives the loop
        for proc in list(self._live):
            _kill_group(proc.pid)
        self._live.clear()


class LocalProcess:
    """A command on this machine with its stdin open; implements console.host.transport.Process."""

    def __init__(self, transport: LocalTransport, command: str, proc: asyncio.subprocess.Process):
        self.command = command
        self.pid = proc.pid  # the process group's leader
        self._transport = transport
        self._proc = proc
        self._err = bytearray()
        self._err_reader = asyncio.ensure_future(_read_all(proc.stderr, self._err))

    async def write(self, data: bytes) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(data)
            await self._proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise TransportError(f"`{self.command}` on {self._transport.name} closed its stdin: {exc}",
                                 kind=ConnectErrorKind.CLOSED) from exc

    async def readline(self) -> bytes:
        assert self._proc.stdout is not None
        return await self._proc.stdout.readline()

    async def ended(self) -> Ended:
        stderr = self._err.decode("utf-8", errors="replace")
        try:
            returncode = await asyncio.wait_for(self._proc.wait(), _DRAIN_AFTER_KILL_S)
        except asyncio.TimeoutError:
            return Ended(None, f"closed its stdout but still runs (pid {self.pid})", stderr)
        await asyncio.wait([self._err_reader], timeout=_DRAIN_AFTER_KILL_S)
        stderr = self._err.decode("utf-8", errors="replace")
        if returncode >= 0:
            return Ended(returncode, f"exited with status {returncode}", stderr)
        return Ended(None, f"was killed by {signal_name(-returncode)}", stderr)

    async def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        if self._proc.returncode is None:
            error = _kill_group(self.pid)
            if error:
                raise TransportError(f"ending `{self.command}`: {error}", kind=ConnectErrorKind.ERROR)
            await self._proc.wait()
        self._err_reader.cancel()
        self._transport._live.discard(self._proc)
        self._transport._processes.discard(self)


def _copy(src: Path, dst: Path, what: str) -> None:
    """Copy a file or a tree to exactly `dst` (parents created, existing dirs merged), modes kept."""
    try:
        if src.is_dir():
            shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    except shutil.Error as exc:  # copytree gathers per-file errors: (src, dst, why) triples
        details = "; ".join(f"{s} -> {d}: {why}" for s, d, why in exc.args[0])
        raise TransportError(f"{what}: {details}", kind=ConnectErrorKind.ERROR) from exc
    except OSError as exc:
        raise TransportError(f"{what}: {exc}", kind=ConnectErrorKind.ERROR) from exc
