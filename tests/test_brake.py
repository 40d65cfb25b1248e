"""The data-quality brake (engine.run.brake): its window, its decision, its record in the store, and the ledger that
holds dispatch while it is engaged; its [brake] config and its notification."""
from __future__ import annotations

import asyncio
import json
import sqlite3

import pytest

from engine.text.answer_shape import SampleShape
from engine.config.load import Alerts, Brake, ConfigError, RunConfig, config_from_dict, dump_toml
from engine.notify.message import notification_for
from engine.config.load import NotifyConfig
from engine.store.rejects import RejectLog
from engine.api.brake import REASON_TITLES, BrakeStatus
from engine.run.brake import REASONS, BrakeWindow, RunBrake, settings_of
from engine.run.counts import ShardCounts
from engine.run.items import Committed
from engine.run.ledger import Ledger
from engine.store.shard_store import ShardStore
from engine.api.events import AlertEvent
from tests.ledger_stubs import StubWing
from tests.test_ledger import admit, work
from tests.test_shard_store import make_row

GOOD = SampleShape(empty=False, finish_reason="stop", think="present")
EMPTY = SampleShape(empty=True, finish_reason="stop", think="present")
CUT = SampleShape(empty=False, finish_reason="length", think="unterminated")
PLAIN = SampleShape(empty=False, finish_reason="stop", think="missing")
LOOP = SampleShape(empty=False, finish_reason="repetition", think="unterminated")  # stopped inside its reasoning
EMPTY_TEXT = "<think>\n\n</think>\n\nOK.<|im_end|>"


def cfg_with(enable_thinking: bool = True, **brake) -> RunConfig:
    return RunConfig(run_dir="/r", model="/m", prompts=("/p.jsonl",), enable_thinking=enable_thinking,
                     brake=Brake(**brake))


# -- the window and the decision -------------------------------------------------------------------------------
def test_the_window_counts_each_reason_over_its_last_samples_only():
    w = BrakeWindow(4)
    w.add([EMPTY, EMPTY, CUT])
    assert (len(w), w.count("empty"), w.count("truncated"), w.count("thinking_missing")) == (3, 2, 1, 1)
    w.add([GOOD, PLAIN, GOOD])  # the two empty ones slide out
    assert (len(w), w.count("empty"), w.count("truncated"), w.count("thinking_missing")) == (4, 0, 1, 2)
    w.clear()
    assert len(w) == 0 and w.count("thinking_missing") == 0
    assert [r.name for r in REASONS] == ["empty", "truncated", "thinking_missing", "repetition", "refused"]
    # a reason is its REASONS entry, its title (engine.api.brake) and its level in [brake]: nothing else to keep in step
    assert list(REASON_TITLES) == [r.name for r in REASONS]
    assert [r.level_key for r in REASONS] == [k for k in Brake.model_fields if k.endswith("_share")]


def test_it_brakes_only_over_a_level_and_only_from_min_samples_on():
    brake = RunBrake(cfg_with(window=200, min_samples=50), "/runs/r1")
    brake.window.add([EMPTY] * 49)
    assert brake.judge() is None  # 100% empty, but under min_samples
    brake.window.add([GOOD] * 50 + [EMPTY])  # 50 of 100: not over 0.5
    assert brake.judge() is None
    brake.window.add([EMPTY])  # 51 of 101
    status = brake.judge(now=1000.0)
    assert status is not None and status.engaged and status.since == 1000.0
    assert [s.reason for s in status.crossed] == ["empty"]
    assert status.text.startswith("empty answers") and "50.5% (51 of the last 101 committed samples; brake level 50%)" \
        in status.text
    assert any(c.startswith("chat template") for c in status.causes)
    assert any(c.startswith("prompt extraction") for c in status.causes)
    assert "regen resume HOST --run-dir /runs/r1 --all" in status.remedy
    assert "regen resume 'ops@gpu box' --run-dir /runs/r1 --all" in status.remedy_for("ops@gpu box")  # quoted
    assert "regen resume local --run-dir /runs/r1 --all" in status.remedy_for("local")
    assert brake.judge() is None  # braked once: not again
    assert brake.release() is status and brake.engaged is None and len(brake.window) == 0


def test_thinking_missing_is_judged_only_with_enable_thinking_and_the_off_switch_never_brakes():
    on = RunBrake(cfg_with(min_samples=10))
    on.window.add([PLAIN] * 20)
    assert [s.reason for s in on.judge().crossed] == ["thinking_missing"]
    plain = RunBrake(cfg_with(enable_thinking=False, min_samples=10))
    plain.window.add([PLAIN] * 20)
    assert plain.judge() is None and [s.reason for s in plain.status().window] == ["empty", "truncated", "repetition",
                                                                                    "refused"]
    off = RunBrake(cfg_with(enabled=False, min_samples=10))
    off.window.add([EMPTY] * 20)
    assert off.judge() is None and off.status().enabled is False


def test_a_cut_answer_counts_as_truncated_and_thinking_missing_each_with_its_own_level():
    brake = RunBrake(cfg_with(min_samples=10, thinking_missing_share=0.9))
    brake.window.add([CUT] * 8 + [GOOD] * 2)
    status = brake.judge()
    assert [(s.reason, s.share) for s in status.crossed] == [("truncated", 0.8)]
    assert any(c.startswith("sampling: max_new_tokens too small") for c in status.causes)


def test_a_runaway_stopped_inside_its_reasoning_counts_once_as_repetition():
    w = BrakeWindow(10)
    w.add([LOOP, LOOP, CUT])
    assert (w.count("repetition"), w.count("thinking_missing"), w.count("truncated")) == (2, 1, 1)


def test_a_recorded_brake_is_kept_under_the_same_settings_and_lifted_under_others():
    brake = RunBrake(cfg_with(min_samples=10))
    brake.window.add([EMPTY] * 10)
    record = json.dumps(brake.judge(now=5.0).to_dict())
    kept = RunBrake(cfg_with(min_samples=10))
    note = kept.load(record, [GOOD] * 3)
    assert kept.engaged is not None and kept.engaged.since == 5.0 and "stays braked" in note
    assert kept.status().samples == 3  # the window is the store's, the brake the record's
    lifted = RunBrake(cfg_with(min_samples=10, empty_share=0.9))
    note = lifted.load(record, [EMPTY] * 10)
    assert lifted.engaged is None and "lifted: [brake] changed" in note
    assert lifted.judge() is not None  # the same window judged again: still over the new level
    off = RunBrake(cfg_with(enabled=False))
    off.load(record, [])
    assert off.engaged is None


def test_the_status_round_trips_through_json():
    brake = RunBrake(cfg_with(min_samples=10))
    brake.window.add([EMPTY] * 12)
    brake.judge(now=7.0)
    status = brake.status()
    back = BrakeStatus.from_dict(json.loads(json.dumps(status.to_dict())))
    assert back == status
    assert back.samples == 12 and back.window[0].reason == "empty" and back.settings == settings_of(Brake(min_samples=10))
    assert "likely causes:" in back.evidence() and "regen resume" in back.evidence()


# -- the store: the think column, the last samples in commit order, the record --------------------------------
def test_the_store_keeps_each_samples_shape_and_reads_the_last_ones_in_commit_order(tmp_path):
    with ShardStore(tmp_path) as store:
        store.ensure_shards({"s00000": 10, "s00001": 10})
        p1 = store.commit("s00000", [make_row("a", text=EMPTY_TEXT), make_row("b")])
        p2 = store.commit("s00001", [make_row("c", text="no reasoning here at all"),
                                     make_row("d", text="<think>\nstill thinking", finish_reason="length")])
        assert p1.shapes == (EMPTY, GOOD)
        assert p2.shapes == (PLAIN, CUT)
        assert store.recent_shapes(3) == [GOOD, PLAIN, CUT]
        first_two = store.last_sample_rowid() - 2
        assert store.recent_shapes(10, after=first_two) == [PLAIN, CUT]
        assert store.brake() == (None, 0)
        store.set_brake('{"engaged": true}')
        store.set_brake(None, window_from=first_two)
    with ShardStore(tmp_path) as store:
        assert store.brake() == (None, first_two)


def test_a_store_from_before_the_think_column_gets_it_and_its_old_samples_read_as_unknown(tmp_path):
    with ShardStore(tmp_path) as store:
        store.ensure_shards({"s00000": 10})
        store.commit("s00000", [make_row("a")])
    with sqlite3.connect(tmp_path / "state.sqlite") as db:  # as a store from before both the column and its index
        db.execute("DROP INDEX samples_unclosed")
        db.execute("ALTER TABLE samples DROP COLUMN think")
    with ShardStore(tmp_path) as store:
        store.commit("s00000", [make_row("b")])
        assert store.recent_shapes(10) == [SampleShape(False, "stop", None), GOOD]


# -- the ledger: braked at a commit, held at pull time, recorded, released by resume --all ----------------------
def brake_ledger(tmp_path, **brake) -> Ledger:
    cfg = RunConfig(run_dir=str(tmp_path), model="/m", prompts=("/data/p.jsonl",), turns="last",
                    brake=Brake(**brake))
    wing = StubWing()
    ledger = Ledger(cfg, {"s00000": ShardCounts(total=40, conversations=40)}, ShardStore(tmp_path), RejectLog(tmp_path),
                    feed=wing, events=wing)
    ledger.open()
    return ledger


def test_the_ledger_brakes_at_the_commit_that_crosses_and_holds_every_item_until_resume_all(tmp_path):
    async def main():
        ledger = brake_ledger(tmp_path, window=10, min_samples=10)
        heard = ledger.events.brakes
        for i in range(20):
            admit(ledger, work(f"c{i:02d}"))
        sent = [ledger.next_item() for _ in range(12)]
        rows = [make_row(it.conv.conversation_id, text=EMPTY_TEXT if i < 6 else None) for i, it in enumerate(sent)]
        part = ledger.store.commit("s00000", rows[:9])
        ledger.settle(Committed(part, tuple((it, None) for it in sent[:9])))
        assert not ledger.braked  # 9 samples: under min_samples
        part = ledger.store.commit("s00000", rows[9:10])
        ledger.settle(Committed(part, ((sent[9], None),)))
        assert ledger.braked and ledger.all_paused and heard == [(True, ledger.brake.engaged.text)]
        assert ledger.next_item() is None  # held: nothing is dispatched
        # requests in flight finish and are committed while braked
        part = ledger.store.commit("s00000", rows[10:12])
        ledger.settle(Committed(part, tuple((it, None) for it in sent[10:12])))
        assert ledger.done == 12 and ledger.brake.status().samples == 10
        ledger.store.close()

        again = brake_ledger(tmp_path, window=10, min_samples=10)  # a restart: still braked, from the record
        admit(again, work("c12"))
        assert again.braked and again.next_item() is None
        assert "stays braked" in again.guard.brake_note
        again.set_paused(["s00000"], False)  # a resume of a shard is not a resume --all
        assert again.braked
        again.set_paused(None, False)
        assert not again.braked and again.brake.status().samples == 0
        assert again.next_item() is not None  # the items held stay queued, in order
        again.store.close()

        third = brake_ledger(tmp_path, window=10, min_samples=10)  # restarted after the resume: the window is empty
        assert not third.braked and third.brake.status().samples == 0
        third.store.close()

    asyncio.run(main())


def test_a_start_under_a_changed_brake_lifts_a_recorded_one(tmp_path):
    async def main():
        ledger = brake_ledger(tmp_path, min_samples=4, window=4)
        for i in range(4):
            admit(ledger, work(f"c{i}"))
        sent = [ledger.next_item() for _ in range(4)]
        part = ledger.store.commit("s00000", [make_row(it.conv.conversation_id, text=EMPTY_TEXT) for it in sent])
        ledger.settle(Committed(part, tuple((it, None) for it in sent)))
        assert ledger.braked
        ledger.store.close()
        off = brake_ledger(tmp_path, enabled=False, min_samples=4, window=4)
        assert not off.braked and "lifted" in off.guard.brake_note
        assert off.store.brake()[0] is None  # the lift is recorded: the record is gone
        off.store.close()

    asyncio.run(main())


# -- config and notification ---------------------------------------------------------------------------------------
def test_brake_config_is_validated_with_errors_naming_the_fix_and_round_trips():
    base = {"run_dir": "/r", "model": "/m", "prompts": ["/p.jsonl"]}
    cfg = config_from_dict({**base, "brake": {"empty_share": 0.6, "window": 300}})
    assert cfg.brake == Brake(empty_share=0.6, window=300)
    assert config_from_dict(__import__("tomllib").loads(dump_toml(cfg)) | {}).brake == cfg.brake
    assert cfg.content_hash() == config_from_dict(base).content_hash()  # operational: not in the hash
    bad = [
        ({"empty_share": 0.04}, f"[brake] empty_share: 0.04 is not above [alerts] empty_share = {Alerts().empty_share:g}"),
        ({"truncated_share": 1.5}, "[brake] truncated_share: 1.5: must be in (0, 1]"),
        ({"min_samples": 600}, "[brake] min_samples: 600 is more than window = 500"),
        ({"window": 0}, "[brake] window: 0: must be greater than or equal to 1"),
        ({"enabled": "yes"}, '[brake] enabled: "yes" (a string): expected true or false'),
        ({"empty": 0.5}, "[brake] empty: unknown key; fix: did you mean `empty_share`?"),
    ]
    for section, words in bad:
        with pytest.raises(ConfigError) as err:
            config_from_dict({**base, "brake": section})
        assert words in str(err.value), str(err.value)


def test_a_brake_is_always_notified_and_its_release_is_not():
    cfg = NotifyConfig(url="https://ntfy.sh/t", min_severity="critical")
    braked = AlertEvent(severity="error", key="brake", text="data-quality brake: dispatch paused run-wide: empty")
    n = notification_for(braked, cfg, run_dir="/r", host="h")
    assert n is not None and n.severity == "error" and "dispatch paused run-wide" in n.title
    released = AlertEvent(severity="info", key="brake", text="cleared: data-quality brake released")
    assert notification_for(released, cfg, run_dir="/r", host="h") is None
    other = AlertEvent(severity="error", key="empty:s00000", text="shard s00000: 87% empty")
    assert notification_for(other, cfg, run_dir="/r", host="h") is None
