"""Logging that degrades instead of crashing when its file cannot be written (a full disk).

On a failed write: one note of the failure, the newest records kept in memory, a retry at most every RETRY_S,
then a note (since when, why, how many dropped) and the kept records once writing works again.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from typing import Callable

KEEP_RECORDS = 500
RETRY_S = 5.0

_handlers: list[ResilientHandler] = []


class ResilientHandler(logging.Handler):
    def __init__(self, fd: int, name: str, *, keep: int = KEEP_RECORDS, retry_s: float = RETRY_S,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.fd = fd
        self.target = name  # what fd is, for the notes (a path, or "stderr")
        self.retry_s = retry_s
        self.clock = clock
        self.failure: str | None = None  # why writing fails now; None while it works
        self.failed_since: float | None = None  # wall time of the first failure of this episode
        self.dropped = 0
        self._kept: collections.deque[bytes] = collections.deque(maxlen=keep)
        self._rest = b""  # the unwritten end of a record a failing write cut
        self._next_try = 0.0
        _handlers.append(self)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception as exc:  # a bad format string must not lose the record's existence
            text = f"(log record {record.msg!r} could not be formatted: {type(exc).__name__}: {exc})"
        data = (text + "\n").encode("utf-8", "backslashreplace")
        if self.failure is not None:
            if len(self._kept) == self._kept.maxlen:
                self.dropped += 1
            self._kept.append(data)
            if self.clock() >= self._next_try:
                self._recover()
            return
        self._write_or_fail(data)

    def handleError(self, record: logging.LogRecord) -> None:
        # only reached from logging internals outside emit(); never a traceback block per record
        if self.failure is None:
            self._fail(OSError(f"logging failed for a record from {record.name}"))

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                n = os.write(self.fd, view)
                if n <= 0:
                    raise OSError(f"write to {self.target} wrote nothing")
                view = view[n:]
        except OSError:
            self._rest = bytes(view)
            raise

    def _write_or_fail(self, data: bytes) -> None:
        try:
            self._write(data)
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self.failure = f"{type(exc).__name__}: {exc}"
        self.failed_since = time.time()
        self._next_try = self.clock() + self.retry_s
        if self.fd != 2:
            try:  # the terminal (or a log on another disk) hears it once
                os.write(2, f"regen: cannot write {self.target}: {self.failure}; log records are kept in"
                            f" memory and written when it works again\n".encode())
            except OSError:
                self.failure += " (stderr failed too)"

    def _recover(self) -> None:
        """Try the backlog: the cut end of a record, a note, then the records kept."""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.failed_since or time.time()))
        note = (f"{time.strftime('%Y-%m-%d %H:%M:%S')} WARNING regen.log: writing {self.target} failed from {since}"
                f" until now ({self.failure}); {self.dropped} log records were dropped, the {len(self._kept)} kept"
                f" ones follow\n").encode()
        try:
            if self._rest:
                self._write(self._rest if self._rest.endswith(b"\n") else self._rest + b"\n")
                self._rest = b""
            self._write(note)
            while self._kept:
                self._write(self._kept[0])
                self._kept.popleft()
        except OSError as exc:
            if self._kept and self._rest and self._kept[0].endswith(self._rest):
                self._kept.popleft()  # its unwritten end is in _rest
            self.failure = f"{type(exc).__name__}: {exc}"
            self._next_try = self.clock() + self.retry_s
            return
        self.failure, self.failed_since, self.dropped = None, None, 0

    def close(self) -> None:
        self.acquire()  # logging.Handler's own lock (its `lock` attribute is typed as maybe None)
        try:
            if self._kept and self.failure is not None:
                self._recover()  # a last try at exit
        finally:
            self.release()
        super().close()


def open_log_fd(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def failures() -> list[str]:
    """The log targets that cannot be written now, with why (for the status reply)."""
    return [f"{h.target}: {h.failure} (since {time.strftime('%H:%M:%S', time.localtime(h.failed_since or 0))},"
            f" {len(h._kept)} records kept)" for h in _handlers if h.failure is not None]
