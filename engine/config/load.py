"""Run config: one TOML file (`run.toml`) loaded through the schema (engine.config.schema) into a typed RunConfig.

Every error of a file is reported at once (engine.config.errors words them); the content hash covers only the fields
that change what the shards contain; sampling keys left out take the model's generation_config.json values, else
regen's defaults, each effective value keeping its source.
"""
from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from engine.config.errors import ConfigError, ConfigIssue, issues_of
from engine.config.schema import (DEFAULT_LAUNCH, DETERMINISTIC_FLAG, NOTIFY_FORMATS, PROMPT_FORMATS,
                                  ROUTER_LINKS, ROUTER_POLICIES, SEVERITIES, SIMULATOR_LAUNCH, TURN_MODES,
                                  TURNS_AFTER_CUT, Alerts,
                                  Brake, Dispatch, Host, Metrics, NotifyConfig, PlanAssumptions, Router, RunConfig,
                                  Runaway,
                                  Sampling, Slurm, Store, Workers, host_workers, launch_words, redact_url)

__all__ = ["ConfigError", "ConfigIssue", "RunConfig", "Sampling", "Workers", "Dispatch", "Alerts", "Runaway", "Brake",
           "Store", "PlanAssumptions", "NotifyConfig", "Metrics", "Host", "Router", "Slurm", "load_config", "config_from_dict",
           "dump_toml", "toml_value", "changed_content_fields", "host_workers", "launch_words",
           "redact_url", "with_model_defaults", "SamplingSource", "EffectiveSampling", "MODEL_SAMPLING_KEYS",
           "DEFAULT_LAUNCH", "DETERMINISTIC_FLAG", "NOTIFY_FORMATS", "PROMPT_FORMATS", "ROUTER_LINKS", "ROUTER_POLICIES",
           "SEVERITIES", "SIMULATOR_LAUNCH", "TURN_MODES", "TURNS_AFTER_CUT", "resolve_sampling",
           "read_generation_config"]

# what SGLang's OpenAI API takes from generation_config.json (--sampling-defaults model; contract 2.5)
MODEL_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
SOURCE_FILE, SOURCE_MODEL, SOURCE_DEFAULT = "run.toml", "generation_config.json", "regen default"


def config_from_dict(data: Any, source_path: str | None = None) -> RunConfig:
    """The TOML document as a RunConfig; ConfigError with every problem of the document otherwise."""
    if not isinstance(data, dict):
        raise ConfigError([ConfigIssue("(file)", "is not a TOML table", "")], source_path)
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(issues_of(exc, data), source_path) from None
    return cfg.with_source(source_path)


def load_config(path: str | Path, given_to: str = "--config") -> RunConfig:
    """given_to: where the operator gave the path (an option, or a command such as `regen config check`): the fix
    of an unreadable file names it."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError([ConfigIssue("(file)", f"cannot be read: {exc}", f"check the path given to {given_to}")],
                          str(path)) from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError([ConfigIssue("(file)", f"is not valid TOML: {exc}",
                                       "fix the line named (strings in double quotes, one key = value a line)")],
                          str(path)) from exc
    return config_from_dict(data, source_path=str(path))


# -- what changes the data ------------------------------------------------------------------------

def changed_content_fields(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Names of content fields that differ (dotted for sampling), for the refusal message."""
    changed = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += [f"{key}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            changed.append(key)
    return changed


# -- effective sampling and where each value came from ----------------------------------------------

@dataclass(frozen=True)
class SamplingSource:
    key: str
    value: Any
    source: str  # run.toml | generation_config.json | regen default


@dataclass(frozen=True)
class EffectiveSampling:
    sampling: Sampling
    sources: tuple[SamplingSource, ...]
    note: str = ""  # why the model's file was not used, when it was not

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {s.key: {"value": s.value, "source": s.source} for s in self.sources}


def with_model_defaults(sampling: Sampling, generation_config: dict[str, Any] | None, note: str = "") -> EffectiveSampling:
    """Keys set in run.toml win; unset ones take the model's generation_config.json values (SGLang's OpenAI API does
    the same; /generate applies none, so regen sends them), else regen's defaults. A model value that fails the
    schema is not taken: the default stays, and the note says so."""
    explicit = sampling.model_fields_set
    taken: dict[str, Any] = {}
    notes = [note] if note else []
    for key in MODEL_SAMPLING_KEYS:
        if key in explicit or not generation_config or key not in generation_config:
            continue
        candidate = {**{k: getattr(sampling, k) for k in explicit}, **taken, key: generation_config[key]}
        try:
            Sampling.model_validate(candidate)
        except ValidationError:
            notes.append(f"generation_config.json {key} = {generation_config[key]!r} is not a valid value: "
                         f"regen's default {getattr(sampling, key)!r} is used")
            continue
        taken[key] = generation_config[key]
    checked = Sampling.model_validate({**{k: getattr(sampling, k) for k in explicit}, **taken})
    # the fields set stay run.toml's own: resolving again (the frozen copy, an export) names the same sources
    effective = Sampling.model_construct(_fields_set=set(explicit), **checked.model_dump())
    sources = []
    for key in Sampling.model_fields:
        value = getattr(effective, key)
        if key == "seed" and value is None:
            continue
        source = SOURCE_FILE if key in explicit else SOURCE_MODEL if key in taken else SOURCE_DEFAULT
        sources.append(SamplingSource(key, value, source))
    return EffectiveSampling(effective, tuple(sources), "; ".join(notes))


def read_generation_config(model_dir: str | Path) -> tuple[dict[str, Any] | None, str]:
    """The model dir's generation_config.json (None and why, when there is none or it cannot be read)."""
    path = Path(model_dir).expanduser() / "generation_config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"no {path}: regen's defaults fill the unset sampling keys"
    except (OSError, ValueError) as exc:
        return None, f"{path} cannot be read ({exc}): regen's defaults fill the unset sampling keys"
    if not isinstance(data, dict):
        return None, f"{path} is not a JSON object: regen's defaults fill the unset sampling keys"
    return data, ""


def resolve_sampling(cfg: RunConfig) -> tuple[RunConfig, EffectiveSampling]:
    """On the host: the config with its effective sampling (the model's values where run.toml is silent)."""
    generation_config, note = read_generation_config(cfg.model)
    effective = with_model_defaults(cfg.sampling, generation_config, note)
    return cfg.model_copy(update={"sampling": effective.sampling}), effective


# -- the frozen copy ------------------------------------------------------------------------------

def dump_toml(cfg: RunConfig) -> str:
    """Serialize a config back to TOML (the frozen copy kept in the run dir, the staged copy `regen start` sends).
    [sampling] keeps only the keys that were set, so that the host still fills the others from the model."""
    d = cfg.to_dict()
    d["sampling"] = cfg.sampling.model_dump(exclude_unset=True)
    if not d["sampling"]:
        d.pop("sampling")
    if not cfg.notify.enabled:
        d.pop("notify", None)  # an empty [notify] is refused at load
    elif not cfg.notify.command:
        d["notify"].pop("command")  # so is an empty command list
    lines: list[str] = []
    tables = {}
    hosts = d.pop("hosts", None) or []
    for key, value in d.items():
        if isinstance(value, dict):
            tables[key] = value
        elif value is not None:
            lines.append(f"{key} = {toml_value(value)}")
    for name, table in tables.items():
        lines.append("")
        lines.append(f"[{name}]")
        for key, value in table.items():
            if value is not None:
                lines.append(f"{key} = {toml_value(value)}")
    for host in hosts:
        lines.append("")
        lines.append("[[hosts]]")
        lines += [f"{key} = {toml_value(value)}" for key, value in host.items() if value is not None]
    return "\n".join(lines) + "\n"


def toml_value(value: Any) -> str:
    """One TOML value (inline tables for dicts)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
