"""A config's errors worded for a person: the key path, the value found, what was expected, and the fix.

One wording for every door: `regen config check`, probe, plan, start, the TUI's Preflight tab and --json all print
these lines (ConfigError.lines / .to_dict()), never a traceback.
"""
from __future__ import annotations

import difflib
import json
import shlex
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

# a union member's tag in an error's location (Real is int | float): not a key
_UNION_TAGS = {"int", "float", "str", "constrained-int", "constrained-float", "function-after[check(), int]",
               "function-after[check(), float]"}
_EXPECTED = {"int_type": "an integer", "int_from_float": "a whole number", "float_type": "a number",
             "bool_type": "true or false", "string_type": "a string in double quotes",
             "tuple_type": "a list [...]", "list_type": "a list [...]", "dict_type": "a table",
             "model_type": "a table", "model_attributes_type": "a table"}


@dataclass(frozen=True)
class ConfigIssue:
    key: str  # `[sampling] temperature`, `shard_size`, `[[hosts]] #2 gpus`
    problem: str  # what is wrong, with the value found
    fix: str  # what to write instead ("" when the problem says it)

    def line(self) -> str:
        return f"{self.key}: {self.problem}" + (f"; fix: {self.fix}" if self.fix else "")


class ConfigError(ValueError):
    """A run config that cannot be used: every problem found, each naming its key."""

    def __init__(self, issues: list[ConfigIssue] | str, path: str | None = None):
        self.issues = [ConfigIssue("(config)", issues, "")] if isinstance(issues, str) else list(issues)
        self.path = path
        super().__init__(self.text())

    def lines(self) -> list[str]:
        return [issue.line() for issue in self.issues]

    def text(self) -> str:
        where = self.path or "run config"
        if len(self.issues) == 1:
            return f"{where}: {self.lines()[0]}"
        return f"{where}: {len(self.issues)} errors\n" + "\n".join(f"  - {line}" for line in self.lines())

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "errors": [asdict(i) | {"line": i.line()} for i in self.issues]}


def key_path(loc: tuple[Any, ...]) -> str:
    """('sampling', 'temperature') -> `[sampling] temperature`; ('hosts', 1, 'gpus', 0) -> `[[hosts]] #2 gpus[0]`."""
    parts = [p for p in loc if not (isinstance(p, str) and p in _UNION_TAGS)]
    if not parts:
        return "(top level)"
    head, rest = parts[0], parts[1:]
    if not rest and head in _SECTIONS:
        return "[[hosts]]" if head == "hosts" else f"[{head}]"
    if head == "hosts" and rest and isinstance(rest[0], int):
        prefix, rest = f"[[hosts]] #{rest[0] + 1}", rest[1:]
    elif rest and isinstance(head, str) and head in _SECTIONS:
        prefix = f"[{head}]"
    else:
        prefix, rest = str(head), rest
        text = prefix + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in rest)
        return text
    text = prefix
    for p in rest:
        text += f"[{p}]" if isinstance(p, int) else f" {p}" if text == prefix else f".{p}"
    return text


_SECTIONS = {"sampling", "workers", "dispatch", "alerts", "plan", "store", "runaway", "brake", "router", "notify",
             "metrics", "hosts", "slurm"}


def issues_of(exc: ValidationError, data: dict[str, Any]) -> list[ConfigIssue]:
    out: list[ConfigIssue] = []
    seen: set[str] = set()
    for err in exc.errors(include_url=False):
        rule = (err.get("ctx") or {}).get("error")
        if err["type"] == "value_error" and rule is not None and hasattr(rule, "problems"):  # a ConfigRuleError
            for key, text in rule.problems:
                out.append(ConfigIssue(key, text, ""))
            continue
        issue = _issue(err, data)
        if issue.key in seen:  # a union (int | float) reports each member: one line is enough
            continue
        seen.add(issue.key)
        out.append(issue)
    return out


def _issue(err: ErrorDetails, data: dict[str, Any]) -> ConfigIssue:
    kind, loc, found = err["type"], tuple(err["loc"]), err.get("input")
    key = key_path(loc)
    if kind == "extra_forbidden":
        return ConfigIssue(key, "unknown key", _unknown_fix(loc, data))
    if kind == "missing":
        return ConfigIssue(key, "is required and missing", f"add `{loc[-1]} = ...` ({_required_hint(loc)})")
    shown = _show(found)
    if kind in _EXPECTED:
        expected = _EXPECTED[kind]
        if kind in ("int_type", "float_type") and loc and loc[-1] in ("int", "float"):
            expected = "a number"
        return ConfigIssue(key, f"{shown} ({_kind_of(found)}): expected {expected}", _type_fix(kind, expected, found))
    if kind == "literal_error":
        allowed = (err.get("ctx") or {}).get("expected", "")
        return ConfigIssue(key, f"{shown}: must be one of {allowed}", "")
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        return ConfigIssue(key, f"{shown}: {_range_words(loc, err)}{_about(loc)}", "")
    if kind in ("string_too_short", "too_short"):
        return ConfigIssue(key, f"{shown}: is empty", "give a value, or remove the key to take its default")
    if kind == "string_pattern_mismatch":
        return ConfigIssue(key, f"{shown}: letters, digits, - and _ only", "")
    if kind == "value_error":
        return ConfigIssue(key, f"{shown}: {err['msg'].removeprefix('Value error, ')}{_about(loc)}", "")
    return ConfigIssue(key, f"{shown}: {_lower(err['msg'])}", "")


def _walk(loc: tuple[Any, ...]) -> tuple[Any, Any]:
    """(the section model, the FieldInfo) a key path leads to through the schema; (None, None) off the schema."""
    from engine.config.schema import Host, RunConfig

    model: Any = RunConfig
    field = None
    for part in (p for p in loc if not isinstance(p, int) and p not in _UNION_TAGS):
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return None, None
        field = fields[part]
        model = Host if part == "hosts" else _section_type(field.annotation)
    return model, field


def _section_type(annotation: Any) -> Any:
    """A section's model, also where the section is optional (`[slurm]`: Slurm | None)."""
    for arg in getattr(annotation, "__args__", ()):
        if hasattr(arg, "model_fields"):
            return arg
    return annotation


def _field(loc: tuple[Any, ...]):
    """The schema's FieldInfo of a key path (None for a path that is not a field)."""
    return _walk(loc)[1]


def _about(loc: tuple[Any, ...]) -> str:
    """` (default 512): what the key does.`: the default and the meaning, from the schema."""
    field = _field(loc)
    if field is None:
        return ""
    default = field.get_default(call_default_factory=False) if field.default_factory is None else None
    shown = "" if default is None else f" (default {_show(list(default) if isinstance(default, tuple) else default)})"
    about = (field.description or "").rstrip(".")
    if about[:2].istitle():  # "The longest ..." reads on as "; the longest ..."
        about = about[0].lower() + about[1:]
    return shown + (f"; {about}" if about else "")


def _range_words(loc: tuple[Any, ...], err: ErrorDetails) -> str:
    """`must be an integer in 1..4096` when both bounds are known, else pydantic's one bound in plain words."""
    field = _field(loc)
    low = high = None
    for m in getattr(field, "metadata", []) or []:
        low = getattr(m, "ge", low) if getattr(m, "ge", None) is not None else low
        high = getattr(m, "le", high) if getattr(m, "le", None) is not None else high
    if low is not None and high is not None:
        return f"must be an integer in {low}..{high}"
    return _lower(err["msg"])


def _lower(msg: str) -> str:
    msg = msg.removeprefix("Input should be ")
    return "must be " + msg if not msg.startswith("must") else msg


def _kind_of(value: Any) -> str:
    return {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "a list",
            dict: "a table"}.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float, list, dict)):
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = repr(value)
        return text if len(text) <= 80 else text[:77] + "..."
    return repr(value)


def _type_fix(kind: str, expected: str, found: Any) -> str:
    if isinstance(found, str):
        text = found.strip()
        if kind in ("int_type", "float_type"):
            try:
                number = int(text) if kind == "int_type" and expected != "a number" else float(text)
            except ValueError:
                return f"write {expected} without quotes"
            return f"write {text if kind == 'float_type' or expected == 'a number' else number} without quotes"
        if kind == "bool_type" and text.lower() in ("true", "false"):
            return f"write {text.lower()} without quotes"
        if kind in ("tuple_type", "list_type"):
            items = [t.strip() for t in text.split(",") if t.strip()]
            if items and all(t.lstrip("-").isdigit() for t in items):
                return f"write a list: [{', '.join(items)}]"
            if " " in text and "," not in text:  # a command line: one item per word (argv, no shell)
                try:
                    return f"write a list, one item per word (argv, no shell): {json.dumps(shlex.split(text))}"
                except ValueError:
                    pass  # unbalanced quotes: the plain suggestion below
            return f"write a list: {json.dumps(items or [text])}"
    if kind == "int_type" and isinstance(found, float) and found.is_integer():
        return f"write {int(found)} (a whole number, no decimal point)"
    if kind == "string_type" and isinstance(found, (int, float)) and not isinstance(found, bool):
        return f'write it in double quotes: "{found}"'
    if kind in ("tuple_type", "list_type") and not isinstance(found, (list, dict)):
        return f"write a list: [{_show(found)}]"
    if kind in ("dict_type", "model_type"):
        return "write it as a table: [name] on its own line with its keys below, or name = {key = value}"
    return f"write {expected}"


def _unknown_fix(loc: tuple[Any, ...], data: dict[str, Any]) -> str:
    model, _ = _walk(loc[:-1])  # the section the unknown key was written in
    known = sorted(getattr(model, "model_fields", {}))
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.45)
    hint = f"did you mean `{close[0]}`? " if close else ""
    return f"{hint}remove it, or use a known key: {', '.join(known)}" if known else "remove it"


def _required_hint(loc: tuple[Any, ...]) -> str:
    return {"run_dir": 'the run directory on the host, e.g. "~/runs/qwen3-regen"',
            "model": 'the model directory, e.g. "/models/Qwen3-27B"',
            "prompts": 'prompt files or globs, e.g. ["/data/prompts/*.jsonl"]',
            "name": 'the host\'s name, e.g. "gpu-a"', "address": 'an ssh alias or user@host[:port]'}.get(
                str(loc[-1]), "see `regen config schema`")
