"""Standalone Python scripts the probes run with the host's interpreter (`python -c SCRIPT ARGS`).

Each takes one JSON argument, uses only the standard library (plus what it probes) and prints JSON lines, errors
verbatim in them. A line `# @include NAME` is replaced by the source of probes/host/NAME.py (stdlib only, no
`from __future__`), since the host has no regen to import it from.
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
