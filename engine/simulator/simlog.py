"""Log lines in SGLang's format: `[%Y-%m-%d %H:%M:%S] message` (uvicorn lines add `INFO:     `).

SGLang's loggers write to stderr and uvicorn's access log to stdout; each line is flushed
at once so a supervisor tailing server.log sees the ready and error lines as they happen.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

LEVELS = {"debug": 10, "info": 20, "warning": 30, "warn": 30, "error": 40, "critical": 50}


class SimLog:
    def __init__(self, level: str = "info", http_level: str | None = None,
                 err: TextIO | None = None, out: TextIO | None = None):
        self.rank_prefix = ""  # " TP0" etc. on scheduler-process lines when that parallel size > 1
        self.level = LEVELS.get(level.lower(), 20)
        self.http_level = LEVELS.get((http_level or level).lower(), 20)
        self._err = err
        self._out = out

    @property
    def err(self) -> TextIO:
        return self._err or sys.stderr

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout

    @staticmethod
    def stamp() -> str:
        return time.strftime("%Y-%m-%d %H:%M:%S")

    def _write(self, stream: TextIO, text: str) -> None:
        try:
            stream.write(text)
            stream.flush()
        except OSError:  # a full disk under the log: SGLang's logging handlers drop the line, the server serves on
            pass

    def info(self, message: str) -> None:
        if self.level <= 20:
            self._write(self.err, f"[{self.stamp()}] {message}\n")

    def sched(self, message: str) -> None:
        """A line from the scheduler / model runner process (carries the rank prefix)."""
        if self.level <= 20:
            self._write(self.err, f"[{self.stamp()}{self.rank_prefix}] {message}\n")

    def sched_error(self, message: str) -> None:
        self._write(self.err, f"[{self.stamp()}{self.rank_prefix}] {message}\n")

    def warning(self, message: str) -> None:
        if self.level <= 30:
            self._write(self.err, f"[{self.stamp()}] {message}\n")

    def error(self, message: str) -> None:
        self._write(self.err, f"[{self.stamp()}] {message}\n")

    def raw(self, text: str) -> None:
        """Lines SGLang prints without the timestamp prefix (tqdm bars, traceback bodies)."""
        self._write(self.err, text if text.endswith("\n") else text + "\n")

    def uvicorn(self, message: str, level: str = "INFO") -> None:
        if LEVELS[level.lower()] >= self.level:
            self._write(self.err, f"[{self.stamp()}] {(level + ':').ljust(9)} {message}\n")

    def access(self, peer: str, method: str, path: str, status: int) -> None:
        if self.http_level <= 20:
            self._write(self.out, f'[{self.stamp()}] INFO:     {peer} - "{method} {path} HTTP/1.1" {status}\n')
