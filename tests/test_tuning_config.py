"""[workers] schedule_conservativeness / conservativeness_min / _max: checked with the key and the fix, launched as the
servers' --schedule-conservativeness (the operator's own flag never overridden), started from the run dir's record."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.api.tuning import AnswerTail, TuningChoice, TuningSource, TuningVerdict
from engine.config.load import ConfigError, RunConfig, Workers, load_config
from engine.servers.launch import launch_argv, launch_env, worker_specs
from engine.servers.metrics_client import ServerMetrics
from console.view.tuning_text import plan_lines
from engine.servers.tuning import RunTuning, pilot_choice, planned_choice, record_pilot
from engine.servers.tuning_rule import answer_tail, clip_tails
from engine.servers.tuning_record import RECORD_FILE, TuningRecord, config_key, write_record


def config_text(tmp_path: Path, workers: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(f'run_dir = "{tmp_path / "run"}"\nmodel = "/m"\nprompts = ["/p.jsonl"]\n[workers]\n{workers}\n')
    return path


def cfg_of(tmp_path: Path, **workers) -> RunConfig:
    return RunConfig(run_dir=str(tmp_path / "run"), model="/m", prompts=("/p.jsonl",), workers=Workers(**workers))


def test_auto_is_the_default_within_the_guides_bounds(tmp_path):
    w = load_config(config_text(tmp_path, "")).workers
    assert (w.schedule_conservativeness, w.conservativeness_min, w.conservativeness_max) == ("auto", 0.3, 1.3)
    assert load_config(config_text(tmp_path, "schedule_conservativeness = 0.5")).workers.schedule_conservativeness == 0.5


@pytest.mark.parametrize("line, said", [
    ('schedule_conservativeness = "low"', '[workers] schedule_conservativeness: "low": must be "auto" or a number >= 0, '
                                          'e.g. 0.3 (default "auto")'),
    ("schedule_conservativeness = -1", '[workers] schedule_conservativeness: -1: must be "auto" or a number >= 0'),
    ("conservativeness_min = 2.0", "[workers] conservativeness_min: 2 is above conservativeness_max = 1.3: set it at "
                                   "or below"),
    ('schedule_conservativeness = 0.5\nextra_args = ["--schedule-conservativeness", "0.4"]',
     "[workers] schedule_conservativeness: 0.5 and --schedule-conservativeness 0.4 in launch / extra_args both set it: "
     "keep one"),
])
def test_a_wrong_value_is_refused_naming_the_key(tmp_path, line, said):
    with pytest.raises(ConfigError) as err:
        load_config(config_text(tmp_path, line))
    assert said in str(err.value)


def launched(cfg: RunConfig, run_dir: Path | None = None) -> tuple[list[str], dict[str, str]]:
    tuner = RunTuning(cfg, run_dir).for_server("gpu0")
    spec = worker_specs(cfg)[0]
    argv = launch_argv(cfg, spec, "/py", conservativeness=tuner.flag_value(), mixed_chunk=tuner.mixed_chunk)
    return argv, launch_env(cfg, spec, Path(cfg.run_dir), tuner.env())


def test_the_servers_get_the_flag_and_the_operators_own_is_never_overridden(tmp_path):
    argv, env = launched(cfg_of(tmp_path))
    assert argv[-2:] == ["--schedule-conservativeness", "1"] and "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION" not in env
    argv, _ = launched(cfg_of(tmp_path, schedule_conservativeness=0.45))
    assert argv[-2:] == ["--schedule-conservativeness", "0.45"]
    argv, _ = launched(cfg_of(tmp_path, extra_args=("--schedule-conservativeness=0.7",)))
    assert [a for a in argv if "conservativeness" in a] == ["--schedule-conservativeness=0.7"]
    tuning = RunTuning(cfg_of(tmp_path, extra_args=("--schedule-conservativeness", "0.7")), None)
    assert (tuning.start.value, tuning.start.source) == (0.7, TuningSource.OPERATOR_FLAG)
    assert "the operator's, not tuned" in tuning.start.reason


def pilot_record(cfg: RunConfig, value: float, clip: int | None = None, key: str | None = None,
                 tail: AnswerTail | None = None) -> None:
    choice = TuningChoice(value=value, measured_at_value=1.0, source=TuningSource.PILOT, verdict=TuningVerdict.LOWER,
                          reason="token usage 0.20 (< 0.9) ...; lowered from 1 to 0.3", low=0.3, high=1.3, clip=clip,
                          clip_reason="answers' p99 ...", config_key=key or config_key(cfg), answer_tail=tail)
    write_record(Path(cfg.run_dir) / RECORD_FILE, TuningRecord(config_key=key or config_key(cfg), pilot=choice))


def test_the_run_starts_from_the_pilots_choice_recorded_in_the_run_dir(tmp_path):
    cfg = cfg_of(tmp_path)
    pilot_record(cfg, 0.3, clip=1536)
    argv, env = launched(cfg, Path(cfg.run_dir))
    assert argv[-2:] == ["--schedule-conservativeness", "0.3"]
    assert env["SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION"] == "1536"
    alert = RunTuning(cfg, Path(cfg.run_dir)).start_alert()
    assert alert.severity == "info" and alert.text == ("servers start with --schedule-conservativeness 0.3 (pilot); a "
                                                       "server's restart changes it within [0.3, 1.3] as its /metrics "
                                                       "say")
    # the operator's clip env wins over the pilot's
    _, env = launched(cfg_of(tmp_path, env={"SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "8192"}), Path(cfg.run_dir))
    assert env["SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION"] == "8192"


def test_a_record_measured_on_another_config_is_not_used_and_said(tmp_path):
    cfg = cfg_of(tmp_path)
    pilot_record(cfg, 0.3, key="0123456789abcdef")
    tuning = RunTuning(cfg, Path(cfg.run_dir))
    assert (tuning.start.value, tuning.start.source) == (1.0, TuningSource.SGLANG_DEFAULT)
    alert = tuning.start_alert()
    assert alert.text.startswith("servers start with --schedule-conservativeness 1 (SGLang default): no pilot choice")
    assert "was measured on another config (model, launch, prompts or max_new_tokens changed since): not used" in \
        alert.evidence
    (Path(cfg.run_dir) / RECORD_FILE).write_text("{not json")
    assert "is not a tuning record" in RunTuning(cfg, Path(cfg.run_dir)).notes[0]


def test_without_a_pilot_the_run_starts_at_sglangs_default_and_says_it_may_lower_it(tmp_path):
    alert = RunTuning(cfg_of(tmp_path), tmp_path / "run").start_alert()
    assert alert.severity == "info"
    assert alert.text == ("servers start with --schedule-conservativeness 1 (SGLang default): no pilot choice in the "
                          "run dir (`regen plan --pilot N` measures one); a server's restart lowers it toward 0.3 when "
                          "its /metrics show token usage < 0.9 while requests queue, and raises it toward 1.3 when it "
                          "retracts more than once a minute")


def feed(tuner, *, usage: float, queued: float, retracted: float | None, seconds: int) -> None:
    for t in range(seconds):
        tuner.observe(ServerMetrics(running_reqs=10, queued_reqs=queued, token_usage=usage,
                                    retracted=None if retracted is None else retracted * t / (seconds - 1)), 1000.0 + t)


def test_a_restart_lowers_an_admission_limited_server_and_records_it(tmp_path):
    cfg = cfg_of(tmp_path)
    run_dir = Path(cfg.run_dir)
    tuner = RunTuning(cfg, run_dir).for_server("gpu0")
    feed(tuner, usage=0.4, queued=5, retracted=0, seconds=60)
    change = tuner.at_restart()
    assert change is not None and change.severity == "info"
    assert change.text == ("worker gpu0 restarts with --schedule-conservativeness 0.3 (was 1): token usage 0.40 (< 0.9) "
                           "in 60 of 60 readings with requests queued (mean #queue-req 5), 0 retractions (0.0 a minute): "
                           "admission holds requests back")
    assert tuner.at_restart() is None  # each launch is judged once
    saved = json.loads((run_dir / RECORD_FILE).read_text())["servers"]
    assert [(s["name"], s["value"], s["source"]) for s in saved] == [("gpu0", 0.3, "restart")]
    # the next start of the run starts gpu0 where its restart left it
    again = RunTuning(cfg, run_dir).for_server("gpu0")
    assert (again.value, again.source, again.flag_value()) == (0.3, TuningSource.RESTART, 0.3)
    # a value the operator fixed is never changed
    fixed = RunTuning(cfg_of(tmp_path, schedule_conservativeness=1.0), None).for_server("gpu0")
    feed(fixed, usage=0.4, queued=5, retracted=30, seconds=60)
    assert fixed.at_restart() is None and fixed.value == 1.0


def test_the_pilots_answer_tail_is_recorded_and_a_restart_lowers_no_further_than_it(tmp_path):
    # 190 tokens past the clip 4,096 per answer: the lowest value whose settled reservation covers them is
    # 190 / (0.7 x 0.14 x 4,096) = 0.473 -> 0.5 (engine/servers/tuning_rule.py tail_value)
    cfg = cfg_of(tmp_path)
    tail = AnswerTail(clip=4096, answers=2000, p99=9300.0, past_clip=132, past_clip_mean=190.0)
    run = RunTuning(cfg, None, pilot=True)
    assert run.clip_in_force == 4096
    tuner = run.for_server("gpu0")
    feed(tuner, usage=0.4, queued=5, retracted=0, seconds=60)
    evidence = tuner.window.evidence()
    choice = pilot_choice(run, [evidence], 32768, tail)
    assert (choice.value, choice.verdict, choice.clip) == (0.5, TuningVerdict.LOWER, None)
    assert "lowered only to 0.5 (from 1), not to 0.3" in choice.reason
    pilot_record(cfg, 0.5, tail=tail)
    restarted = RunTuning(cfg, Path(cfg.run_dir)).for_server("gpu0")
    assert restarted.run.record.pilot.answer_tail == tail  # read back from the run dir's tuning.json
    feed(restarted, usage=0.4, queued=5, retracted=0, seconds=60)
    assert restarted.at_restart() is None and restarted.value == 0.5  # kept: not on to 0.3
    assert RunTuning(cfg_of(tmp_path, env={"SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "8192"}), None).clip_in_force == 8192


def test_the_pilot_lowers_the_clip_to_the_lowest_its_answers_allow_and_the_servers_launch_with_it(tmp_path):
    # bench_spread-like answers (engine/servers/tuning_rule.py choose_clip; the figures in test_tuning_rule.py): at
    # 0.3, 768 is the lowest clip whose tail the settled ratio covers
    cfg = cfg_of(tmp_path)
    lengths = [300] * 90 + [700] * 6 + [900] * 4
    run = RunTuning(cfg, None, pilot=True)
    tuner = run.for_server("gpu0")
    feed(tuner, usage=0.4, queued=5, retracted=0, seconds=60)
    choice = pilot_choice(run, [tuner.window.evidence()], 2048, answer_tail(lengths, 4096), clip_tails(lengths, 4096))
    assert (choice.value, choice.clip) == (0.3, 768)
    assert choice.clip_reason.endswith("clip set to 768, the lowest multiple of 256 where 4 of 100 answers are longer, "
                                       "5.3 tokens each past it on average, covered 2 times over at 0.3 (it needs "
                                       "0.1)")
    assert choice.answer_tail.clip == 768  # a restart judges the tail against the clip the servers run with
    assert record_pilot(RunTuning(cfg, Path(cfg.run_dir), pilot=True), choice) is None
    server = RunTuning(cfg, Path(cfg.run_dir)).for_server("gpu0")
    assert (server.flag_value(), server.env()) == (0.3, {"SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "768"})


def test_the_pilot_adds_mixed_chunk_where_admission_holds_requests_back_and_the_servers_launch_with_it(tmp_path):
    cfg = cfg_of(tmp_path)
    run = RunTuning(cfg, None, pilot=True)
    tuner = run.for_server("gpu0")
    feed(tuner, usage=0.4, queued=5, retracted=0, seconds=60)
    choice = pilot_choice(run, [tuner.window.evidence()], 2048)
    assert (choice.value, choice.mixed_chunk) == (0.3, True)
    assert choice.mixed_reason.startswith("admission holds requests back, so each finished answer's replacement is "
                                          "prefilled in a step of its own")
    assert "  --enable-mixed-chunk: admission holds requests back" in "\n".join(plan_lines(choice, str(tmp_path)))
    assert record_pilot(RunTuning(cfg, Path(cfg.run_dir), pilot=True), choice) is None
    argv, _ = launched(cfg, Path(cfg.run_dir))
    assert argv[-3:] == ["--schedule-conservativeness", "0.3", "--enable-mixed-chunk"]
    started = RunTuning(cfg, Path(cfg.run_dir))
    assert started.for_server("gpu0").launch().mixed_chunk  # what a host agent's identity record carries
    assert "--enable-mixed-chunk: admission holds requests back" in started.start_alert().evidence
    # nothing queued: admission is not what limits the servers, and nothing is added
    idle = RunTuning(cfg_of(tmp_path / "idle"), None, pilot=True)
    quiet = idle.for_server("gpu0")
    feed(quiet, usage=0.4, queued=0, retracted=0, seconds=60)
    assert not pilot_choice(idle, [quiet.window.evidence()], 2048).mixed_chunk


@pytest.mark.parametrize("workers, said", [
    (dict(mixed_chunk=False), "[workers] mixed_chunk = false: fixed, not tuned"),
    (dict(extra_args=("--enable-mixed-chunk",)), "--enable-mixed-chunk in [workers] launch / extra_args: the operator's"),
    (dict(extra_args=("--chunked-prefill-size", "-1")),
     "--chunked-prefill-size -1 in [workers] launch / extra_args: chunked prefill is off, SGLang mixes nothing"),
])
def test_mixed_chunk_stays_the_operators(tmp_path, workers, said):
    cfg = cfg_of(tmp_path, **workers)
    run = RunTuning(cfg, None, pilot=True)
    tuner = run.for_server("gpu0")
    feed(tuner, usage=0.4, queued=5, retracted=0, seconds=60)
    choice = pilot_choice(run, [tuner.window.evidence()], 2048)
    assert (choice.value, choice.mixed_chunk, choice.mixed_reason) == (0.3, False, said)
    assert f"  --enable-mixed-chunk not added: {said}" in plan_lines(choice, str(tmp_path))
    record_pilot(RunTuning(cfg, Path(cfg.run_dir), pilot=True), choice)
    argv, _ = launched(cfg, Path(cfg.run_dir))
    assert argv.count("--enable-mixed-chunk") == (1 if "--enable-mixed-chunk" in cfg.workers.extra_args else 0)


def test_mixed_chunk_true_in_the_config_is_added_without_a_pilot(tmp_path):
    cfg = cfg_of(tmp_path, mixed_chunk=True, schedule_conservativeness=0.5)
    choice = planned_choice(RunTuning(cfg, None))
    assert (choice.mixed_chunk, choice.mixed_reason) == (True, "[workers] mixed_chunk = true: fixed, not tuned")
    argv, _ = launched(cfg)
    assert argv[-3:] == ["--schedule-conservativeness", "0.5", "--enable-mixed-chunk"]
