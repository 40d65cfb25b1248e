"""The one small async interface the console uses to reach a host, local or over SSH (console/host/connect.py opens
one). Commands are shell strings: callers quote every argument (`shlex.quote` / `quote_argv`)."""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Protocol, Sequence

from probes.model import CommandResult, ConnectErrorKind


class TransportError(Exception):
    """Could not reach or use the host. `kind` tells unreachable from refused."""

    def __init__(self, message: str, kind: ConnectErrorKind = ConnectErrorKind.ERROR, *,
                 unknown_host_key: bool = False):
        super().__init__(message)
        self.kind = kind
        # kind host_key, the host is not in known_hosts (not a changed key): --accept-new is the remedy
        self.unknown_host_key = unknown_host_key


@dataclass(frozen=True)
class HostSpec:
    raw: str
    host: str
    user: str | None = None
    port: int | None = None

    @property
    def is_local(self) -> bool:
        return self.host == "local"

    @classmethod
    def parse(cls, text: str) -> "HostSpec":
        """`local`, an ssh alias, `host`, `user@host`, `user@host:port`, `[v6]:port`."""
        if not text:
            raise ValueError("empty host")
        if text == "local":
            return cls(raw=text, host="local")
        user = None
        rest = text
        if "@" in rest:
            user, rest = rest.rsplit("@", 1)
        port = None
        if rest.startswith("["):
            host, _, tail = rest[1:].partition("]")
            if tail.startswith(":"):
                port = int(tail[1:])
        elif rest.count(":") == 1:
            host, p = rest.split(":")
            port = int(p)
        else:
            host = rest
        return cls(raw=text, host=host, user=user or None, port=port)


def quote_argv(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(str(a)) for a in argv)


@dataclass(frozen=True)
class Ended:
    """How a Process ended: exit_status (None: killed by a signal, or no status came), `how` in words, its stderr."""
    exit_status: int | None
    how: str
    stderr: str

    def __str__(self) -> str:
        return f"{self.how}; stderr: {self.stderr.strip() or '(empty)'}"


class Process(Protocol):
    """A long-running command with its stdin open (Transport.open_process): lines in, lines out."""

    command: str

    @property
    def pid(self) -> int | None:
        """Its process group on the host (None until known); read-only: a Process tells it, callers never set it."""
        ...

    async def write(self, data: bytes) -> None:
        """Send bytes to its stdin; TransportError (kind closed) when the command or the connection is gone."""
        ...

    async def readline(self) -> bytes:
        """Its next stdout line with the newline; b"" once stdout closed; TransportError when the connection broke."""
        ...

    async def ended(self) -> Ended:
        """After readline() gave b"": how it ended (exit status or signal, and its stderr), waiting a little for it;
        TransportError when the connection was lost (the command may still run on the host)."""
        ...

    async def close(self) -> None:
        """End the command (its process group) if it still runs."""
        ...


class Transport(Protocol):
    name: str  # what the user typed (for messages)

    async def run(self, command: str, *, timeout: float, stdin: bytes | None = None) -> CommandResult:
        """Run a shell command; never raises for a non-zero exit or a timeout (see CommandResult)."""
        ...

    def stream_lines(self, command: str) -> AsyncIterator[str]:
        """Yield stdout lines of a long-running command; closing the iterator ends the command.

        Raises TransportError if the connection drops; stderr is kept and put in that error.
        """
        ...

    async def open_process(self, command: str) -> Process:
        """Start a long-running command whose stdin stays open (the console's control channel)."""
        ...

    async def put(self, local: Path, remote: str) -> None:
        """Copy a file or a directory tree to the host (SFTP over SSH)."""
        ...

    async def get(self, remote: str, local: Path) -> None: ...

    async def close(self) -> None: ...
