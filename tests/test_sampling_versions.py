"""[sampling] ranges that differ between SGLang versions are judged before any server starts.

SGLang's SamplingParams.verify() took repetition_penalty in [0, 2] up to 0.5.11 and (0, 2] from 0.5.12
(engine/config/schema.py SAMPLING_VERSION_RANGES cites the wheels' lines). A run whose servers refuse every request
used to fail 40 s after the start (tests/test_refused_run.py); now `regen config check` refuses it where the config
names the version (a rehearsal's simulator plays one), and preflight's `config` probe refuses it against the version
the host's `packages` probe found, with the key, the value, the version and the fix.
"""
from __future__ import annotations

import json
import sys

import pytest

from console.cli import main as regen_main
from console.host.config_probe import config_passed
from engine.config.load import config_from_dict
from engine.config.schema import (SAMPLING_VERSION_RANGES, Sampling, named_sglang_version, sampling_version_problems,
                                  sampling_version_warnings, sglang_version_tuple, version_range)
from engine.simulator.profiles import PROFILES
from probes.model import ProbeReport, ProbeResult, Status
from tests.run_helpers import make_config
from tests.test_cli_run import regen
from tests.test_config_schema import BASE, to_toml
from tests.test_faults_fatal import write_config

ZERO = Sampling(repetition_penalty=0)
SIM = "{python} -m engine.simulator --model-path {model} --host {host} --port {port} --tp-size {tp}"


@pytest.mark.parametrize("version,refused", [("0.5.5.post3", False), ("0.5.10", False), ("0.5.10.post1", False),
                                             ("0.5.11", False), ("0.5.12", True), ("0.5.16", True),
                                             ("0.5.23", True), ("0.6.0rc1", True)])
def test_repetition_penalty_zero_is_judged_by_the_version_that_reads_it(version, refused):
    problems = sampling_version_problems(ZERO, version, "how it was read")
    assert bool(problems) is refused
    if refused:
        (key, text), = problems
        assert key == "[sampling] repetition_penalty"
        assert text.startswith(f"0 is refused by SGLang {version} (how it was read): from 0.5.12 on, SGLang takes "
                               "(0, 2], so every request would fail with HTTP 400; fix: write a value in (0, 2], e.g. "
                               "1.0 (no penalty)")
    assert sampling_version_problems(Sampling(repetition_penalty=1.05), version, "x") == []
    assert sampling_version_problems(Sampling(repetition_penalty=2), version, "x") == []


def test_the_version_rows_and_their_parsing():
    assert sglang_version_tuple("0.5.5.post3") == (0, 5, 5) and sglang_version_tuple("v0.5.23") == (0, 5, 23)
    assert sglang_version_tuple("main") is None and sglang_version_tuple(None) is None
    assert sampling_version_problems(ZERO, "unknown", "x") == []  # the caller says it could not judge
    assert version_range("repetition_penalty", (0, 5, 11)).words == "[0, 2]"
    assert version_range("repetition_penalty", (0, 5, 12)).words == "(0, 2]"
    assert version_range("temperature", (0, 5, 23)) is None
    # the schema's own field takes the widest range of every version: a config is valid for some version
    for row in SAMPLING_VERSION_RANGES:
        field = Sampling.model_fields[row.key]
        schema = Sampling.model_json_schema()["properties"][row.key]
        assert schema.get("minimum", schema.get("exclusiveMinimum")) <= row.low, field
        assert schema.get("maximum", schema.get("exclusiveMaximum")) >= row.high, field


@pytest.mark.parametrize("version", sorted(PROFILES))
def test_each_simulator_profile_refuses_what_the_schema_says_its_version_refuses(version):
    """One truth: the simulator's profile row and the schema's version rows agree for every simulated version."""
    profile = PROFILES[version]
    assert bool(sampling_version_problems(ZERO, profile.reported_version, "x")) is \
        profile.repetition_penalty_excludes_zero


def test_without_a_known_version_a_value_some_version_refuses_is_a_warning():
    (key, text), = sampling_version_warnings(ZERO)
    assert key == "[sampling] repetition_penalty"
    assert text == ("0 is refused by SGLang 0.5.12 and later ((0, 2]): preflight judges it against the host's "
                    "installed sglang; a value every version takes: 1.0 (no penalty)")
    assert sampling_version_warnings(Sampling()) == []


def _doc(launch: str | None = None, extra: list[str] | None = None, rp: float = 0) -> dict:
    workers = {**({"launch": launch} if launch else {}), **({"extra_args": extra} if extra else {})}
    return {**BASE, "sampling": {"repetition_penalty": rp}, **({"workers": workers} if workers else {})}


def test_the_config_names_the_version_of_a_rehearsal_only():
    assert named_sglang_version(config_from_dict(_doc())) is None  # real SGLang: the host's version decides
    assert named_sglang_version(config_from_dict(_doc(SIM)))[0] == "0.5.23"  # the simulator's default
    version, how = named_sglang_version(config_from_dict(_doc(SIM, ["--sim-sglang-version", "0.5.5"])))
    assert version == "0.5.5" and "--sim-sglang-version in [workers]" in how
    assert named_sglang_version(config_from_dict(_doc(SIM + " --sim-sglang-version=0.5.10")))[0] == "0.5.10"


def test_config_check_refuses_zero_for_a_0_5_23_target_with_the_key_value_version_and_fix(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(to_toml(_doc(SIM, ["--sim-sglang-version", "0.5.23"])))
    assert regen_main(["config", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert (f"regen config check: {bad}: [sampling] repetition_penalty: 0 is refused by SGLang 0.5.23 "
            "(--sim-sglang-version in [workers] launch / extra_args): from 0.5.12 on, SGLang takes (0, 2]") in err
    assert "fix: write a value in (0, 2], e.g. 1.0 (no penalty)" in err

    assert regen_main(["config", "check", "--json", str(bad)]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["valid"] is False and data["errors"][0]["key"] == "[sampling] repetition_penalty"
    assert "SGLang 0.5.23" in data["errors"][0]["problem"]

    old = tmp_path / "old.toml"  # 0.5.5 takes 0: valid
    old.write_text(to_toml(_doc(SIM, ["--sim-sglang-version", "0.5.5"])))
    assert regen_main(["config", "check", str(old)]) == 0
    assert "warning" not in capsys.readouterr().err

    real = tmp_path / "real.toml"  # real SGLang: the version is the host's; a warning names who refuses it
    real.write_text(to_toml(_doc()))
    assert regen_main(["config", "check", str(real)]) == 0
    captured = capsys.readouterr()
    assert "valid" in captured.out
    assert ("warning: [sampling] repetition_penalty: 0 is refused by SGLang 0.5.12 and later ((0, 2]): preflight "
            "judges it against the host's installed sglang") in captured.err


def _packages(version: str | None, host: str = "gpu-box") -> ProbeReport:
    sglang = {"ok": True, "version": version} if version else {"ok": False, "error": "ModuleNotFoundError: sglang"}
    result = ProbeResult("packages", "Python packages of the host env", Status.PASS if version else Status.FAIL, "",
                         data={"packages": {"sglang": sglang}})
    return ProbeReport(host=host, results=[result], started_at=0.0, duration_s=0.0)


def test_the_config_probe_judges_the_sampling_against_the_hosts_sglang():
    cfg = config_from_dict(_doc(), source_path="run.toml")
    r = config_passed(cfg, _packages("0.5.23"))
    assert r.status is Status.FAIL
    assert r.summary.startswith("run.toml: [sampling] repetition_penalty: 0 is refused by SGLang 0.5.23 (installed "
                                "on gpu-box, read by the packages probe): from 0.5.12 on, SGLang takes (0, 2]")
    assert "fix: write a value in (0, 2]" in r.summary and r.summary.endswith("nothing was started")
    assert "fix each key named above in [sampling]" in r.remedy
    assert r.data["sglang_versions"] == [{"version": "0.5.23", "how": "installed on gpu-box, read by the packages "
                                                                      "probe"}]
    assert config_passed(cfg, _packages("0.5.5.post3")).status is Status.PASS
    # sglang not importable (its own probe FAILs): no version to judge against, so a warning says who refuses it
    unknown = config_passed(cfg, _packages(None))
    assert unknown.status is Status.WARN and "refused by SGLang 0.5.12 and later" in unknown.summary
    # a fleet: each GPU host's packages report counts (the dispatch host runs no packages probe)
    fleet = config_passed(cfg, ProbeReport(host="dispatch", results=[], started_at=0.0, duration_s=0.0),
                          [_packages("0.5.10", "h1"), _packages("0.5.23", "h2")])
    assert fleet.status is Status.FAIL and "SGLang 0.5.23 (installed on h2" in fleet.summary
    assert "0.5.10" not in fleet.summary.split("; nothing")[0].split("refused by")[1]
    # a version that cannot be compared is said, never taken as a pass
    odd = config_passed(cfg, _packages("main"))
    assert odd.status is Status.WARN and "SGLang 'main'" in odd.summary and "not judged" in odd.summary


def test_a_model_value_the_version_refuses_says_where_it_came_from():
    cfg = config_from_dict({**BASE}, source_path="run.toml")
    model = ProbeResult("model.dir", "model", Status.PASS, "", data={"model": {"generation_config":
                                                                               {"repetition_penalty": 0}}})
    report = ProbeReport(host="gpu-box", results=[model, *_packages("0.5.23").results], started_at=0.0, duration_s=0.0)
    r = config_passed(cfg, report)
    assert r.status is Status.FAIL
    assert ("(the value is the model's generation_config.json; set repetition_penalty in [sampling] of run.toml to "
            "override it)") in r.summary


def test_probe_and_start_refuse_a_rehearsal_the_simulated_version_refuses_before_any_server(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=10, gpus=1)
    bad = write_config(tmp_path, cfg.model_copy(update=dict(
        sampling=cfg.sampling.model_copy(update={"repetition_penalty": 0}), host_python=sys.executable)))
    probe = regen("probe", "local", "--config", str(bad), "--only", "connection", "--json", home=tmp_path)
    assert probe.returncode == 1, probe.stdout + probe.stderr
    report = json.loads(probe.stdout)
    config = next(r for r in report["probes"] if r["id"] == "config")
    assert config["status"] == "FAIL"
    assert "[sampling] repetition_penalty: 0 is refused by SGLang 0.5.23" in config["summary"]
    assert "fix: write a value in (0, 2]" in config["summary"]

    started = regen("start", "local", "--config", str(bad), "--preflight", "connection", home=tmp_path)
    assert started.returncode == 1, started.stdout + started.stderr
    assert "preflight on local failed: config; nothing was started" in started.stderr
    assert not (run_dir / "supervisor.pid").exists() and not (run_dir / "workers").exists()
