"""The control socket's address (a long path reached through /proc/self/fd) and its blocking one-request client
(engine.ctl, tests); the supervisor serves it (engine.supervisor.control)."""
from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes with the terminating NUL (Linux)


@contextlib.contextmanager
def socket_address(path: Path) -> Iterator[str]:
    """An AF_UNIX address for `path`: the path itself, or, when it is longer than sun_path allows
    (deep run dirs), the same file reached through /proc/self/fd/<dir fd>/<name> (Linux)."""
    if len(os.fsencode(str(path))) <= SUN_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def request(path: Path, payload: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """Send one request, return the reply dict; FileNotFoundError / ConnectionRefusedError when no supervisor
    listens there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        with socket_address(path) as address:
            sock.connect(address)
        sock.sendall(orjson.dumps(payload) + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
    if not buf.strip():
        raise ConnectionError(f"the supervisor at {path} closed the connection without a reply")
    reply: dict[str, Any] = orjson.loads(buf)
    return reply
