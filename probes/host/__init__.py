"""Standalone Python scripts the probes run with the host's interpreter (`python -c SCRIPT ARGS`).

Each script takes one JSON argument, uses only the standard library (plus the package it
probes), and prints one JSON object per line on stdout; errors are captured with their
text verbatim and put in that JSON, never dropped.

A script shares code with regen itself through a line `# @include NAME`: it is replaced by the
source of probes/host/NAME.py (stdlib only, no `from __future__`), since the host has no regen
to import it from.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
INCLUDE = re.compile(r"^# @include (\w+)$", re.M)


@lru_cache(maxsize=None)
def script(name: str) -> str:
    """The source of probes/host/<name>.py, with its `# @include` lines expanded."""
    source = (HERE / f"{name}.py").read_text(encoding="utf-8")
    return INCLUDE.sub(lambda m: script(m.group(1)), source)
