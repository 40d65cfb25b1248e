"""The supervisor's start checks (engine.api.status.StartCheck: config, run dir, prompts, tokenizer, count, workers),
in its status reply until they pass, so `regen start` reports a run started only once it is. Workers are waited
for to be launched, not ready (real SGLang loads for minutes)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from engine.api.status import CheckState, StartCheck
from engine.text.ingest import resolve_prompt_files
from engine.text.row_errors import PromptFileError

CHECKS: dict[str, str] = {  # in the order the supervisor passes them
    "config": "run config loaded",
    "run_dir": "run dir ready",
    "prompts": "prompt files open",
    "tokenizer": "tokenizer loaded",
    "count": "prompt count started",
    "workers": "workers launched",
}


@dataclass
class StartupChecks:
    checks: dict[str, StartCheck] = field(
        default_factory=lambda: {name: StartCheck(name, title) for name, title in CHECKS.items()})

    def set(self, check: str, state: CheckState, detail: str = "") -> None:
        c = self.checks[check]
        if c.state != state or c.detail != detail:
            c.state, c.detail, c.ts = state, detail, time.time()

    def ok(self, check: str, detail: str = "") -> None:
        self.set(check, CheckState.OK, detail)

    def failed(self, check: str, detail: str) -> None:
        self.set(check, CheckState.FAILED, detail)

    def fail_pending(self, detail: str) -> None:
        """The supervisor cannot go on: the first check not passed is the one that failed."""
        for c in self.checks.values():
            if c.state == CheckState.PENDING:
                self.failed(c.check, detail)
                return

    @property
    def passed(self) -> bool:
        return all(c.state == CheckState.OK for c in self.checks.values())

    def in_order(self) -> list[StartCheck]:
        return list(self.checks.values())


def open_prompt_files(patterns: Sequence[str]) -> str:
    """Resolve the prompt paths and open each for reading (one byte read): a missing or unreadable file fails
    here, before the tokenizer loads, with PromptFileError naming it. Returns a one-line summary."""
    files = resolve_prompt_files(patterns)
    size = 0
    for p in files:
        try:
            with open(p, "rb") as f:
                f.read(1)
                size += os.fstat(f.fileno()).st_size
        except OSError as exc:
            raise PromptFileError(str(p), str(exc)) from exc
    return f"{len(files)} file{'s' if len(files) != 1 else ''}, {_size(size)}: {_names(files)}"


def _names(files: list[Path], limit: int = 3) -> str:
    shown = ", ".join(str(f) for f in files[:limit])
    return shown + (f" and {len(files) - limit} more" if len(files) > limit else "")


def _size(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
