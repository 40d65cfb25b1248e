"""How the console says why a run is not running: its fatal cause, a stop, or a supervisor that died
without a word. One place, used by `regen start`, `regen status` and the TUI header.

Everything here reads the status shape (engine.ctl last-status / the supervisor's status op): `fatal`
(engine.fatal.FatalRecord as a dict, or None), `running`, `state`, `log`, `log_tail`.
"""
from __future__ import annotations

from typing import Any

NOT_RUNNING_STATES = ("done", "drained", "stopped", "failed", "dead")


def is_running(status: dict[str, Any]) -> bool:
    """A supervisor answers (an old engine without `running`: not offline)."""
    return bool(status.get("running", not status.get("offline")))


def cause_headline(fatal: dict[str, Any]) -> str:
    return f"{fatal.get('exc_type') or 'Error'}: {fatal.get('message') or '(no message)'}"


def cause_lines(fatal: dict[str, Any]) -> list[str]:
    """`failed: <type>: <message>`, then where, what to do and where the log is."""
    lines = [f"failed: {cause_headline(fatal)}"]
    if fatal.get("path"):
        lines.append(f"  path:   {fatal['path']}")
    if fatal.get("remedy"):
        lines.append(f"  remedy: {fatal['remedy']}")
    if fatal.get("log"):
        lines.append(f"  log:    {fatal['log']}")
    return lines


def not_running_lines(status: dict[str, Any], start_hint: str, note: str = "") -> list[str]:
    """What an operator reads first about a run whose supervisor is gone: the cause, or that none was recorded,
    then how to start it again (start_hint: the `regen start ...` line, built by console.hints; note: a line
    that explains it, e.g. where the config is)."""
    state = status.get("state")
    fatal = status.get("fatal")
    extra = [f"  {note}"] if note else []
    if fatal:
        return cause_lines(fatal) + [f"  after the fix, start again: {start_hint}"] + extra
    if state == "dead":
        tail = status.get("log_tail") or []
        lines = [f"supervisor not running (killed? no cause recorded; last log lines of {status.get('log')}:)"]
        lines += [f"  | {line[:200]}" for line in tail] or ["  | (empty)"]
        return lines + [f"  resume with: {start_hint}"] + extra
    if state == "done":
        return ["done: every sample is settled"]
    end = status.get("run_end") or {}
    said = f"{state}: {end['cause']}" if end.get("cause") else f"{state}"
    return [f"{said}; resume with: {start_hint}"] + extra
