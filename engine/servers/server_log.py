"""Reading a server's workers/<name>/server.log: its ready line, its loading hints, its fatal lines, its tail.

Every reader starts at the offset where the current launch's output begins.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger("regen.workers")

READY_LINE = "The server is fired up and ready to roll!"
ERROR_PATTERN = re.compile(
    r"out of memory|OutOfMemoryError|Not enough memory|CUDA error|Scheduler hit an exception|Received sigquit"
    r"|SIGQUIT received|[Ww]atchdog timeout|is dead|died during initialization|Initialization failed"
    r"|NCCL error|Connection closed by remote peer|DistNetworkError|DistStoreError"
    r"|^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Interrupt): "
)  # 0.5.23: a lowercase `watchdog timeout (...)`, and `Rank N scheduler died during initialization` for `is dead`;
# a server across nodes: NCCL's remote error naming the peer that went, torch's rendezvous errors;
# a Python traceback's last line (`ModuleNotFoundError: No module named 'sglang'`, unindented), which is the cause of
# any death before SGLang's own handlers run (an import, a bad flag's ValueError)
# fatal lines that only say the server is going, not why: a crash's error quotes the last line that says why
WRAPPER_LINES = re.compile(r"Received sigquit|SIGQUIT received|Scheduler hit an exception: Traceback")
LOADING_HINTS = ("server_args=", "Load weight begin", "Init torch distributed", "Loading")
# uvicorn's line when the port was taken between regen's check and the server's bind
BIND_IN_USE = re.compile(r"\[Errno 98\]|address already in use", re.IGNORECASE)
MAX_ERROR_LINES = 8


def error_lines(log_path: Path, start_offset: int, limit: int = MAX_ERROR_LINES) -> list[str]:
    """The last lines matching SGLang's fatal-error patterns written since this launch."""
    try:
        with open(log_path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            begin = max(start_offset, size - 4 * 2**20)
            f.seek(begin)
            text = f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return [f"(cannot read {log_path}: {exc})"]
    hits = [line.strip() for line in text.splitlines() if ERROR_PATTERN.search(line)]
    return hits[-limit:]


def startup_text(log_path: Path, start_offset: int, limit: int = 4 * 2**20) -> str:
    """This launch's server.log from its start (at most `limit` bytes): the start-up lines come before the
    ready line, so they are in it once the server is ready."""
    try:
        with open(log_path, "rb") as f:
            f.seek(start_offset)
            return f.read(limit).decode("utf-8", errors="replace")
    except OSError as exc:
        log.warning("cannot read %s for its start-up lines: %s", log_path, exc)
        return ""


def bind_failure(log_path: Path, start_offset: int, port: int) -> str | None:
    """The server's own "address already in use" line for `port` since this launch, if it logged one
    (a line about another port, e.g. a distributed-init port, is not the worker's port)."""
    for line in reversed(log_tail(log_path, start_offset, lines=40)):
        if BIND_IN_USE.search(line) and re.search(rf"\b{port}\b", line):
            return line.strip()
    return None



def log_tail(log_path: Path, start_offset: int, lines: int = 5) -> list[str]:
    try:
        with open(log_path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(start_offset, size - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return [f"(cannot read {log_path}: {exc})"]
    return [line for line in text.splitlines() if line.strip()][-lines:]


def crash_cause(lines: list[str]) -> str:
    """The fatal line that says why: the last one that is not only a wrapper's (WRAPPER_LINES)."""
    return next((line for line in reversed(lines) if not WRAPPER_LINES.search(line)), lines[-1] if lines else "")


def read_whole_lines(log_path: Path, offset: int, name: str) -> tuple[str, int]:
    """The whole lines written since `offset`, and the offset after them (a partial last line is read next time,
    so the ready line is never split); on a read error nothing, logged."""
    try:
        with open(log_path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError as exc:
        log.warning("worker %s: cannot read %s: %s", name, log_path, exc)
        return "", offset
    cut = data.rfind(b"\n") + 1
    return data[:cut].decode("utf-8", errors="replace"), offset + cut
