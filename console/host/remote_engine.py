"""The one command line that runs an engine module on a host (engine_command), and the JSON report it prints last."""
from __future__ import annotations

import json
import shlex
from typing import Any

from console.host.transport import Transport, quote_argv


def deployed_engine(run_dir: str) -> str:
    """Where `regen start` deployed the engine in a run dir on the host."""
    return f"{run_dir.rstrip('/')}/.regen/engine"


def engine_command(python: str, argv: list[str], *, engine_path: str | None = None, run_dir: str | None = None) -> str:
    """`python argv...` (argv: -m engine.X ...) as a shell command for the host, with the engine it must run first
    on PYTHONPATH: `engine_path` (recorded at start) when given; else the run dir's deployed engine when there is one,
    so the host needs no regen installed and runs the version that wrote the run dir; else the python's own."""
    cmd = quote_argv([python, *argv])
    if engine_path:
        return f"PYTHONPATH={quote_argv([engine_path])} {cmd}"
    if not run_dir:
        return "exec " + cmd
    q = shlex.quote(deployed_engine(run_dir))
    return f"if [ -d {q} ]; then PYTHONPATH={q}${{PYTHONPATH:+:$PYTHONPATH}}; export PYTHONPATH; fi; exec {cmd}"


def last_json_object(stdout: str) -> dict[str, Any] | None:
    """The report a `--json` engine module prints as its last line (None: no such line)."""
    lines = stdout.strip().splitlines()
    try:
        data = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


class RemoteEngineError(Exception):
    """An engine module run on a host gave no report: the message says what it printed and what to do."""


async def recorded_python(transport: Transport, run_dir: str) -> str | None:
    """The host python `regen start` recorded for the run dir (.regen/launch.json), if there is one."""
    q = shlex.quote(f"{run_dir.rstrip('/')}/.regen/launch.json")
    result = await transport.run(f"if [ -f {q} ]; then cat -- {q}; fi", timeout=30.0)
    if result.exit_status != 0 or not result.stdout.strip():
        return None
    try:
        return json.loads(result.stdout).get("host_python")
    except (json.JSONDecodeError, AttributeError):
        return None


async def engine_report(transport: Transport, command: str, *, where: str, timeout: float,
                        no_engine: str) -> dict[str, Any]:
    """Run `command` (from engine_command) and return its last-line JSON report.

    `no_engine` is the whole message for a host python that cannot import the engine (it names the fix,
    which differs per command); any other run without a report says its exit status, stderr and stdout."""
    result = await transport.run(command, timeout=timeout)
    if result.error or result.timed_out:
        raise RemoteEngineError(f"{where}: `{command}` did not complete: "
                                f"{result.error or f'timed out after {timeout:.0f} s'}")
    data = last_json_object(result.stdout)
    if data is None and "No module named 'engine'" in result.stderr:
        raise RemoteEngineError(f"{where}: {no_engine}")
    if data is None:
        raise RemoteEngineError(f"{where}: `{command}` exited {result.exit_status} without a JSON report; "
                                f"stderr: {result.stderr.strip()[-2000:] or '(empty)'}; "
                                f"stdout: {result.stdout.strip()[:500] or '(empty)'}")
    return data
