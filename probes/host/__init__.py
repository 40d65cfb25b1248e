"""Standalone Python scripts the probes run with the host's interpreter (`python -c SCRIPT ARGS`).

Each script takes one JSON argument, uses only the standard library (plus the package it
probes), and prints one JSON object per line on stdout; errors are captured with their
text verbatim and put in that JSON, never dropped.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).resolve().parent


@lru_cache(maxsize=None)
def script(name: str) -> str:
    """The source of probes/host/<name>.py."""
    return (HERE / f"{name}.py").read_text(encoding="utf-8")
