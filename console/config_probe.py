"""The `config` probe: the run config judged before any host is touched, in the same report as the host's probes.

FAIL carries one line per error (key, value found, fix), so `regen probe`, `start`, the TUI's Preflight tab and
--json all say the same thing. PASS says the effective sampling and template settings and where each value came
from (run.toml, the model's generation_config.json as the model.dir probe read it, or regen's default).
"""
from __future__ import annotations

import time
from typing import Any

from engine.config.load import ConfigError, EffectiveSampling, RunConfig, with_model_defaults
from engine.config.schema import config_warnings
from probes.model import ProbeReport, ProbeResult, Status

CONFIG_PROBE = "config"
TITLE = "run config (schema, effective values)"


def config_failed(exc: ConfigError) -> ProbeResult:
    n = len(exc.issues)
    return ProbeResult(
        id=CONFIG_PROBE, title=TITLE, status=Status.FAIL,
        summary=f"{exc.path or 'the run config'}: {n} error{'s' if n != 1 else ''}; nothing was started or probed",
        expected="every key typed and in range (regen config schema)", actual=f"{n} error{'s' if n != 1 else ''}",
        stdout="\n".join(exc.lines()), remedy="fix each key named above, then check with `regen config check "
        f"{exc.path or 'run.toml'}`", data=exc.to_dict())


def config_failed_report(host: str, exc: ConfigError) -> ProbeReport:
    return ProbeReport(host=host, results=[config_failed(exc)], started_at=time.time(), duration_s=0.0)


def effective_sampling(cfg: RunConfig, report: ProbeReport | None) -> EffectiveSampling:
    """The sampling the host will send: the model.dir probe's generation_config.json where run.toml is silent."""
    model_dir = next((r for r in (report.results if report else []) if r.id == "model.dir"), None)
    model = (model_dir.data.get("model") or {}) if model_dir is not None else {}
    if model_dir is None or "generation_config" not in model and "generation_config_error" not in model:
        return with_model_defaults(cfg.sampling, None, "the model dir was not read: values from the model, if any, "
                                                      "are applied on the host at the start")
    return with_model_defaults(cfg.sampling, model.get("generation_config"), model.get("generation_config_error", ""))


def config_passed(cfg: RunConfig, report: ProbeReport | None) -> ProbeResult:
    """PASS, or WARN with what is allowed but probably not meant (engine.config.schema.config_warnings)."""
    eff = effective_sampling(cfg, report)
    warnings = [f"{key}: {text}" for key, text in config_warnings(cfg)]
    values = ", ".join(f"{s.key} {s.value}" for s in eff.sources)
    data: dict[str, Any] = {"sampling": eff.as_dict(), "note": eff.note,
                            "template": {"enable_thinking": cfg.enable_thinking, "turns": cfg.turns,
                                         "tokenizer": cfg.tokenizer_path, "context_length": cfg.context_length}}
    return ProbeResult(
        id=CONFIG_PROBE, title=TITLE, status=Status.WARN if warnings else Status.PASS,
        summary=f"{cfg.source_path or 'run config'} valid; " + ("; ".join(warnings) + "; " if warnings else "")
        + f"sampling: {values}",
        expected="every key typed and in range (regen config schema)",
        actual="\n".join(sampling_lines(eff) + [f"enable_thinking {str(cfg.enable_thinking).lower()} (run.toml or "
                                                 f"default); turns {cfg.turns}; tokenizer {cfg.tokenizer_path}"]),
        data=data)


def sampling_lines(eff: EffectiveSampling) -> list[str]:
    lines = [f"{s.key} = {s.value!r}  ({s.source})" for s in eff.sources]
    return lines + ([f"note: {eff.note}"] if eff.note else [])
