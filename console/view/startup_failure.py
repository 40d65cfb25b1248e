"""What `regen start` says when the supervisor exits during startup: the cause first, then the remedy, then at most a
few lines of this start's log. cause_first() puts each changed field of a refused config change first."""
from __future__ import annotations

import re

LOG_LINES_SHOWN = 8
_START_MARK = re.compile(r"supervisor pid \d+ starting")
# engine/store/run_dir.py ConfigChanged: "run dir D was started with another config; changed: F OLD -> NEW, ...
# Its shards were generated with the old values, ... To proceed, REMEDY"
_CONFIG_CHANGED = re.compile(
    r"run dir (?P<dir>.+?) was started with another config; changed: (?P<changes>.+?)\. Its shards were generated"
    r".*?To proceed, (?P<remedy>.+)$")
# ", " then a content field name (engine.config.load.RunConfig.content_fields) and a space: where one change ends
_NEXT_CHANGE = re.compile(r", (?=(?:model|tokenizer|prompts|prompt_format|turns|enable_thinking|shard_size|content_hash"
                          r"|sampling\.\w+) )")


def cause_first(text: str, where: str) -> list[str] | None:
    """A refused config change as lines (None if `text` is not one): what happened to the run at `where`
    (HOST:DIR), each changed field with its old and new value, and the remedy."""
    m = _CONFIG_CHANGED.search(text)
    if m is None:
        return None
    changes = _NEXT_CHANGE.split(m.group("changes"))
    remedy = m.group("remedy").strip()
    return ([f"refused to resume {where}: the config changed since the run was started (its shards were "
             f"generated with the old values):"]
            + [f"  changed: {c}" for c in changes]
            + [f"  remedy: {remedy or 'revert the changed fields'}"])


def this_start(log_tail: str) -> list[str]:
    """The lines of the last start in a supervisor.log tail (all of them if no start line is in the tail)."""
    lines = log_tail.splitlines()
    starts = [i for i, line in enumerate(lines) if _START_MARK.search(line)]
    return lines[starts[-1]:] if starts else lines


def startup_failure_text(pid: int, where: str, log_path: str, log_tail: str) -> str:
    """The supervisor (pid) exited during startup: its cause first when the log names one, then the last lines
    of this start's log. where: HOST:DIR."""
    lines = this_start(log_tail)
    cause = next((c for line in reversed(lines) if (c := cause_first(line, where)) is not None), None)
    shown = lines[-LOG_LINES_SHOWN:]
    parts = cause or []
    more = f"the last {len(shown)} of its {len(lines)} lines" if len(lines) > len(shown) else "its lines"
    parts.append(f"the supervisor (pid {pid}) exited during startup on {where}; this start in {log_path} ({more}):")
    parts += [f"  {line}" for line in shown] or ["  (empty)"]
    return "\n".join(parts)
