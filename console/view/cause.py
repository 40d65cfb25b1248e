"""How the console says why a run is not running: its fatal cause, a stop, or a supervisor that died
without a word. One place, used by `regen start`, `regen status` and the TUI header.

Everything here reads the status shape (engine.api.status.RunStatus: engine.ctl last-status / the supervisor's
status op): `fatal` (FatalRecord, or None), `running`, `state`, `log`, `log_tail`, `run_end`.
"""
from __future__ import annotations

from engine.api.wire import ENDED_RUN_STATES, RunState
from engine.api.status import FatalRecord, RunStatus

NOT_RUNNING_STATES = ENDED_RUN_STATES  # the wire's: nothing runs, no tok/s, no ETA


def cause_headline(fatal: FatalRecord) -> str:
    return f"{fatal.exc_type or 'Error'}: {fatal.message or '(no message)'}"


def cause_lines(fatal: FatalRecord) -> list[str]:
    """`failed: <type>: <message>`, then where, what to do and where the log is."""
    lines = [f"failed: {cause_headline(fatal)}"]
    if fatal.path:
        lines.append(f"  path:   {fatal.path}")
    if fatal.remedy:
        lines.append(f"  remedy: {fatal.remedy}")
    if fatal.log:
        lines.append(f"  log:    {fatal.log}")
    return lines


def not_running_lines(status: RunStatus, start_hint: str, note: str = "") -> list[str]:
    """What an operator reads first about a run whose supervisor is gone: the cause, or that none was recorded,
    then how to start it again (start_hint: the `regen start ...` line, built by console.host.hints; note: a line
    that explains it, e.g. where the config is)."""
    state = status.state
    extra = [f"  {note}"] if note else []
    if status.fatal:
        return cause_lines(status.fatal) + [f"  after the fix, start again: {start_hint}"] + extra
    if state == RunState.DEAD:
        lines = [f"supervisor not running (killed? no cause recorded; last log lines of {status.log}:)"]
        lines += [f"  | {line[:200]}" for line in status.log_tail] or ["  | (empty)"]
        return lines + [f"  resume with: {start_hint}"] + extra
    if state == RunState.DONE:
        return ["done: every sample is settled"]
    cause = status.run_end.cause if status.run_end is not None else ""
    said = f"{state}: {cause}" if cause else f"{state}"
    return [f"{said}; resume with: {start_hint}"] + extra
