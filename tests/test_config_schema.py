"""No config mistake reaches a GPU: every key of run.toml is typed and checked by one schema, before anything starts.

For every key the schema has, values of each wrong kind (a string for a number, bool or list; a number for a
string; a list for a scalar; out of range; an unknown key in every section) are written into an otherwise valid
run.toml: `regen config check`, `probe`, `plan` and `start` exit non-zero, name the key, print no traceback, and
start nothing. The five slips that once passed every check are refused over the suite's real sshd, with the key,
the value and the fix. Effective sampling values say where each came from.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from console.cli import main as regen_main
from engine.config.load import ConfigError, config_from_dict, toml_value, with_model_defaults
from engine.config.schema import RunConfig, Sampling
from tests.test_cli_run import regen

BASE: dict[str, Any] = {"run_dir": "/nonexistent/regen-run", "model": "/nonexistent/model",
                        "prompts": ["/nonexistent/prompts/*.jsonl"]}
SECTIONS = ("sampling", "workers", "dispatch", "alerts", "plan", "store", "runaway", "brake", "router", "notify",
            "metrics", "slurm")


def to_toml(doc: dict[str, Any]) -> str:
    lines = [f"{k} = {toml_value(v)}" for k, v in doc.items() if not isinstance(v, (dict, list)) or k == "prompts"
             or (isinstance(v, list) and not (v and isinstance(v[0], dict)))]
    for k, v in doc.items():
        if isinstance(v, dict):
            lines += ["", f"[{k}]"] + [f"{kk} = {toml_value(vv)}" for kk, vv in v.items()]
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for entry in v:
                lines += ["", f"[[{k}]]"] + [f"{kk} = {toml_value(vv)}" for kk, vv in entry.items()]
    return "\n".join(lines) + "\n"


def _wrong_values(prop: dict[str, Any]) -> list[tuple[str, Any]]:
    """(kind, value) pairs that the property must refuse."""
    kinds = {t.get("type") for t in prop.get("anyOf", [prop])} - {None, "null"}
    out: list[tuple[str, Any]] = []
    if "enum" in prop or any("enum" in t for t in prop.get("anyOf", [])):
        out.append(("not one of the choices", "surely-not-a-choice"))
    if kinds & {"number", "integer"}:
        out += [("string for a number", "0.6" if "number" in kinds else "50"), ("bool for a number", True),
                ("list for a scalar", [1])]
        if "integer" in kinds and "number" not in kinds:
            out.append(("float for an integer", 2.5))
        for t in prop.get("anyOf", [prop]):
            for bound, step in (("minimum", -1), ("exclusiveMinimum", 0), ("maximum", 1), ("exclusiveMaximum", 0)):
                if bound in t:
                    out.append((f"out of range ({bound} {t[bound]})", t[bound] + step))
    if "boolean" in kinds:
        out += [("string for a bool", "false"), ("number for a bool", 1)]
    if "string" in kinds and "enum" not in prop:
        if not kinds & {"number", "integer"}:  # "auto" | number takes a number
            out.append(("number for a string", 5))
        out.append(("list for a scalar", ["x"]))
    if "array" in kinds:
        out += [("string for a list", "0,1"), ("number for a list", 5)]
    if "object" in kinds:
        out.append(("string for a table", "x"))
    return out


def _cases() -> list[tuple[str, str, Any, str]]:
    """(section or '' or 'hosts', key, wrong value, what kind of wrong)."""
    schema = RunConfig.model_json_schema()
    defs = schema["$defs"]
    cases = []
    for key, prop in schema["properties"].items():
        if "$ref" in prop or key == "hosts":
            continue
        for kind, value in _wrong_values(prop):
            if key == "prompts" and kind in ("list for a scalar", "string for a list"):
                continue  # prompts is a list, or one path as a string
            cases.append(("", key, value, kind))
    for section in SECTIONS + ("hosts",):
        ref = schema["properties"][section]
        name = next(r["$ref"] for r in (ref, ref.get("items", {}), *ref.get("anyOf", [])) if "$ref" in r).rsplit("/", 1)[1]
        for key, prop in defs[name]["properties"].items():
            for kind, value in _wrong_values(prop):
                if (section, key, kind) == ("slurm", "nodes", "number for a string"):
                    continue  # nodes is a count, or a range as a string
                cases.append((section, key, value, kind))
        cases.append((section, "no_such_key", 1, "unknown key"))
    cases.append(("", "no_such_key", 1, "unknown key"))
    return cases


CASES = _cases()


def doc_with(section: str, key: str, value: Any) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(json.dumps(BASE))
    if section == "":
        doc[key] = value
    elif section == "hosts":
        doc["hosts"] = [{"name": "gpu-a", "address": "gpu-a.example", key: value}]
    else:
        if section == "notify" and key not in ("url", "command"):
            doc[section] = {"url": "https://ntfy.sh/x"}
        if section == "slurm" and key != "partition":
            doc[section] = {"partition": "gpu"}
        doc.setdefault(section, {})[key] = value
    return doc


def key_named(section: str, key: str) -> str:
    return key if section == "" else f"[[hosts]] #1 {key}" if section == "hosts" else f"[{section}] {key}"


def test_the_cases_cover_every_key_of_the_schema():
    covered = {(s, k) for s, k, _, _ in CASES}
    assert ("sampling", "temperature") in covered and ("workers", "gpus") in covered and ("", "shard_size") in covered
    assert all((s, "no_such_key") in covered for s in SECTIONS + ("hosts", ""))
    assert len(CASES) > 250


@pytest.mark.parametrize("section,key,value,kind", CASES, ids=[f"{s or 'top'}.{k}:{kd}" for s, k, _, kd in CASES])
def test_config_check_refuses_every_wrong_kind_of_every_key(tmp_path, capsys, section, key, value, kind):
    path = tmp_path / "run.toml"
    path.write_text(to_toml(doc_with(section, key, value)))
    code = regen_main(["config", "check", str(path)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert key_named(section, key) in err, err
    assert "Traceback" not in err and str(path) in err


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(CASES), command=st.sampled_from(["probe", "plan", "start"]))
def test_probe_plan_and_start_refuse_before_anything_starts(tmp_path_factory, capsys, case, command):
    section, key, value, _ = case
    tmp = tmp_path_factory.mktemp("cfg")
    path = tmp / "run.toml"
    doc = doc_with(section, key, value)
    if (section, key) != ("", "run_dir"):  # the case itself when it is run_dir's
        doc["run_dir"] = str(tmp / "run")
    path.write_text(to_toml(doc))
    argv = [command, "local", "--config", str(path)]
    code = regen_main(argv)
    out = capsys.readouterr()
    assert code != 0, out
    assert key_named(section, key) in out.out + out.err
    assert "Traceback" not in out.out + out.err
    assert not (tmp / "run").exists(), "a run dir was made from an invalid config"


def test_every_error_of_a_file_is_reported_at_once_with_the_fix(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('run_dir = "/r"\nmodel = "/m"\nprompts = ["/p.jsonl"]\nshard_size = "50"\nenable_thinking = "false"\n'
                    '[sampling]\ntemperature = "0.6"\ntemprature = 0.7\n[workers]\ngpus = "0,1"\nbase_port = "30100"\n')
    with pytest.raises(ConfigError) as exc:
        from engine.config.load import load_config
        load_config(path)
    lines = exc.value.lines()
    assert len(lines) == 6
    assert '[sampling] temperature: "0.6" (a string): expected a number; fix: write 0.6 without quotes' in lines
    assert 'enable_thinking: "false" (a string): expected true or false; fix: write false without quotes' in lines
    assert '[workers] gpus: "0,1" (a string): expected a list [...]; fix: write a list: [0, 1]' in lines
    assert 'shard_size: "50" (a string): expected an integer; fix: write 50 without quotes' in lines
    assert '[workers] base_port: "30100" (a string): expected an integer; fix: write 30100 without quotes' in lines
    assert any(line.startswith("[sampling] temprature: unknown key; fix: did you mean `temperature`?") for line in lines)


def test_config_check_json_and_schema(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text(to_toml(BASE))
    ok = regen("config", "check", str(good), home=tmp_path)
    assert ok.returncode == 0 and "valid" in ok.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text(to_toml(doc_with("sampling", "top_p", 1.5)))
    js = regen("config", "check", "--json", str(bad), home=tmp_path)
    assert js.returncode == 1
    data = json.loads(js.stdout)
    assert data["valid"] is False and data["errors"][0]["key"] == "[sampling] top_p"
    schema = json.loads(regen("config", "schema", home=tmp_path).stdout)
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert schema["$defs"]["Sampling"]["properties"]["temperature"]["description"]
    assert schema["$defs"]["Sampling"]["additionalProperties"] is False


def test_unset_sampling_keys_take_the_models_values_and_say_so():
    cfg = config_from_dict({**BASE, "sampling": {"temperature": 0.8}})
    eff = with_model_defaults(cfg.sampling, {"temperature": 0.1, "top_p": 0.8, "top_k": 40, "min_p": "bad"})
    by_key = {s.key: (s.value, s.source) for s in eff.sources}
    assert by_key["temperature"] == (0.8, "run.toml")
    assert by_key["top_p"] == (0.8, "generation_config.json") and by_key["top_k"] == (40, "generation_config.json")
    assert by_key["min_p"] == (0.0, "regen default") and "min_p" in eff.note
    assert by_key["max_new_tokens"] == (32768, "regen default")
    # the fields set stay run.toml's own: resolving the resolved sampling names the same sources
    again = with_model_defaults(eff.sampling, {"temperature": 0.1, "top_p": 0.8, "top_k": 40})
    assert again.sources == eff.sources


def test_plan_prints_each_sampling_value_with_its_source(tmp_path, tiny_model_dir):
    from tests.run_helpers import make_config
    from tests.test_faults_fatal import write_config

    model = tmp_path / "model"
    import shutil
    shutil.copytree(tiny_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.8, "top_k": 30}))
    cfg = make_config(tmp_path / "run", model, prompts=10, gpus=1)
    cfg = cfg.model_copy(update={"sampling": Sampling.model_validate({"top_k": 25, "max_new_tokens": 512})})
    config = write_config(tmp_path, cfg)
    r = regen("plan", "local", "--config", str(config), "--json", home=tmp_path)
    assert r.returncode == 0, r.stderr
    sampling = json.loads(r.stdout)["sampling"]
    assert sampling["temperature"] == {"value": 0.7, "source": "generation_config.json"}
    assert sampling["top_p"] == {"value": 0.8, "source": "generation_config.json"}
    assert sampling["top_k"] == {"value": 25, "source": "run.toml"}
    assert sampling["max_new_tokens"] == {"value": 512, "source": "run.toml"}
    assert sampling["min_p"]["source"] == "regen default"
    human = regen("plan", "local", "--config", str(config), home=tmp_path, env={"COLUMNS": "200"})
    assert "sampling sent with every request" in human.stdout
    assert "generation_config.json" in human.stdout and "run.toml" in human.stdout


FIVE_SLIPS = [
    ("sampling", "temperature", "0.6", '[sampling] temperature: "0.6" (a string): expected a number', "write 0.6 without quotes"),
    ("", "enable_thinking", "false", 'enable_thinking: "false" (a string): expected true or false', "write false without quotes"),
    ("workers", "gpus", "0,1", '[workers] gpus: "0,1" (a string): expected a list', "write a list: [0, 1]"),
    ("", "shard_size", "50", 'shard_size: "50" (a string): expected an integer', "write 50 without quotes"),
    ("workers", "base_port", "30100", '[workers] base_port: "30100" (a string): expected an integer',
     "write 30100 without quotes"),
]


@pytest.mark.sshd
@pytest.mark.parametrize("section,key,value,problem,fix", FIVE_SLIPS, ids=[s[1] for s in FIVE_SLIPS])
def test_the_five_slips_are_refused_over_ssh_before_any_server_launches(sshd, tmp_path, tiny_model_dir, section, key,
                                                                         value, problem, fix):
    from tests.run_helpers import make_config
    from tests.test_faults_fatal import write_config

    run_dir = tmp_path / "run"
    config = write_config(tmp_path, make_config(run_dir, tiny_model_dir, prompts=10, gpus=2))
    text = config.read_text()
    line = f"{key} = {toml_value(value)}"
    if section:
        text = text.replace(f"[{section}]\n", f"[{section}]\n{line}\n", 1)
        text = "\n".join(ln for ln in text.splitlines() if not (ln.startswith(f"{key} = ") and ln != line)) + "\n"
    else:
        text = "\n".join(line if ln.startswith(f"{key} = ") else ln for ln in text.splitlines()) + "\n"
    config.write_text(text)
    ssh = ("--ssh-config", str(sshd.ssh_config_path))
    for command in (["probe", sshd.alias, "--config", str(config), *ssh],
                    ["plan", sshd.alias, "--config", str(config), *ssh],
                    ["start", sshd.alias, "--config", str(config), *ssh]):
        r = regen(*command, home=tmp_path, env={"COLUMNS": "300"})
        both = " ".join((r.stdout + r.stderr).split())
        assert r.returncode != 0, both
        assert problem in both and fix in both, both
        assert "Traceback" not in both
    js = regen("probe", sshd.alias, "--config", str(config), "--json", *ssh, home=tmp_path)
    report = json.loads(js.stdout)
    assert js.returncode == 1 and [p["id"] for p in report["probes"]] == ["config"]
    assert report["probes"][0]["status"] == "FAIL" and any(problem in e["line"] for e in
                                                           report["probes"][0]["data"]["errors"])
    assert not run_dir.exists(), "nothing may start from an invalid config"
    assert not Path(tmp_path / "run" / "workers").exists()


async def test_the_tuis_preflight_shows_the_config_probe_for_a_run_dir_whose_config_fails(tmp_path):
    import sys

    from console.host.transport_local import LocalTransport
    from console.host.source import HostSource

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.toml").write_text(to_toml(doc_with("sampling", "temperature", "0.6")))
    source = HostSource("local", str(run_dir), host_python=sys.executable, transport=LocalTransport())
    try:
        await source.connect()
        report = await source.probes()
    finally:
        await source.close()
    assert [r.id for r in report.results] == ["config"] and report.results[0].status.value == "FAIL"
    assert '[sampling] temperature: "0.6" (a string): expected a number; fix: write 0.6 without quotes' in \
        report.results[0].stdout


def test_range_errors_say_the_whole_range_the_default_and_what_the_key_does():
    with pytest.raises(ConfigError) as exc:
        config_from_dict({**BASE, "runaway": {"max_period": 0}, "notify": {"command": "page-me --now"}})
    lines = exc.value.lines()
    assert "[runaway] max_period: 0: must be an integer in 1..4096 (default 512); the longest token cycle the cycle " \
           "signal looks for" in lines
    assert '[notify] command: "page-me --now" (a string): expected a list [...]; fix: write a list, one item per ' \
           'word (argv, no shell): ["page-me", "--now"]' in lines


def test_a_max_new_tokens_over_the_context_is_a_warning_not_a_refusal(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(to_toml({**BASE, "context_length": 4096}))
    r = regen("config", "check", str(path), home=tmp_path)
    assert r.returncode == 0 and "valid" in r.stdout
    assert "warning: [sampling] max_new_tokens: 32768 is not below context_length = 4096: every answer is capped" \
        in r.stderr


@pytest.mark.parametrize("command", ["probe", "plan", "start"])
def test_probe_plan_and_start_refuse_every_wrong_kind_of_every_key(tmp_path, capsys, command):
    """Every case of the schema, through each command that takes --config: non-zero, the key named, no traceback,
    nothing started (in-process: each refuses before it connects anywhere)."""
    for i, (section, key, value, kind) in enumerate(CASES):
        path = tmp_path / f"run{i}.toml"
        doc = doc_with(section, key, value)
        if (section, key) != ("", "run_dir"):  # the case itself when it is run_dir's
            doc["run_dir"] = str(tmp_path / f"run{i}")
        path.write_text(to_toml(doc))
        code = regen_main([command, "local", "--config", str(path)])
        out = capsys.readouterr()
        shown = out.out + out.err
        assert code != 0 and key_named(section, key) in shown and "Traceback" not in shown, (section, key, kind, shown)
        assert not (tmp_path / f"run{i}").exists(), (section, key, kind)


def test_the_model_dir_probe_reads_the_sampling_keys_the_engine_takes_from_the_model():
    """probes/host/model_dir.py keeps its own copy (probes never import the engine): pinned here."""
    import re

    from engine.config.load import MODEL_SAMPLING_KEYS

    script = (Path(__file__).resolve().parents[1] / "probes" / "host" / "model_dir.py").read_text()
    copied = re.search(r"^SAMPLING_KEYS = \((.*?)\)", script, re.M).group(1)
    assert tuple(k.strip().strip('"') for k in copied.split(",") if k.strip()) == MODEL_SAMPLING_KEYS
