"""A command line that runs one of the engine's modules on a host, and the JSON report it prints last."""
from __future__ import annotations

import json
import shlex
from typing import Any

from console.transport import quote_argv


def deployed_engine(run_dir: str) -> str:
    """Where `regen start` deployed the engine in a run dir on the host."""
    return f"{run_dir.rstrip('/')}/.regen/engine"


def engine_command(run_dir: str | None, argv: list[str]) -> str:
    """`argv` (python -m engine.X ...) run with the run dir's deployed engine first on PYTHONPATH when there is one,
    so the host needs no regen installed and runs the version that wrote the run dir."""
    if not run_dir:
        return "exec " + quote_argv(argv)
    q = shlex.quote(deployed_engine(run_dir))
    return f"if [ -d {q} ]; then PYTHONPATH={q}${{PYTHONPATH:+:$PYTHONPATH}}; export PYTHONPATH; fi; exec {quote_argv(argv)}"


def last_json_object(stdout: str) -> dict[str, Any] | None:
    """The report a `--json` engine module prints as its last line (None: no such line)."""
    lines = stdout.strip().splitlines()
    try:
        data = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None
