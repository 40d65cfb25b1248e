"""The `config` probe: the run config judged before any host is touched, in the same report as the host's probes.
FAIL: one line per error (key, value found, fix); PASS: the effective sampling and template values and where each came
from. The sampling is also judged against the servers' SGLang version where its ranges differ (FAIL when that version
refuses a value; WARN when no version is known and some version would)."""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.config.load import ConfigError, EffectiveSampling, RunConfig, SOURCE_MODEL, with_model_defaults
from engine.config.schema import (config_warnings, named_sglang_version, sampling_version_problems,
                                  sampling_version_warnings, sglang_version_tuple)
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


@dataclass(frozen=True)
class SglangTarget:
    """An SGLang version the run's servers will be, and where it was read."""
    version: str
    how: str


def sglang_targets(cfg: RunConfig, reports: Sequence[ProbeReport]) -> list[SglangTarget]:
    """The versions the servers will run: the one a rehearsal's simulator plays, else each distinct sglang the
    `packages` probe found importable (on the host, or `<host>:packages` in a fleet's report)."""
    named = named_sglang_version(cfg)
    if named is not None:
        return [SglangTarget(*named)]
    found: dict[str, list[str]] = {}
    for report in reports:
        for r in report.results:
            if not (r.id == "packages" or r.id.endswith(":packages")) or r.status not in (Status.PASS, Status.WARN):
                continue
            sglang = (r.data.get("packages") or {}).get("sglang") or {}
            if sglang.get("ok") and sglang.get("version"):
                host = r.id.rpartition(":")[0] or report.host
                found.setdefault(str(sglang["version"]), []).append(host)
    return [SglangTarget(v, f"installed on {', '.join(hosts)}, read by the packages probe")
            for v, hosts in found.items()]


def sampling_version_findings(cfg: RunConfig, eff: EffectiveSampling, targets: Sequence[SglangTarget]
                              ) -> tuple[list[str], list[str]]:
    """(errors, warnings): the effective sampling against each target version's ranges; with no version known, a
    warning for each value some version refuses (the run's servers decide)."""
    from_model = {s.key for s in eff.sources if s.source == SOURCE_MODEL}

    def line(key: str, text: str) -> str:
        name = key.removeprefix("[sampling] ")
        origin = (f" (the value is the model's generation_config.json; set {name} in [sampling] of run.toml to "
                  "override it)") if name in from_model else ""
        return f"{key}: {text}{origin}"

    errors: list[str] = []
    unparsed = []
    for t in targets:
        if sglang_version_tuple(t.version) is None:
            unparsed.append(t)
            continue
        errors += [line(k, text) for k, text in sampling_version_problems(eff.sampling, t.version, t.how)]
    warnings = [f"SGLang {t.version!r} ({t.how}) is not a version regen can compare: the sampling ranges of its "
                "version were not judged" for t in unparsed]
    if not targets or unparsed:
        warnings += [line(k, text) for k, text in sampling_version_warnings(eff.sampling)]
    return errors, warnings


def config_passed(cfg: RunConfig, report: ProbeReport | None, others: Sequence[ProbeReport] = ()) -> ProbeResult:
    """PASS, WARN with what is allowed but probably not meant (engine.config.schema.config_warnings), or FAIL with
    the sampling values the servers' SGLang version refuses (`others`: a fleet's GPU hosts' reports, whose
    `packages` probes read the sglang each host runs)."""
    eff = effective_sampling(cfg, report)
    targets = sglang_targets(cfg, [r for r in (report, *others) if r is not None])
    errors, version_warnings = sampling_version_findings(cfg, eff, targets)
    warnings = [f"{key}: {text}" for key, text in config_warnings(cfg)] + version_warnings
    values = ", ".join(f"{s.key} {s.value}" for s in eff.sources)
    data: dict[str, Any] = {"sampling": eff.as_dict(), "note": eff.note,
                            "template": {"enable_thinking": cfg.enable_thinking, "turns": cfg.turns,
                                         "tokenizer": cfg.tokenizer_path, "context_length": cfg.context_length},
                            "sglang_versions": [{"version": t.version, "how": t.how} for t in targets],
                            "sampling_refused": errors}
    actual = "\n".join(sampling_lines(eff) + [f"enable_thinking {str(cfg.enable_thinking).lower()} (run.toml or "
                                               f"default); turns {cfg.turns}; tokenizer {cfg.tokenizer_path}"])
    judged = ("; sampling judged against SGLang " + ", ".join(f"{t.version} ({t.how})" for t in targets)
              if targets else "")
    if errors:
        return ProbeResult(
            id=CONFIG_PROBE, title=TITLE, status=Status.FAIL,
            summary=f"{cfg.source_path or 'run config'}: " + "; ".join(errors) + "; nothing was started",
            expected="every [sampling] value in the range of the servers' SGLang version" + judged, actual=actual,
            stdout="\n".join(errors),
            remedy="fix each key named above in [sampling], then check again with `regen probe HOST --config "
                   f"{cfg.source_path or 'run.toml'}`", data=data)
    return ProbeResult(
        id=CONFIG_PROBE, title=TITLE, status=Status.WARN if warnings else Status.PASS,
        summary=f"{cfg.source_path or 'run config'} valid; " + ("; ".join(warnings) + "; " if warnings else "")
        + f"sampling: {values}",
        expected="every key typed and in range (regen config schema)" + judged,
        actual=actual, data=data)


def sampling_lines(eff: EffectiveSampling) -> list[str]:
    lines = [f"{s.key} = {s.value!r}  ({s.source})" for s in eff.sources]
    return lines + ([f"note: {eff.note}"] if eff.note else [])
