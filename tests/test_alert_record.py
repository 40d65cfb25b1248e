"""The record of raised alerts (engine.store.alert_record) on a real state.sqlite: an alert raised once per condition, kept
across a restart (a new Telemetry and store on the same run dir), not raised again by the restarted supervisor, and
cleared (a `cleared` event, the row gone) when its condition ends; the status lists the record, not telemetry lines."""
from __future__ import annotations

import json
import logging

import pytest

from engine.store.alert_record import AlertRecord
from engine.run.counts import ShardCounts
from engine.observe.offline_status import offline_status
from engine.observe.watch import RunWatch
from engine.store.shard_store import ShardStore, StoredAlert
from engine.store.state_db import StoreError
from engine.store.stats import stats_alerts
from engine.telemetry import Telemetry
from engine.api.events import AlertEvent
from engine.api.wire import AlertKind, Severity
from tests.test_engine_run import make_config

KEY = "empty:s00002"
RAISED_TEXT = "shard s00002: 7% empty answers (threshold alerts.empty_share 5%)"


def said(run_dir, key: str | None = None) -> list[dict]:
    """The alert lines telemetry.jsonl holds (of one key)."""
    lines = [json.loads(x) for x in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    return [e for e in lines if e["type"] == "alert" and (key is None or e["key"] == key)]


class Supervisor:
    """What a supervisor process holds of the record: its telemetry and the run's store."""

    def __init__(self, run_dir):
        self.telemetry = Telemetry(run_dir)
        self.store = ShardStore(run_dir)
        self.loaded = self.telemetry.keep_alerts(self.store)

    def judge(self, holds: bool, text: str = RAISED_TEXT) -> None:
        self.telemetry.condition(KEY, holds, Severity.ERROR, text, "6 of 82 samples are empty answers",
                                 cleared="cleared: shard s00002: 4% empty answers (8 of 202)")

    def kill(self) -> None:
        """Gone without a word (what a SIGKILL leaves is what was written)."""
        self.telemetry.close()
        self.store.close()


def test_a_raised_alert_survives_a_restart_is_never_raised_twice_and_clears_once(tmp_path):
    first = Supervisor(tmp_path)
    assert first.loaded == []
    first.judge(True)
    first.judge(True)  # the next tick: still holds, not said again
    [raised] = said(tmp_path, KEY)
    assert (raised["kind"], raised["severity"], raised["text"]) == ("raised", "error", RAISED_TEXT)
    assert [a.key for a in first.telemetry.raised_alerts()] == [KEY]
    assert first.store.raised_alerts() == [StoredAlert(KEY, "error", RAISED_TEXT, "6 of 82 samples are empty answers",
                                                       raised["ts"])]
    first.kill()

    # the status of the dead supervisor's run lists the record: the alert, as raised
    dead = offline_status(tmp_path)
    assert [(a.key, a.text, a.ts, a.kind) for a in dead.alerts] == [(KEY, RAISED_TEXT, raised["ts"], "raised")]
    assert [a.key for a in dead.alert_events] == [KEY]  # the history is still there, as history

    second = Supervisor(tmp_path)  # restarted: it loads what the first raised
    assert [(a.key, a.ts) for a in second.loaded] == [(KEY, raised["ts"])]
    second.judge(True, "shard s00002: 6% empty answers (threshold alerts.empty_share 5%)")  # still holds
    assert len(said(tmp_path, KEY)) == 1, "a restart must not raise the same condition again"
    assert [a.text for a in second.telemetry.raised_alerts()] == [RAISED_TEXT]  # the one raised, as raised

    second.judge(False)  # the shard finished at 4%: the condition ended
    second.judge(False)
    raised_line, cleared = said(tmp_path, KEY)
    assert (cleared["kind"], cleared["severity"], cleared["text"]) == (
        "cleared", "info", "cleared: shard s00002: 4% empty answers (8 of 202)")
    assert cleared["evidence"].splitlines()[0].endswith(f": {RAISED_TEXT}")  # what it clears, said with it
    assert second.telemetry.raised_alerts() == [] and second.store.raised_alerts() == []
    second.kill()

    third = Supervisor(tmp_path)
    assert third.loaded == [] and offline_status(tmp_path).alerts == []
    third.judge(True)  # raised again later: a new condition, said again
    assert [e["kind"] for e in said(tmp_path, KEY)] == ["raised", "cleared", "raised"]
    third.kill()


def test_raised_and_cleared_events_go_through_the_record_and_one_shot_events_do_not(tmp_path):
    t = Telemetry(tmp_path)  # no store yet: the record is kept in memory
    t.emit(AlertEvent(severity=Severity.WARNING, key="stranded", text="work waits", kind=AlertKind.RAISED))
    t.emit(AlertEvent(severity=Severity.INFO, key="host-lost:h1", text="cleared: h1 is back", kind=AlertKind.CLEARED))
    store = ShardStore(tmp_path)
    assert t.keep_alerts(store) == []  # nothing earlier; what was raised before is written now
    assert [a.key for a in store.raised_alerts()] == ["stranded"]
    t.emit(AlertEvent(severity=Severity.WARNING, key="stranded", text="work waits still", kind=AlertKind.RAISED))
    for _ in range(2):  # a one-shot event is said each time, and never listed as raised
        t.emit(AlertEvent(severity=Severity.ERROR, key="worker:gpu0:crash", text="worker gpu0 crashed (1)"))
    t.emit(AlertEvent(severity=Severity.INFO, key="stranded", text="cleared: nothing waits", kind=AlertKind.CLEARED))
    assert [(e["key"], e["kind"]) for e in said(tmp_path)] == [
        ("stranded", "raised"), ("worker:gpu0:crash", "event"), ("worker:gpu0:crash", "event"),
        ("stranded", "cleared")]  # the clear of a host never lost is not said
    assert t.raised_alerts() == [] and store.raised_alerts() == []
    t.close()
    store.close()


class FullDisk:
    def raised_alerts(self) -> list[StoredAlert]:
        return []

    def record_alert(self, alert: StoredAlert) -> None:
        raise StoreError("database or disk is full")

    def drop_alert(self, key: str) -> None:
        raise StoreError("database or disk is full")


def test_a_record_that_cannot_be_written_is_said_and_kept_in_memory(caplog):
    record = AlertRecord()
    record.attach(FullDisk())
    with caplog.at_level(logging.ERROR, logger="regen.alerts"):
        assert record.raise_(AlertEvent(key="disk-low", text="disk low", kind=AlertKind.RAISED))
    assert record.write_error == "database or disk is full" and "disk is full" in caplog.text
    assert not record.raise_(AlertEvent(key="disk-low", text="disk low", kind=AlertKind.RAISED))
    assert record.clear("disk-low") is not None and record.raised() == []


def test_the_watch_clears_what_an_earlier_supervisor_raised_once_its_condition_ended(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = make_config(run_dir, tmp_path / "model", prompts=4)
    store = ShardStore(run_dir)
    for key in (KEY, "truncated:s00001", "repetition:s00003", "empty:s00004"):
        store.record_alert(StoredAlert(key, "error", f"{key} held", "", 1.0))
    t = Telemetry(run_dir)
    assert len(t.keep_alerts(store)) == 4
    runaway_off = cfg.model_copy(update=dict(runaway=cfg.runaway.model_copy(update=dict(enabled=False))))
    RunWatch(runaway_off, run_dir, t).quality({
        "s00002": ShardCounts(total=202, done=202, empty=8),  # finished at 4%
        "s00001": ShardCounts(total=202, done=40, truncated=30),  # too few samples to judge: nothing holds
        "s00003": ShardCounts(total=202, done=100, repetition=50),  # the runaway guard is off now
        "s00004": ShardCounts(total=202, done=100, empty=30)})  # still holds: kept, not said again
    cleared = {e["key"]: e for e in said(run_dir) if e["kind"] == "cleared"}
    assert set(cleared) == {KEY, "truncated:s00001", "repetition:s00003"}
    assert cleared[KEY]["text"] == "cleared: shard s00002: 4% empty answers (8 of 202), not above alerts.empty_share 5%"
    assert cleared["repetition:s00003"]["text"].endswith("(the runaway guard is off)")
    assert [a.key for a in t.raised_alerts()] == ["empty:s00004"] and len(said(run_dir)) == 3
    t.close()
    store.close()


def test_the_stats_flags_are_conditions_with_a_clear_path():
    class Stats:
        flags, samples, run_dir, integrity_errors = [], 40, "/r", []

    assert stats_alerts(Stats()) == []
    [cleared] = stats_alerts(Stats(), raised=["stats.empty_share", "empty:s00000"])
    assert (cleared.key, cleared.kind, cleared.severity) == ("stats.empty_share", AlertKind.CLEARED, Severity.INFO)


@pytest.mark.parametrize("kind", ["raised", "cleared", "event"])
def test_the_kind_is_on_the_wire(kind):
    ev = AlertEvent(key="k", text="t", kind=AlertKind(kind))
    assert json.loads(ev.to_json())["kind"] == kind
