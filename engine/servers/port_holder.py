"""Is a server port free on its bind address, and if not, which process holds it (as far as the host lets us see).

The bind test is the server's own (SO_REUSEADDR, as uvicorn's); the holder comes from psutil's socket table (pid,
command line where readable, else why not). probes/host/ports.py answers the same from a bare python."""
from __future__ import annotations

import errno
import ipaddress
import shlex
import socket
from dataclasses import dataclass

import psutil

WILDCARDS = {"0.0.0.0", "::", ""}
CMDLINE_MAX = 300


@dataclass(frozen=True)
class PortHolder:
    """One process listening on the port; pid None when the socket table does not say whose it is."""
    pid: int | None
    cmdline: str = ""  # "" when not readable; `note` says why
    note: str = ""

    def describe(self) -> str:
        if self.pid is None:
            return f"a process whose pid is not visible ({self.note})"
        return f"pid {self.pid} ({self.cmdline or self.note})"


@dataclass(frozen=True)
class PortCheck:
    host: str
    port: int
    free: bool
    held: bool = False  # not free because a socket is already bound there (EADDRINUSE)
    bind_error: str = ""  # the bind test's OSError text when not free
    holders: tuple[PortHolder, ...] = ()
    note: str = ""  # why no holder could be named (no listening socket found, socket table unreadable)

    def holder_text(self) -> str:
        if self.holders:
            return ", ".join(h.describe() for h in self.holders)
        return f"a process regen cannot name ({self.note})" if self.note else "a process regen cannot name"

    def evidence(self) -> str:
        lines = [f"port: {self.port} on {self.host}", f"bind test: {self.bind_error or 'free'}"]
        for h in self.holders:
            lines.append(f"holder pid: {h.pid if h.pid is not None else 'not visible'}")
            lines.append(f"holder command: {h.cmdline or h.note}")
        if self.note:
            lines.append(f"note: {self.note}")
        return "\n".join(lines)


def bind_error(host: str, port: int) -> OSError | None:
    """None when a server could bind host:port now, else the OSError it would get."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc
    return None


def _same_address(listening: str, host: str) -> bool:
    """Whether a socket listening on `listening` conflicts with a bind on `host` (same port)."""
    if listening in WILDCARDS or host in WILDCARDS:
        return True
    try:
        a, b = ipaddress.ip_address(listening), ipaddress.ip_address(host)
    except ValueError:
        return listening == host  # a hostname in the config: compare as written
    mapped = getattr(a, "ipv4_mapped", None)
    return (mapped or a) == (getattr(b, "ipv4_mapped", None) or b)


def listening_pids(host: str, port: int) -> tuple[list[int | None], str]:
    """The pids listening on host:port (None for a socket whose process this user cannot see), and a
    note when the socket table cannot be read at all."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied as exc:
        return [], f"the socket table is not readable by this user ({exc}); run as root to see the holder"
    pids: list[int | None] = []
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and _same_address(c.laddr.ip, host):
            if c.pid not in pids:
                pids.append(c.pid)
    return pids, ""


def describe_pid(pid: int | None) -> PortHolder:
    if pid is None:
        return PortHolder(pid=None, note="another user's process, or one exiting right now; run regen as root or as "
                                         "that user to see it")
    try:
        cmdline = shlex.join(psutil.Process(pid).cmdline())
    except psutil.NoSuchProcess:
        return PortHolder(pid=pid, note="exited meanwhile")
    except psutil.AccessDenied as exc:
        return PortHolder(pid=pid, note=f"command line not readable: {exc}")
    return PortHolder(pid=pid, cmdline=cmdline[:CMDLINE_MAX] or "(no command line: a kernel thread or zombie)")


def holders(host: str, port: int) -> tuple[tuple[PortHolder, ...], str]:
    pids, note = listening_pids(host, port)
    if not pids and not note:
        note = (f"no listening socket on port {port} in this host's socket table: the port is bound but not "
                "listening, or held from another network namespace (a container)")
    return tuple(describe_pid(p) for p in pids), note


def check_port(host: str, port: int) -> PortCheck:
    """The bind test, and when it fails with EADDRINUSE, who holds the port."""
    err = bind_error(host, port)
    if err is None:
        return PortCheck(host=host, port=port, free=True)
    if err.errno != errno.EADDRINUSE:
        return PortCheck(host=host, port=port, free=False, bind_error=str(err),
                         note=f"cannot bind {host}:{port} for another reason than a holder: check workers.host")
    found, note = holders(host, port)
    return PortCheck(host=host, port=port, free=False, held=True, bind_error=str(err), holders=found, note=note)


def process_tree(pid: int) -> set[int]:
    """pid and its live descendants (SGLang forks scheduler and detokenizer processes); empty when gone."""
    try:
        root = psutil.Process(pid)
        return {pid} | {c.pid for c in root.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()
