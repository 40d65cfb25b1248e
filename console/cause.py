"""How the console says why a run is not running: its fatal cause, a stop, or a supervisor that died
without a word. One place, used by `regen start`, `regen status` and the TUI header.

Everything here reads the status shape (engine.ctl last-status / the supervisor's status op): `fatal`
(engine.fatal.FatalRecord as a dict, or None), `running`, `state`, `log`, `log_tail`.
"""
from __future__ import annotations

import shlex
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


def start_hint(host: str, run_dir: str, *, ssh_config: str | None = None) -> str:
    """The command that starts (resumes) this run again, shell-quoted, with the SSH options given."""
    argv = ["regen", "start", host, "--config", f"{run_dir.rstrip('/')}/run.toml"]
    if ssh_config:
        argv += ["--ssh-config", ssh_config]
    return shlex.join(argv)


def not_running_lines(status: dict[str, Any], host: str, *, ssh_config: str | None = None) -> list[str]:
    """What an operator reads first about a run whose supervisor is gone: the cause, or that none was recorded."""
    state = status.get("state")
    run_dir = status.get("run_dir") or ""
    fatal = status.get("fatal")
    hint = start_hint(host, run_dir, ssh_config=ssh_config)
    if fatal:
        return cause_lines(fatal) + [f"  after the fix, start again: {hint}"]
    if state == "dead":
        tail = status.get("log_tail") or []
        lines = [f"supervisor not running (killed? no cause recorded; last log lines of {status.get('log')}:)"]
        lines += [f"  | {line[:200]}" for line in tail] or ["  | (empty)"]
        return lines + [f"  resume with: {hint}"]
    if state == "done":
        return ["done: every sample is settled"]
    end = status.get("run_end") or {}
    return [f"{state}: {end['cause']}; resume with: {hint}" if end.get("cause") else f"{state}; resume with: {hint}"]
