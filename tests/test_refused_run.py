"""A run that produces nothing is a failure: servers refusing every request end the run `failed` with their words,
in `regen status` (human and --json), the alert, the notification and the fatal record; nothing is written as done;
the run dir (nothing committed) then takes the corrected config and runs to done.

The refusal is real: `repetition_penalty = 0` is a valid value for SGLang 0.5.5 (so regen's schema takes it), and SGLang
0.5.23, the simulator's default profile, refuses it with HTTP 400. `regen config check` and preflight now refuse it
for a 0.5.23 target (tests/test_sampling_versions.py); the run here is started with --no-preflight, as an operator
who skips both would, to check what a run whose requests are all refused does.
"""
from __future__ import annotations

import json

from engine.run.refusals import RefusalWatch, likely_key
from tests.run_helpers import events, make_config, read_rows, wait_for
from tests.test_cli_run import cleanup_runs, regen  # noqa: F401  (fixture)
from tests.test_faults_fatal import frozen_console, write_config
from tests.test_tui_app import header, wait_until
from tests.test_notify import Receiver, notify_table


def test_the_watch_trips_on_a_streak_of_one_reason_and_on_a_majority_of_the_window():
    watch = RefusalWatch(streak=20, window=200)
    for i in range(19):
        assert watch.refused(f"c{i}#turn0", "rejected", f"The input ({100 + i} tokens) is longer than the model's "
                             "context length (64 tokens).") is None
    trip = watch.refused("c19#turn0", "rejected", "The input (900 tokens) is longer than the model's context "
                         "length (64 tokens).")
    assert trip is not None and trip.rule == "20 in a row for one reason" and len(trip.samples) == 20
    assert "context_length" in trip.key and "c0#turn0" in trip.evidence()

    mixed = RefusalWatch(streak=20, window=200)
    for i in range(200):  # alternating: never a streak, but 100 of 200 is not "more than half"
        mixed.refused(f"s{i}", "failed", "HTTP 503") if i % 2 else mixed.ok()
    assert mixed.tripped is None
    assert mixed.refused("s-last", "failed", "HTTP 503") is not None  # the oldest (ok) leaves: 101 of 200
    assert mixed.tripped.rule.startswith("101 of the last 200")


def test_the_likely_key_follows_the_servers_words():
    assert likely_key("repetition_penalty must be in (0, 2], got 0.0.") == "[sampling] repetition_penalty"
    assert likely_key("temperature must be non-negative, got -1.") == "[sampling] temperature"
    assert "no run.toml key" in likely_key("something else")


async def test_a_rehearsal_whose_server_refuses_every_request_fails_with_its_words_then_runs_when_fixed(
        tmp_path, tiny_model_dir, cleanup_runs):
    receiver = Receiver()
    run_dir = tmp_path / "run"
    cleanup_runs.append(run_dir)
    cfg = make_config(run_dir, tiny_model_dir, prompts=40, gpus=1)
    bad = cfg.model_copy(update=dict(sampling=cfg.sampling.model_copy(update={"repetition_penalty": 0}),
                                     notify=notify_table(receiver.url())))
    config = write_config(tmp_path, bad)
    try:
        check = regen("config", "check", str(config), home=tmp_path)
        assert check.returncode == 1, check.stderr  # the simulator plays 0.5.23, which refuses 0
        assert "[sampling] repetition_penalty: 0 is refused by SGLang 0.5.23" in check.stderr
        started = regen("start", "local", "--config", str(config), "--no-preflight", home=tmp_path)
        assert started.returncode == 0, started.stdout + started.stderr

        def ended() -> bool:
            return any(e["type"] == "run_end" for e in events(run_dir)) if (run_dir / "telemetry.jsonl").exists() \
                else False
        wait_for(ended, 60, "the refused run to end")
        end = next(e for e in events(run_dir) if e["type"] == "run_end")
        assert end["state"] == "failed" and end["done"] == 0, end
        assert "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0" in end["cause"]

        alerts = [e for e in events(run_dir) if e["type"] == "alert" and e.get("key") == "refused"]
        assert alerts and alerts[0]["severity"] == "critical"
        assert "repetition_penalty must be in (0, 2]" in alerts[0]["text"]
        assert "[sampling] repetition_penalty" in alerts[0]["evidence"] and "#turn" in alerts[0]["evidence"]

        human = regen("status", "local", "--run-dir", str(run_dir), home=tmp_path)
        js = json.loads(regen("status", "local", "--run-dir", str(run_dir), "--json", home=tmp_path).stdout)
        assert human.returncode != 0
        assert human.stdout.splitlines()[0].startswith("failed: RunRefused: ")
        assert "repetition_penalty must be in (0, 2]" in " ".join(human.stdout.split())
        assert js["state"] == "failed" and js["fatal"]["exc_type"] == "RunRefused"
        assert "[sampling] repetition_penalty" in js["fatal"]["message"]
        assert "done: 0/0" not in human.stdout and "100.0%" not in human.stdout

        wait_for(lambda: any("repetition_penalty must be in (0, 2]" in json.dumps(m) for m in receiver.bodies()),
                 30, "the notification quoting the server")

        source, app = frozen_console(run_dir, tmp_path)
        try:
            async with app.run_test(size=(200, 40)) as pilot:
                await wait_until(pilot, lambda: "failed: RunRefused" in header(app), "the cause in the TUI header")
                shown = " ".join(header(app).split())
        finally:
            await source.close()
        assert "repetition_penalty must be in (0, 2]" in shown and "- tok/s" in shown

        # nothing committed: the corrected config is taken, and every sample is generated
        fixed = write_config(tmp_path, cfg)
        again = regen("start", "local", "--config", str(fixed), "--no-preflight", home=tmp_path)
        assert again.returncode == 0, again.stdout + again.stderr

        def done() -> bool:
            ends = [e for e in events(run_dir) if e["type"] == "run_end"]
            return len(ends) >= 2
        wait_for(done, 120, "the corrected run to end")
        final = [e for e in events(run_dir) if e["type"] == "run_end"][-1]
        assert final["state"] == "done" and final["done"] == final["total"] > 40, final  # 40 conversations' turns
        ids = [r["sample_id"] for r in read_rows(run_dir)]
        assert len(ids) == len(set(ids)) == final["total"]
        log = (run_dir / "supervisor.log").read_text()
        assert "has no committed sample: its config is changed (sampling.repetition_penalty 0 -> 1.0)" in log
    finally:
        receiver.close()


def test_refusals_count_in_the_brakes_window_beside_bad_answers():
    from engine.text.answer_shape import SampleShape
    from engine.config.load import config_from_dict
    from engine.run.brake import REFUSED_SHAPE, RunBrake

    cfg = config_from_dict({"run_dir": "/r", "model": "/m", "prompts": ["/p"], "brake": {"window": 40, "min_samples": 20}})
    brake = RunBrake(cfg)
    good = SampleShape(empty=False, finish_reason="stop", think="closed")
    brake.window.add([good] * 29 + [REFUSED_SHAPE] * 11)  # 27.5% refused: over refused_share 0.25
    status = brake.judge()
    assert status is not None and [s.reason for s in status.crossed] == ["refused"]
    assert status.text.startswith("samples refused or failed by the servers: 27.5% (11 of the last 40")
    assert any("SGLang version refuses" in c for c in status.causes)
