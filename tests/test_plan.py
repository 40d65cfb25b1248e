"""regen plan: shard plan and projection from real prompt files and the tiny tokenizer; the pilot
against real simulator workers (subprocesses on 127.0.0.1) measured against the simulator's formula."""
from __future__ import annotations

import io
import json
import re
import socket
import statistics
import sys
import tempfile
from pathlib import Path

import pytest

from rich.console import Console

from console.cli import main as cli_main
from console.commands.plan import render
from engine.api.reports import Plan
from engine.config.load import SIMULATOR_LAUNCH
import engine.plan.pilot
from engine.plan.pilot import bootstrap_mean_ci
from engine.plan.pilot_window import Completed, Reading, full_batch
from engine.simulator import throughput
from tests.sshd_fixtures import free_port_base
from tests.test_engine_run import supervisors  # noqa: F401  (the fixture: supervisors started here are killed)


@pytest.fixture(autouse=True)
def pilot_logs_in_tmp_path(tmp_path, monkeypatch):
    """The pilot keeps its servers' logs in a temp dir for the operator to read: here, in the test's own tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def many_prompts(tmp_path: Path, n: int) -> Path:
    """`n` one-turn prompts in tmp_path/many.jsonl: enough to keep a pilot's batch full."""
    prompts = tmp_path / "many.jsonl"
    with open(prompts, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"m{i}", "prompt": f"Prompt {i} word word"}) + "\n")
    return prompts


def write_prompts(tmp_path: Path) -> list[Path]:
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    with open(a, "w") as f:
        for i in range(30):  # 30 conversations, the first 10 with two user turns
            msgs = [{"role": "user", "content": f"Question {i}: " + "word " * (i + 1)}]
            if i < 10:
                msgs += [{"role": "assistant", "content": "An answer."}, {"role": "user", "content": "And then?"}]
            f.write(json.dumps({"id": f"a{i}", "messages": msgs}) + "\n")
        f.write("{not json\n")  # one reject
    with open(b, "w") as f:
        for i in range(15):
            f.write(json.dumps({"id": f"b{i}", "prompt": f"Prompt {i} " + "x " * i}) + "\n")
    return [a, b]


def write_config(tmp_path: Path, model: Path, prompts: list[Path], *, gpus=(0,), extra=(), in_flight=None,
                 plan: str = "") -> Path:
    cfg = tmp_path / "run.toml"
    launch = SIMULATOR_LAUNCH.replace("{python}", sys.executable)
    disp = f"max_in_flight_per_worker = {in_flight}\n" if in_flight else ""
    cfg.write_text(f"""
run_dir = {json.dumps(str(tmp_path / 'run'))}
model = {json.dumps(str(model))}
prompts = {json.dumps([str(p) for p in prompts])}
turns = "all"
shard_size = 10
[sampling]
max_new_tokens = 2000
[workers]
gpus = {list(gpus)}
base_port = {free_port_base(len(gpus))}
launch = {json.dumps(launch)}
extra_args = {json.dumps(list(extra))}
ready_timeout_s = 60
[dispatch]
{disp}
{plan}
""")
    return cfg


def test_plan_without_pilot_uses_marked_assumptions(tmp_path, tiny_model_dir, capsys):
    prompts = write_prompts(tmp_path)
    cfg = write_config(tmp_path, tiny_model_dir, prompts,
                       plan="[plan]\noutput_tokens_per_sample = 1000.0\ntokens_per_s_per_gpu = 500.0\n")
    assert cli_main(["plan", "local", "--config", str(cfg), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schema"] == "regen.plan/1"
    sp = d["shard_plan"]
    assert (sp["conversations"], sp["rejects"]) == (45, 1)
    assert sp["samples_by_mode"] == {"all": 55, "last": 45, "first": 45} and sp["samples"] == 55
    assert (sp["shards"], sp["last_shard_conversations"]) == (5, 5)
    assert sp["sources"] == {str(prompts[0]): 30, str(prompts[1]): 15}
    pt = d["prompt_tokens"]
    assert pt["samples_sampled"] == 55 and pt["p50"] <= pt["p90"] <= pt["p99"] <= pt["max"]
    pr = d["projection"]
    assert pr["output_tokens_per_sample"]["basis"] == "assumed"
    assert pr["total_output_tokens"]["value"] == 55 * 1000
    assert pr["wall_hours"]["value"] == pytest.approx(55_000 / 500 / 3600)
    assert pr["gpu_hours"]["value"] == pytest.approx(55_000 / 500 / 3600)
    # the only answers in these files are ten "An answer." turns: answer-like text, measured
    assert pr["bytes_per_token_basis"].startswith("measured") and "assistant answers" in pr["bytes_per_token_basis"]
    assert pr["disk_free_bytes"] > 0 and pr["disk_headroom_bytes"]["value"] < pr["disk_free_bytes"]
    assert d["assumptions"]["used"] is True and d["pilot"] is None
    assert d["brake"]["enabled"] and d["brake"]["min_samples"] == 200
    assert {lv["reason"]: lv["level"] for lv in d["brake"]["levels"]} == {
        "empty": 0.5, "truncated": 0.5, "thinking_missing": 0.5, "repetition": 0.5, "refused": 0.25}
    assert cli_main(["plan", "local", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "assumed" in out and "GPU-hours" in out and "shards" in out
    assert "data-quality brake: dispatch pauses run-wide when, over the last 500 committed samples" in " ".join(
        out.split())
    assert "files the run" in out and "part files per" in out
    cut = d["turns_after_cut"]
    assert (cut["policy"], cut["later_turns"], cut["cut_share"], cut["skipped"]) == ("stop", 10, None, 0.0)
    assert "turns after a cut turn: stop (turns_after_cut): not estimated [no pilot: --pilot N measures" in " ".join(
        out.split())


def _long_answers(tmp_path: Path, *, answers: bool) -> list[Path]:
    """Single-turn prompts that repeat one instruction (they compress well) with, optionally, the dataset's own
    long and varied answers (they do not)."""
    import random
    rng = random.Random(7)
    words = ["alpha", "bravo", "delta", "omega", "sigma", "theta", "lambda", "kappa", "zeta", "gamma", "rho", "tau"]
    path = tmp_path / "long.jsonl"
    with open(path, "w") as f:
        for i in range(60):
            msgs = [{"role": "system", "content": "You are a careful assistant. Answer step by step. " * 4},
                    {"role": "user", "content": f"Task {i}: explain the result."}]
            if answers:
                text = " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(300))
                msgs.append({"role": "assistant", "content": text})
            f.write(json.dumps({"id": f"q{i}", "messages": msgs}) + "\n")
    return [path]


def test_disk_is_projected_from_answer_like_text_not_from_prompts(tmp_path, tiny_model_dir, capsys):
    """Prompts compress far better than answers: bytes per token measured on prompts and applied to the answers
    projected the shards 3-4x too low. The projection prices prompt and output tokens apart, the outputs on the
    prompt files' own answers, and shows its arithmetic."""
    cfg = write_config(tmp_path, tiny_model_dir, _long_answers(tmp_path, answers=True),
                       plan="[plan]\noutput_tokens_per_sample = 1000.0\ntokens_per_s_per_gpu = 500.0\n")
    assert cli_main(["plan", "local", "--config", str(cfg), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    pr, n = d["projection"], d["shard_plan"]["samples"]
    assert "assistant answers" in pr["bytes_per_token_basis"] and pr["disk_bytes"]["basis"].startswith("measured")
    assert pr["bytes_per_output_token"] > 2 * pr["bytes_per_prompt_token"] > 0
    assert pr["disk_bytes"]["value"] == pytest.approx(
        n * (d["prompt_tokens"]["mean"] * pr["bytes_per_prompt_token"] + 1000 * pr["bytes_per_output_token"]))


def test_disk_without_answer_like_text_is_an_assumption_said_so(tmp_path, tiny_model_dir, capsys):
    cfg = write_config(tmp_path, tiny_model_dir, _long_answers(tmp_path, answers=False))
    assert cli_main(["plan", "local", "--config", str(cfg), "--json"]) == 0
    pr = json.loads(capsys.readouterr().out)["projection"]
    assert pr["bytes_per_output_token"] == 5.0
    assert pr["bytes_per_token_basis"].startswith("assumed (outputs)") and "--pilot N measures it" in pr[
        "bytes_per_token_basis"]
    assert pr["disk_bytes"]["basis"].startswith("assumed")  # shown in yellow, as every assumption


@pytest.mark.parametrize("turns, rows_per_part, parts_per_shard", [
    ("all", 1.0, 11),  # multi-turn: a part as soon as a later turn waits on it (0.2 s): 0.1 samples in 0.2 s -> 1 row
    ("last", 2.5, 4),  # 0.5 samples/s x part_max_age_s 5 s = 2.5 rows; 9 samples a shard -> 4 parts
])
def test_plan_shows_the_files_the_run_leaves(tmp_path, tiny_model_dir, capsys, turns, rows_per_part, parts_per_shard):
    cfg = write_config(tmp_path, tiny_model_dir, write_prompts(tmp_path),
                       plan="[plan]\noutput_tokens_per_sample = 1000.0\ntokens_per_s_per_gpu = 500.0\n")
    cfg.write_text(cfg.read_text().replace('turns = "all"', f'turns = "{turns}"'))
    assert cli_main(["plan", "local", "--config", str(cfg), "--json"]) == 0
    files = json.loads(capsys.readouterr().out)["projection"]["files"]
    assert files["shards"] == 5  # after the run: one file per shard
    assert files["rows_per_part"]["value"] == pytest.approx(rows_per_part)
    assert files["parts_per_shard"]["value"] == parts_per_shard
    assert files["basis"].startswith("a part every") and files["basis"].endswith("at the projected rate")


def test_plan_with_unreadable_prompts_exits_2(tmp_path, tiny_model_dir, capsys):
    cfg = write_config(tmp_path, tiny_model_dir, [tmp_path / "missing.jsonl"])
    assert cli_main(["plan", "local", "--config", str(cfg)]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_full_batch_counts_partial_progress_and_not_the_queue():
    # batch 2, each running request makes 100 tokens/s; the third is sent at 0 but waits in the server's queue
    # until the first finishes at 1.0, then runs 2 s
    reqs = [Completed(0.0, 1.0, 100, "stop", []), Completed(0.0, 2.0, 200, "stop", []),
            Completed(0.0, 3.0, 200, "stop", [])]
    readings = [Reading(t / 4, 2 if t < 8 else 1, 1 if t < 4 else 0) for t in range(14)]  # every 0.25 s
    fb = full_batch(reqs, readings, 2)
    # its /metrics window [0, 1.75]: 100 + 175 tokens of the first two, 75 of the third (running since 1.0);
    # spread over the 3 s since it was sent, the third would be credited 117 tokens, 67 of them while queued
    assert (fb.batch, fb.basis) == (2, "metrics") and fb.window_s == pytest.approx(1.75)
    assert fb.tokens_per_s == pytest.approx(200.0)
    client = full_batch(reqs, [], 2)  # no /metrics: the window is where the reconstruction ran 2
    assert (client.batch, client.basis, client.window_s, client.tokens_per_s) == (2, "client", 2.0, 200.0)
    fewer = full_batch(reqs, [Reading(t, 1, 0) for t in range(4)], 8)  # it never ran more than one
    assert fewer.batch == 1
    lo, hi = bootstrap_mean_ci(__import__("numpy").array([1.0, 2.0, 3.0, 4.0]))
    assert 1.0 <= lo <= 2.5 <= hi <= 4.0


def test_pilot_throughput_matches_the_simulator_formula(tmp_path, tiny_model_dir, capsys):
    step_ms, per_req, batch = 4.0, 0.5, 8
    knobs = ["--sim-step-ms", str(step_ms), "--sim-step-ms-per-req", str(per_req), "--sim-prefill-ms-per-1k", "0",
             "--sim-output-mean", "150", "--sim-output-sigma", "0.3", "--max-running-requests", "64",
             "--decode-log-interval", "10"]
    cfg = write_config(tmp_path, tiny_model_dir, write_prompts(tmp_path), gpus=(0, 1), extra=knobs, in_flight=batch)
    assert cli_main(["plan", "local", "--config", str(cfg), "--pilot", "40", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    p = d["pilot"]
    assert p["prompts"] == 40 and len(p["workers"]) == 2
    expected = throughput(batch, step_ms=step_ms, step_ms_per_req=per_req)
    for w in p["workers"]:
        assert (w["in_flight"], w["batch_reached"], w["requests"]) == (batch, batch, 20), w
        assert (w["batch"], w["batch_source"], w["window_basis"]) == (64, "internal_states", "metrics"), w
        # the simulator sleeps each step's time, so a loaded box makes it slower than the formula, never faster; what
        # the pilot must get right is the speed the server really ran at its full batch, which the server logs itself
        logged = _logged_throughput_at(Path(p["log_dir"]) / "workers" / w["name"] / "server.log", batch)
        assert w["tokens_per_s"] == pytest.approx(logged, rel=0.15), (w, logged)
        assert w["tokens_per_s"] <= expected * 1.10, (w, expected)
    assert d["projection"]["tokens_per_s_per_worker"]["basis"].startswith("pilot")
    assert "pilot outputs" in d["projection"]["bytes_per_token_basis"]  # the model's own answers price the disk
    assert d["assumptions"]["used"] is False
    assert not (tmp_path / "run" / "shards").exists()  # pilot outputs are not written into the run
    print(json.dumps({"expected": expected, "measured": [w["tokens_per_s"] for w in p["workers"]]}), file=sys.stderr)


def _logged_throughput_at(log: Path, running: int) -> float:
    """The median `gen throughput` of a server's decode log lines taken while it ran `running` requests."""
    found = [float(m.group(1)) for m in
             re.finditer(rf"#running-req: {running},.*?gen throughput \(token/s\): ([0-9.]+)", log.read_text())]
    assert found, f"no decode line at {running} running in {log}"
    return statistics.median(found)


@pytest.mark.sshd
def test_plan_over_real_ssh_runs_the_engine_on_the_host(tmp_path, tiny_model_dir, sshd, capsys, monkeypatch):
    import uuid

    made = []  # the name of the config copied to the host (/tmp/regen-plan-<uuid>.toml): other tests' may coexist
    monkeypatch.setattr(uuid, "uuid4", lambda real=uuid.uuid4: made.append(real()) or made[-1])
    cfg = write_config(tmp_path, tiny_model_dir, write_prompts(tmp_path))
    cfg.write_text(f"host_python = {json.dumps(sys.executable)}\n" + cfg.read_text())
    code = cli_main(["plan", sshd.alias, "--config", str(cfg), "--json", "--ssh-config", str(sshd.ssh_config_path)])
    out = capsys.readouterr()
    assert code == 0, out.err
    d = json.loads(out.out)
    assert d["shard_plan"]["samples"] == 55 and d["projection"]["output_tokens_per_sample"]["basis"] == "assumed"
    copied = [Path(f"/tmp/regen-plan-{u.hex[:12]}.toml") for u in made]
    assert copied and not any(p.exists() for p in copied), copied  # the copied config is removed on the host
    assert d["config"] == str(cfg)


@pytest.mark.sshd
def test_plan_header_over_ssh_names_the_operators_config(tmp_path, tiny_model_dir, sshd, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # the header on one line
    cfg = write_config(tmp_path, tiny_model_dir, write_prompts(tmp_path))
    cfg.write_text(f"host_python = {json.dumps(sys.executable)}\n" + cfg.read_text())
    code = cli_main(["plan", sshd.alias, "--config", str(cfg), "--ssh-config", str(sshd.ssh_config_path)])
    out = capsys.readouterr()
    assert code == 0, out.err
    header = out.out.splitlines()[0]
    assert header.startswith(f"regen plan  {cfg}  run dir ") and "regen-plan-" not in out.out


def test_pilot_refuses_a_port_another_process_holds(tmp_path, tiny_model_dir, capsys):
    import os
    import tomllib

    cfg = write_config(tmp_path, tiny_model_dir, write_prompts(tmp_path))
    port = tomllib.loads(cfg.read_text())["workers"]["base_port"]
    with socket.socket() as holder:  # measuring someone else's server would give a wrong figure
        holder.bind(("127.0.0.1", port))
        holder.listen(1)
        assert cli_main(["plan", "local", "--config", str(cfg), "--pilot", "10"]) != 0
    err = capsys.readouterr().err
    assert f"pilot: port {port} on 127.0.0.1 is already in use by pid {os.getpid()} (" in err
    assert "stop that process, or set workers.base_port in run.toml to a free range" in err


def test_pilot_server_that_exits_ends_the_pilot_with_its_log(tmp_path, tiny_model_dir, capsys):
    # the pilot launches through engine/servers/workers.py's Worker: a crash is reported with the server's own words,
    # never restarted into a figure
    cfg = write_config(tmp_path, tiny_model_dir, write_prompts(tmp_path), extra=["--sim-step-ms", "not-a-number"])
    assert cli_main(["plan", "local", "--config", str(cfg), "--pilot", "10"]) != 0
    err = capsys.readouterr().err
    assert "pilot: worker gpu0 (http://127.0.0.1:" in err and ") crashed: exit code 2" in err, err
    assert "/workers/gpu0/server.log):" in err and "not-a-number" in err, err


def run_tokens_per_s(run_dir: Path, batch: int) -> dict[str, float]:
    """Per worker, the mean of its server's own sglang:gen_throughput over the telemetry readings taken while it
    held its full batch, running or queued to join (the run's steady state; the gauge counts a slot freed at
    that step as not running)."""
    readings: dict[str, list[float]] = {}
    for line in (run_dir / "telemetry.jsonl").read_text().splitlines():
        e = json.loads(line)
        if (e["type"] == "worker" and e.get("gen_throughput")
                and (e.get("running_reqs") or 0) + (e.get("queued_reqs") or 0) >= batch):
            readings.setdefault(e["name"], []).append(e["gen_throughput"])
    return {name: sum(v) / len(v) for name, v in readings.items() if len(v) >= 2}


def test_pilot_projects_the_run_that_follows_within_15_percent(tmp_path, tiny_model_dir, supervisors, capsys):
    # 0.5.5 reports no batch size in /get_server_info: the pilot finds 32 in the start-up log line, as the run does
    from console.commands.demo import write_prompts as demo_prompts
    from engine.config.load import load_config

    batch = 32
    sim = ["--sim-sglang-version", "0.5.5", "--sim-max-num-reqs", str(batch), "--sim-step-ms", "10",
           "--sim-step-ms-per-req", "0.2", "--sim-output-mean", "100", "--sim-output-sigma", "0.5"]
    prompts = [Path(p) for p in demo_prompts(tmp_path / "prompts", 300, 0)]
    cfg_path = write_config(tmp_path, tiny_model_dir, prompts, gpus=(0, 1), extra=sim)
    assert cli_main(["plan", "local", "--config", str(cfg_path), "--pilot", "20", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    p = d["pilot"]
    in_flight = batch + 8  # the dispatcher's margin: a quarter of the batch
    assert (p["requested"], p["needed"], p["prompts"]) == (20, 2 * 2 * in_flight, 2 * 2 * in_flight)
    assert any(n.startswith(f"pilot: 20 prompts cannot fill the servers' batches; raised to {2 * 2 * in_flight} ")
               and f"gpu0 {batch} (log) + 8 queued" in n for n in d["notes"]), d["notes"]
    for w in p["workers"]:
        assert (w["batch"], w["batch_source"], w["in_flight"], w["batch_reached"]) == (batch, "log", in_flight, batch)
    projected = d["projection"]["tokens_per_s_per_worker"]["value"]
    shown = io.StringIO()
    render(Plan.from_dict(d), Console(file=shown, width=250, highlight=False))
    text = shown.getvalue()
    assert f"pilot: {2 * 2 * in_flight} prompts (20 asked, {2 * 2 * in_flight} fill the batches)" in text, text
    assert f"note: pilot: 20 prompts cannot fill the servers' batches; raised to {2 * 2 * in_flight}" in text, text
    assert f"{batch} (log) │        {in_flight} │            {batch} │" in text, text

    cfg = load_config(cfg_path)
    run_dir = Path(cfg.run_dir)
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(120) == 0, sup.log_text()[-3000:]
    measured = run_tokens_per_s(run_dir, batch)
    assert set(measured) == {"gpu0", "gpu1"}, measured
    figures = {"projected": projected, "pilot": {w["name"]: w["tokens_per_s"] for w in p["workers"]},
               "run": measured}
    print(json.dumps(figures), file=sys.stderr)
    for name, rate in measured.items():
        assert projected == pytest.approx(rate, rel=0.15), figures


def test_pilot_with_fewer_prompts_than_the_batch_sends_them_all_and_says_the_batch_it_reached(tmp_path, tiny_model_dir,
                                                                                              capsys):
    # 55 samples in the files, 10 conversations tokenized for the plan: the pilot reads the files again for the
    # 2 x (64 + 8) it needs, sends all 55, and says the server ran 55 at once, not its 64
    knobs = ["--max-running-requests", "64", "--sim-step-ms", "4", "--sim-output-mean", "60", "--sim-output-sigma",
             "0.3"]
    cfg = write_config(tmp_path, tiny_model_dir, write_prompts(tmp_path), extra=knobs)
    assert cli_main(["plan", "local", "--config", str(cfg), "--pilot", "10", "--sample", "10", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    p = d["pilot"]
    assert (p["requested"], p["needed"], p["prompts"]) == (10, 160, 55)
    (w,) = p["workers"]
    assert (w["batch"], w["in_flight"], w["batch_reached"], w["requests"]) == (64, 80, 55, 55), w
    assert w["tokens_per_s"] > 0
    notes = d["notes"]
    assert any(n.startswith("pilot: 10 prompts cannot fill the servers' batches; raised to 160 (2 x the requests "
                            "kept in flight per worker: gpu0 64 (internal_states) + 16 queued)") for n in notes), notes
    assert "pilot: the prompt files hold 55 samples, fewer than the 160 asked; all of them were sent" in notes
    assert ("pilot: gpu0 ran at most 55 requests at once, below its batch of 64; its throughput is measured at 55"
            in notes), notes


def test_plan_says_what_the_runaway_guard_is_expected_to_save_as_an_estimate(tmp_path, tiny_model_dir, capsys):
    cfg = write_config(tmp_path, tiny_model_dir, write_prompts(tmp_path),
                       plan="[plan]\noutput_tokens_per_sample = 1000.0\ntokens_per_s_per_gpu = 500.0\n"
                            "[runaway]\nstream_interval = 256\n")
    assert cli_main(["plan", "local", "--config", str(cfg), "--json"]) == 0
    g = json.loads(capsys.readouterr().out)["runaway"]
    assert g["enabled"] and g["basis"].startswith("assumed: an estimate, plan.loop_share = 2.0%")
    # 2% of answers at max_new_tokens 2000 instead of ~1,590 tokens (half a normal answer, the span, a chunk)
    stop_at = 500 + 1024 + 256
    assert g["tokens_saved_share"] == pytest.approx(0.02 * (2000 - stop_at) / (0.98 * 1000 + 0.02 * 2000))
    assert cli_main(["plan", "local", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "runaway guard: on" in out and "expected to save" in out and "an estimate" in out


def test_pilot_answers_stream_through_the_guard_and_its_loops_are_stopped(tmp_path, tiny_model_dir, capsys):
    knobs = ["--sim-step-ms", "2", "--sim-step-ms-per-req", "0", "--sim-tokens-per-step", "16",
             "--sim-output-mean", "150", "--sim-loop-share", "0.3", "--sim-seed", "3"]
    # chunks of 256 tokens: answers of at most 2,000 tokens give the guard several looks at each loop
    cfg = write_config(tmp_path, tiny_model_dir, write_prompts(tmp_path), extra=knobs, in_flight=8,
                       plan="[runaway]\nstream_interval = 256\n")
    assert cli_main(["plan", "local", "--config", str(cfg), "--pilot", "30", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    g = d["runaway"]
    assert g["basis"].startswith("pilot: its 30 answers streamed through the guard")
    # the pilot stopped the simulated loops itself (aborted by rid), as the run does
    stopped = d["pilot"]["finish_reasons"].get("repetition", 0)
    assert g["answers"] == 30 and g["would_stop"] == stopped >= 3, g
    assert 0.2 < g["tokens_saved_share"] < 0.99
    saved_share = g["tokens_saved_share"] / (1 - g["tokens_saved_share"])  # on top of the guarded projection
    assert g["gpu_hours_saved"]["value"] == pytest.approx(d["projection"]["gpu_hours"]["value"] * saved_share)
    # turns_after_cut = stop: each of the 10 second turns is skipped when its first turn is cut (share p: the
    # answers that ended at max_new_tokens or were stopped as runaways)
    cut = d["turns_after_cut"]
    p = (d["pilot"]["finish_reasons"].get("length", 0) + d["pilot"]["finish_reasons"].get("repetition", 0)) / 30
    assert cut["cut_share"] == pytest.approx(p) and p > 0
    assert cut["skipped"] == pytest.approx(10 * p) and cut["skipped_share"] == pytest.approx(10 * p / 55)
    assert cut["gpu_hours_saved"]["value"] == pytest.approx(d["projection"]["gpu_hours"]["value"] * 10 * p / 55)
    assert cli_main(["plan", "local", "--config", str(cfg), "--pilot", "30"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"turns after a cut turn: stop (turns_after_cut): saves ~{10 * p:,.0f} later turns" in text
    # where the pilot's server logs stay, as --json's pilot.log_dir says
    logs = re.search(r"pilot server logs \(on the host, kept for reading\): (\S+)", text).group(1)
    assert (Path(logs) / "workers" / "gpu0" / "server.log").is_file(), logs


def test_pilot_keeps_more_than_a_hundred_requests_in_flight_when_the_batch_is_larger(tmp_path, tiny_model_dir, capsys):
    # aiohttp's default connection limit (100 in all) once capped the pilot's session: a server with a batch of 120
    # ran at most 100, never queued, and the tuning rule read "nothing waited on admission"
    prompts = many_prompts(tmp_path, 300)
    knobs = ["--max-running-requests", "120", "--sim-step-ms", "4", "--sim-output-mean", "60", "--sim-output-sigma",
             "0.3"]
    cfg = write_config(tmp_path, tiny_model_dir, [prompts], extra=knobs)
    assert cli_main(["plan", "local", "--config", str(cfg), "--pilot", "300", "--sample", "10", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    (w,) = d["pilot"]["workers"]
    assert (w["batch"], w["in_flight"], w["batch_reached"]) == (120, 150, 120), w
    assert not any("ran at most" in n for n in d["notes"]), d["notes"]


def test_pilot_sends_again_a_request_whose_connection_closed_unanswered(tmp_path, tiny_model_dir, capsys):
    # a flooded server's accept queue resets connections ("Server disconnected", "Can not write request body"); the
    # pilot once failed on the first one
    # a batch of 8 held for several waves of ~0.6 s answers: a window to measure on a loaded box (with 40-odd prompts
    # at once and 2 ms steps no window was saturated)
    prompts = many_prompts(tmp_path, 120)
    knobs = ["--sim-step-ms", "10", "--sim-output-mean", "60", "--max-running-requests", "8", "--sim-drop-first", "3"]
    cfg = write_config(tmp_path, tiny_model_dir, [prompts], extra=knobs)
    assert cli_main(["plan", "local", "--config", str(cfg), "--pilot", "120", "--sample", "10", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["pilot"]["prompts"] >= 20
    (note,) = [n for n in d["notes"] if "sent again" in n]
    assert note.startswith("pilot: 3 requests were sent again after a connection error without an answer ([dispatch] "
                           "max_retries 5; the last: ServerDisconnectedError"), note


def test_pilot_reads_metrics_while_its_requests_hold_every_connection(tmp_path, tiny_model_dir, capsys, monkeypatch):
    # the /metrics readings once shared the requests' connections (CONNECTIONS_PER_SERVER a server): with every one
    # held by a request a reading waited for one to end, and a pilot on a large pool read 2 /metrics in 46 s
    monkeypatch.setattr(engine.plan.pilot, "CONNECTIONS_PER_SERVER", 10)
    prompts = many_prompts(tmp_path, 300)
    knobs = ["--max-running-requests", "120", "--sim-step-ms", "20", "--sim-output-mean", "40", "--sim-output-sigma",
             "0.3"]
    cfg = write_config(tmp_path, tiny_model_dir, [prompts], extra=knobs)
    assert cli_main(["plan", "local", "--config", str(cfg), "--pilot", "300", "--sample", "10", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert not any("could not be read" in n for n in d["notes"]), d["notes"]
    (evidence,) = d["tuning"]["evidence"]
    assert evidence["readings"] >= 8, evidence  # the rule's least; one every 0.25 s over the pilot
