"""run_dir/rejects.jsonl: every bad input row with its file, line/row and reason, once.

Ingest runs again on every restart, so the log is de-duplicated by (file, line, row, reason):
the keys already in the file are loaded at open. Each line is written with one write() on an
O_APPEND descriptor and fsync'd; a torn last line (crash mid-write) is cut off at open.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from engine.text.row_errors import Reject

REJECTS_FILE = "rejects.jsonl"


class RejectLogError(Exception):
    pass


def _key(file, line, row, reason) -> tuple:
    return (file, line, row, reason)


class RejectLog:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / REJECTS_FILE
        self._keys: set[tuple] = set()
        self._by_reason: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._load()
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            raise RejectLogError(f"cannot open reject log {self.path}: {exc}") from exc

    def _load(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise RejectLogError(f"cannot read reject log {self.path}: {exc}") from exc
        complete = data.rfind(b"\n") + 1  # a last line without newline is torn (crash mid-write)
        for line_no, line in enumerate(data[:complete].split(b"\n")[:-1], start=1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                self._remember(d["file"], d.get("line"), d.get("row"), d["reason"], d.get("kind") or d["reason"])
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise RejectLogError(f"{self.path}: line {line_no} is not a reject record ({exc!r}); "
                                     "the reject log was edited or corrupted") from exc
        if complete < len(data):
            try:
                with open(self.path, "r+b") as f:
                    f.truncate(complete)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                raise RejectLogError(f"cannot repair the torn last line of {self.path}: {exc}") from exc

    def _remember(self, file, line, row, reason, category) -> bool:
        key = _key(file, line, row, reason)
        if key in self._keys:
            return False
        self._keys.add(key)
        self._by_reason[category] += 1
        return True

    def _encode(self, reject: Reject) -> bytes:
        d = reject.to_dict()
        d["ts"] = time.time()
        return (json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8", "surrogateescape")

    def add(self, reject: Reject) -> bool:
        """Append one reject (fsync'd); False if this (file, line, row, reason) is already logged."""
        return self.add_many([reject]) == 1

    def add_many(self, rejects: Iterable[Reject]) -> int:
        """Append several rejects with one fsync; returns how many were new."""
        with self._lock:
            chunks = []
            for r in rejects:
                if self._remember(r.file, r.line, r.row, r.reason, r.category):
                    chunks.append(self._encode(r))
            if not chunks:
                return 0
            data = b"".join(chunks)
            try:
                written = os.write(self._fd, data)
                while written < len(data):
                    written += os.write(self._fd, data[written:])
                os.fsync(self._fd)
            except OSError as exc:
                raise RejectLogError(f"cannot write reject log {self.path}: {exc}") from exc
            return len(chunks)

    @property
    def count(self) -> int:
        return len(self._keys)

    def counts_by_reason(self) -> dict[str, int]:
        """Counts keyed by the reject's kind (malformed_json, unknown_role, ...; the reason text if no kind)."""
        return dict(self._by_reason)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> RejectLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
