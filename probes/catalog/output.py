"""Reading a probe command's output: the host scripts' JSON, the shell's last words, sizes and versions.
"""
from __future__ import annotations

import json
import re
import shlex
from typing import Any

from probes.catalog.probe import Verdict
from probes.context import (
    GIB,
    ProbeContext,
)
from probes.host import script
from probes.model import CommandResult, Status

# ---------------------------------------------------------------------------------------------- helpers


def python_command(ctx: ProbeContext, name: str, args: Any = None) -> str:
    argv = [ctx.python, "-c", script(name)]
    if args is not None:
        argv.append(json.dumps(args, sort_keys=True))
    return " ".join(shlex.quote(a) for a in argv)


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def shell_failure(res: CommandResult, what: str) -> str:
    """`what` failed (exit N): <the shell's own text>."""
    text = last_line(res.stderr) or last_line(res.stdout) or "(no output)"
    if res.exit_status == 127:
        return f"{what} not found (exit 127): {text}"
    return f"{what} failed (exit {res.exit_status}): {text}"


def json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # not ours: a library printed to stdout; the raw stdout is in the report
    return out


class ScriptOutputError(Exception):
    pass


def script_json(res: CommandResult, what: str) -> dict:
    """The last JSON object the host script printed, or an error naming what went wrong."""
    objs = json_lines(res.stdout)
    if res.exit_status == 0 and objs:
        return objs[-1]
    if res.exit_status == 127:
        raise ScriptOutputError(shell_failure(res, "the host python"))
    detail = last_line(res.stderr) or "(no stderr)"
    raise ScriptOutputError(f"the {what} script exited {res.exit_status} without a result: {detail}")


def script_error_verdict(exc: ScriptOutputError, ctx: ProbeContext) -> Verdict:
    return Verdict(Status.ERROR, str(exc), remedy=f"run the command by hand on the host with {ctx.python} to see why")


def gib(n: float | int | None) -> str:
    if n is None:
        return "?"
    return f"{n / GIB:.1f} GiB"


def size_text(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def version_tuple(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    m = re.match(r"(\d+)\.(\d+)", str(text))
    return (int(m.group(1)), int(m.group(2))) if m else None
