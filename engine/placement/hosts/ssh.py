"""Reaching a remote host with the dispatch host's own OpenSSH client: one command, the agent's stop, the port forwards.

ssh failing itself (exit 255, a timeout) is a HostError naming the step; a command's own failure is its exit code.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import socket
import time
from pathlib import Path

from engine.config.load import Host
from engine.servers.launch import die_with_parent
from probes.shell import shell_path

log = logging.getLogger("regen.hosts")

AGENT_DIR = ".regen/engine"
SSH_TIMEOUT_S = 60.0
AGENT_STOP_WAIT_S = 20.0  # an agent stops each server within STOP_GRACE_S (engine.servers.workers)
FORWARD_READY_S = 20.0


class HostError(Exception):
    """A step towards a remote host failed; the message says which step and what ssh said."""


def ssh_argv(host: Host, *extra: str) -> list[str]:
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=2",
            "-o", "ServerAliveCountMax=3", *host.ssh_options, *extra, *host.ssh_destination()]


async def run_ssh(host: Host, command: str, stdin: bytes | None = None, timeout: float = SSH_TIMEOUT_S
                  ) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `command` on the host; HostError when ssh itself failed (255) or timed out."""
    argv = ssh_argv(host) + ["--", command]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        raise HostError(f"cannot run ssh: {exc}") from exc
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout=timeout)
    except asyncio.TimeoutError:
        kill_group(proc.pid)
        await proc.wait()
        raise HostError(f"ssh {host.address} `{command[:80]}` timed out after {timeout:.0f} s") from None
    rc = await proc.wait()  # communicate() returned once it exited: its exit code, at once
    if rc == 255:
        raise HostError(f"ssh {host.address}: {err.decode(errors='replace').strip() or 'exit 255'}")
    return rc, out.decode(errors="replace"), err.decode(errors="replace")


def agent_stop_command(host: Host) -> str:
    """Stops the host's agent and waits for it to have stopped its servers (engine.placement.hosts.agent --stop);
    a host where no agent was ever deployed says so."""
    wd = shell_path(host.work_dir)
    return (f"if [ -d {wd}/{AGENT_DIR} ]; then cd {wd} && PYTHONPATH={wd}/{AGENT_DIR} {shlex.quote(host.host_python)}"
            f" -m engine.placement.hosts.agent --work-dir . --stop {AGENT_STOP_WAIT_S:g};"
            f" else echo 'no agent was deployed in '{wd}; fi")


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def free_local_port(preferred: int) -> int:
    for port in [preferred] + [0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise HostError("no free loopback port for an SSH forward")


class SshTunnel:
    """One `ssh -N -L` process forwarding a dispatch-host loopback port to each server's 127.0.0.1 port (SGLang stays
    bound to loopback on its host); its output goes to the link's log."""

    def __init__(self, host: Host, forwards: dict[int, int], log_path: Path):
        self.host = host
        self.forwards = forwards  # local port -> the server's port on the host
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None

    async def open(self) -> None:
        forwards: list[str] = []
        for local, remote in self.forwards.items():
            forwards += ["-L", f"127.0.0.1:{local}:127.0.0.1:{remote}"]
        argv = ssh_argv(self.host, "-N", "-o", "ExitOnForwardFailure=yes", *forwards)
        logf = open(self.log_path, "ab")
        try:
            logf.write(f"[regen {time.strftime('%H:%M:%S')}] {shlex.join(argv)}\n".encode())
            logf.flush()
            self.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True,
                preexec_fn=die_with_parent)
        except OSError as exc:
            raise HostError(f"cannot run ssh for the port forwards: {exc}") from exc
        finally:
            logf.close()
        deadline = time.monotonic() + FORWARD_READY_S
        pending = set(self.forwards)
        while pending and time.monotonic() < deadline:
            if self.proc.returncode is not None:
                raise HostError(f"the SSH port forwards to {self.host.address} exited ({self.proc.returncode}):"
                                f" {self.log_tail()}")
            for port in list(pending):
                try:
                    _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1.0)
                    writer.close()
                    pending.discard(port)
                except (OSError, asyncio.TimeoutError):
                    pass  # not listening yet
            if pending:
                await asyncio.sleep(0.1)
        if pending:
            raise HostError(f"the SSH port forwards to {self.host.address} did not listen within {FORWARD_READY_S:.0f} s")

    def exit_reason(self) -> str | None:
        """Why the forwards are gone (ssh exited: a cut link ends them), or None while they run."""
        if self.proc is not None and self.proc.returncode is not None:
            return f"the SSH port forwards exited ({self.proc.returncode}): {self.log_tail()}"
        return None

    def log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-3:])

    async def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            kill_group(proc.pid)
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except asyncio.TimeoutError:
                log.warning("host %s: ssh forward pid %d did not exit", self.host.name, proc.pid)
