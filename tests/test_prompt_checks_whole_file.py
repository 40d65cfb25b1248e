"""Prompt files are checked to their last row, before any server starts.

`regen probe` used to read the first 1000 rows of each file: six invalid rows and an 18,014-token prompt (context
8,192) at the files' ends passed `prompts.format` and `prompts.tokens`, and `regen plan` printed the 18,014 max
without a word about the context. Now both probes read every row (and say how many of how many), `prompts.tokens`
renders a pick spread over the whole file plus each file's ends plus the longest prompts by characters, and
`regen plan` warns (a WARN line; `warnings` and `context` in --json) about prompts over SGLang's input limit.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from console.cli import main as cli_main
from engine.config.schema import SIMULATOR_LAUNCH
from probes.context import PROMPT_INPUT_MARGIN, prompt_input_limit
from probes.model import Status
from tests.test_probes_config import add_weights
from tests.test_probes_fakes import config_context, run_local, sharegpt

GOOD = 3000
LONG = "lorem ipsum dolor sit amet, consectetur adipiscing elit " * 2500  # ~20K tokens with the tiny tokenizer
BAD = [b'{"conversations": [{"from": "human", "value": "hi"}',  # malformed JSON
       json.dumps({"text": "no conversation"}).encode(),
       json.dumps({"messages": []}).encode(),
       json.dumps({"messages": [{"role": "narrator", "content": "x"}]}).encode(),
       json.dumps({"messages": [{"role": "assistant", "content": "a"}]}).encode(),
       b'{"messages": [{"role": "user", "content": "caf\xe9"}]}']  # invalid UTF-8


def bad_tail_file(path: Path) -> Path:
    """GOOD short conversations, then six invalid rows and one over-long prompt: the file's last seven lines."""
    lines = [json.dumps(sharegpt(i)).encode() for i in range(GOOD)] + BAD
    lines.append(json.dumps({"id": "long-1", "messages": [{"role": "user", "content": LONG}]}).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def with_context(model_dir: Path, context: int) -> Path:
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = context
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def test_the_margin_is_the_engines():
    from engine.run.prompt_limit import INPUT_MARGIN, from_context

    assert PROMPT_INPUT_MARGIN == INPUT_MARGIN
    assert prompt_input_limit(8192) == from_context(8192, "x").max_input_len == 8186


def test_bad_rows_and_an_over_long_prompt_at_the_files_end_are_found(model_copy, tmp_path):
    add_weights(with_context(model_copy, 8192))
    path = bad_tail_file(tmp_path / "p.jsonl")
    res = run_local(config_context(tmp_path, model_copy, [str(path)], max_new_tokens=1024, sample_rows=200),
                    {"prompts.format", "prompts.tokens"})

    fmt = res["prompts.format"]
    assert fmt.status is Status.WARN, fmt.summary
    assert fmt.data["read"] == fmt.data["rows"] == GOOD + 7 and fmt.data["complete"]
    assert fmt.data["malformed_count"] == 6
    assert {m["where"] for m in fmt.data["malformed"]} == {f"{path}:{GOOD + i}" for i in range(1, 7)}
    assert fmt.summary.startswith(f"6 malformed row(s) of the {GOOD + 7:,} read, e.g. {path}:{GOOD + 1}: malformed JSON")
    assert fmt.actual.startswith(f"read {GOOD + 7:,} of {GOOD + 7:,} rows (every row) in ")

    tok = res["prompts.tokens"]
    assert tok.status is Status.WARN, tok.summary
    assert tok.data["over_context"] == 1 and tok.data["input_limit"] == 8186
    (over,) = tok.data["over_examples"]
    assert over["where"] == f"{path}:{GOOD + 7}" and over["tokens"] > 8192
    assert tok.data["max"] == over["tokens"]
    assert (f"1 prompt(s) over SGLang's input limit of 8,186 tokens (context 8,192), found among "
            f"{tok.data['checked']:,} rendered of {GOOD + 7:,} rows read") in tok.summary
    assert f"{path}:{GOOD + 7} ({over['tokens']:,} tokens)" in tok.summary
    assert "filter those rows out of the prompt files" in tok.remedy
    assert f"read {GOOD + 7:,} of {GOOD + 7:,} rows (every row)" in tok.actual


def test_an_over_long_prompt_in_the_middle_is_found_by_its_length_not_by_luck(model_copy, tmp_path):
    """No file ends and a tiny spread: the longest-by-characters pick is what finds it."""
    add_weights(with_context(model_copy, 8192))
    rows = [sharegpt(i) for i in range(2000)]
    rows.insert(1234, {"id": "long-mid", "messages": [{"role": "user", "content": LONG}]})
    path = tmp_path / "mid.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ctx = config_context(tmp_path, model_copy, [str(path)], max_new_tokens=512, sample_rows=10, end_rows=0,
                         longest_rows=3)
    tok = run_local(ctx, {"prompts.tokens"})["prompts.tokens"]
    assert tok.status is Status.WARN, tok.summary
    assert tok.data["over_context"] == 1 and tok.data["over_examples"][0]["where"] == f"{path}:1235"
    assert tok.data["checked"] <= 10 + 3 and tok.data["read"] == 2001
    assert "10 rows spread evenly over all 2001 good rows of the 2001 read (about every 200th)" in tok.data["how"]
    assert "the 3 longest prompts by characters" in tok.data["how"]


def test_a_scan_past_its_budget_says_how_far_it_read_and_is_not_a_pass(tiny_model_dir, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(sharegpt(i)) + "\n" for i in range(5000)))
    r = run_local(config_context(tmp_path, tiny_model_dir, [str(path)], scan_budget_s=0.0),
                  {"prompts.format"})["prompts.format"]
    assert r.status is Status.WARN, r.summary
    assert r.data["complete"] is False and r.data["read"] < 5000
    assert r.summary.startswith("not every row was checked: read 0 of ~0 rows and 1 file(s) of unknown rows")
    assert "(stopped: time budget of 0 s)" in r.summary and "`regen plan` reads every row" in r.remedy


def plan_config(tmp_path: Path, model: Path, prompts: Path, context: int) -> Path:
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"""
run_dir = {json.dumps(str(tmp_path / 'run'))}
model = {json.dumps(str(model))}
prompts = [{json.dumps(str(prompts))}]
context_length = {context}
[sampling]
max_new_tokens = 2000
[workers]
launch = {json.dumps(SIMULATOR_LAUNCH.replace("{python}", sys.executable))}
""")
    return cfg


def test_plan_without_pilot_warns_about_prompts_over_the_context(tiny_model_dir, tmp_path, capsys):
    path = bad_tail_file(tmp_path / "p.jsonl")
    cfg = plan_config(tmp_path, tiny_model_dir, path, 8192)
    assert cli_main(["plan", "local", "--config", str(cfg), "--json", "--sample", "50"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["shard_plan"]["conversations"] == GOOD + 1 and d["shard_plan"]["rejects"] == 6
    c = d["context"]
    assert (c["context_length"], c["input_limit"], c["rows_read"]) == (8192, 8186, GOOD + 1)
    assert c["over_limit"] == 1 and c["over_examples"][0]["where"] == f"{path}:{GOOD + 7}"
    assert c["over_examples"][0]["sample_id"].endswith("#turn0") and c["over_examples"][0]["tokens"] > 8192
    assert d["prompt_tokens"]["max"] == c["longest"] == c["over_examples"][0]["tokens"]
    (warning,) = [w for w in d["warnings"] if "input limit" in w]
    assert warning.startswith("1 prompt(s) at or over SGLang's input limit of 8,186 tokens (context_length 8,192 "
                              "from run.toml context_length, minus 6): those turns are rejected, not generated")
    assert f"{path}:{GOOD + 7}" in warning and "longest by prompt characters of all 3,001 read" in warning

    assert cli_main(["plan", "local", "--config", str(cfg), "--sample", "50"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "WARN 1 prompt(s) at or over SGLang's input limit of 8,186 tokens" in out
    assert "context 8,192 (run.toml context_length): prompts of 8,186 tokens or more are refused" in out


def test_plan_warns_when_prompts_leave_less_room_than_max_new_tokens(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(sharegpt(i)) + "\n" for i in range(20)))
    cfg = plan_config(tmp_path, tiny_model_dir, path, 2010)  # 2010 - 2000 max_new_tokens: ~10 tokens of room
    assert cli_main(["plan", "local", "--config", str(cfg), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["context"]["over_limit"] == 0 and d["context"]["capped"] == 20
    (warning,) = d["warnings"]
    assert warning.startswith("20 of 20 rendered prompts leave less than max_new_tokens 2,000 for the answer")

    roomy = plan_config(tmp_path, tiny_model_dir, path, 40960)
    assert cli_main(["plan", "local", "--config", str(roomy), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["warnings"] == [] and d["context"]["over_limit"] == d["context"]["capped"] == 0


def test_a_probe_timeout_cuts_the_scan_budget_so_the_scan_can_say_how_far_it_read(tiny_model_dir, tmp_path):
    from tests.test_cli_run import regen

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(sharegpt(i)) + "\n" for i in range(10)))
    cfg = plan_config(tmp_path, tiny_model_dir, path, 8192)
    cfg.write_text(cfg.read_text().replace("context_length", f"host_python = {json.dumps(sys.executable)}\n"
                                                             "context_length"))
    r = regen("probe", "local", "--config", str(cfg), "--only", "prompts.format", "--timeout", "20", "--json",
              home=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    fmt = next(p for p in json.loads(r.stdout)["probes"] if p["id"] == "prompts.format")
    assert fmt["status"] == "PASS" and '"budget_s": 12.0' in fmt["command"]
    assert fmt["summary"].startswith("read 10 of 10 rows (every row) in 1 file(s)")
