"""The console's event-folding model: state, bounded history, derived figures, console-side alerts."""
from __future__ import annotations

from pathlib import Path

from engine.api.status import RunStatus
from console.view.model import RunModel
from console.view.model_parts import bytes_text
from engine.api.wire import duration_text
from console.view.series import COARSE_TIERS, HISTORY_POINTS, Series, downsample
from engine.api.events import (AlertEvent, DiskEvent, DispatchEvent, GpuEvent, ShardEvent, WorkerEvent,
                                     parse_event)

RECORDED = Path(__file__).parent / "data" / "tui_telemetry.jsonl"


def test_worker_and_gpu_fold_with_na_when_nvml_missing():
    m = RunModel("h", "/r")
    m.apply(WorkerEvent(ts=1, name="gpu0", state="ready", gpus=[0, 1], gen_throughput=900.0, running_reqs=12,
                        queued_reqs=None))
    m.apply(GpuEvent(ts=1, index=0, mem_used_mb=1000, mem_total_mb=80000, util_pct=90, temp_c=70))
    m.apply(GpuEvent(ts=1, index=1, mem_used_mb=None, error="NVML unavailable"))
    w = m.workers["gpu0"]
    assert (w.state, w.tok_s, w.running, w.queued) == ("ready", 900.0, 12, None)
    g = m.worker_gpu(w)
    assert g["mem_used_mb"] is None and g["util_pct"] is None  # one GPU of two is N/A: the sum is N/A, not half
    m.apply(GpuEvent(ts=2, index=1, mem_used_mb=3000, mem_total_mb=80000, util_pct=50, temp_c=80))
    g = m.worker_gpu(w)
    assert g == {"mem_used_mb": 4000, "mem_total_mb": 160000, "util_pct": 70.0, "temp_c": 80}


def test_worker_crash_raises_one_console_alert():
    m = RunModel()
    m.apply(WorkerEvent(ts=1, name="gpu1", state="ready"))
    m.apply(WorkerEvent(ts=2, name="gpu1", state="crashed", error="exit -9"))
    m.apply(WorkerEvent(ts=3, name="gpu1", state="crashed", error="exit -9"))
    alerts = [a for a in m.alerts if "gpu1" in a.text]
    assert len(alerts) == 1 and alerts[0].text == "worker gpu1 crashed: exit -9" and alerts[0].origin == "console"
    assert m.take_new_alerts() and not m.take_new_alerts()


def test_history_is_bounded_and_replays_are_ignored():
    s = Series()
    for i in range(HISTORY_POINTS + 100):
        s.add(float(i), i)
    assert len(s.points) == HISTORY_POINTS and s.points[0] == (100.0, 100.0)
    s.add(5.0, 1.0)  # backfill overlap: older than the newest point
    assert s.last() == HISTORY_POINTS + 99
    # the 100 points pushed out are kept averaged per minute: 0-59 and 60-99 (the minute still filling)
    assert s.history()[:2] == [(29.5, 29.5), (79.5, 79.5)] and len(s) == HISTORY_POINTS + 2


def test_days_of_history_stay_bounded_and_reach_back_a_week():
    s = Series()
    tick, days = 2.0, 9
    for i in range(int(days * 86400 / tick)):
        s.add(i * tick, 100.0 + (i % 10))
    bound = HISTORY_POINTS + sum(kept + 1 for _, kept in COARSE_TIERS)
    history = s.history()
    assert len(s) == len(history) <= bound
    assert [t for t, _ in history] == sorted(t for t, _ in history)
    newest = history[-1][0]
    assert newest - history[0][0] > 7 * 86400 - 3600  # a week back, at ten-minute resolution
    assert all(abs(v - 104.5) < 1.0 for _, v in history[:-HISTORY_POINTS])  # averages of the values


def test_downsample_averages_over_equal_stretches_of_time():
    points = [(float(t), float(t % 2)) for t in range(1000)]
    out = downsample(points, 10)
    assert len(out) == 10 and all(abs(v - 0.5) < 0.01 for _, v in out)
    assert downsample(points[:5], 10) == points[:5]


def test_dispatch_header_eta_and_follow_position():
    m = RunModel()
    m.apply(DispatchEvent(ts=10, done=100, total=400, output_tokens=20000, tokens_per_s=1000.0, in_flight=5))
    assert (m.done, m.total, m.state) == (100, 400, "running")
    assert m.eta_s() is None  # not measurable yet: the engine says when it is
    m.apply(DispatchEvent(ts=10, done=100, total=400, output_tokens=20000, tokens_per_s=1000.0, in_flight=5,
                          eta_s=60.0))
    assert m.eta_s() == 60.0
    assert m.last_ts == 10
    m.apply_status(RunStatus.from_dict({"run_dir": "/r", "state": "paused", "pid": 7, "started_at": 0.0, "dispatch": None,
                                        "shards": [{"id": "s00000", "state": "paused", "done": 3, "total": 50,
                                                    "ts": 99}]}))
    assert m.last_ts == 10  # a status snapshot does not move the follow position
    assert m.paused_shards() == ["s00000"] and m.state == "paused"
    assert m.elapsed_s(now=65.0) == 65.0


def test_alerts_deduplicate_by_key_and_count_repeats():
    m = RunModel()
    for ts in (1, 2, 3):
        m.apply(AlertEvent(ts=ts, severity="error", text="shard s1: 30% empty", key="empty:s1"))
    assert len(m.alerts) == 1 and m.alerts[0].count == 3
    m.apply(AlertEvent(ts=2, severity="error", text="shard s1: 30% empty", key="empty:s1"))  # backfilled copy
    assert m.alerts[0].count == 3


def test_a_keys_alerts_with_other_texts_stay_one_row_each_through_every_status_reply():
    """`slurm-submit:regen-0` said `job 6 submitted`, then `job 9 submitted`: each status reply carries both again
    (seen in tmux: three rows of each after a few replies)."""
    m = RunModel()
    said = [AlertEvent(ts=1, severity="info", text="slurm job 6 submitted for regen-0", key="slurm-submit:regen-0"),
            AlertEvent(ts=5, severity="info", text="slurm job 9 submitted for regen-0", key="slurm-submit:regen-0")]
    for _ in range(3):
        m.apply_status(RunStatus(run_dir="/r", state="running", running=True, alert_events=said))  # history: every reply
    assert [(a.text, a.count) for a in m.alerts] == [("slurm job 6 submitted for regen-0", 1),
                                                     ("slurm job 9 submitted for regen-0", 1)]


def test_disk_time_to_full_and_low_alert():
    m = RunModel()
    gib = 2**30
    for i in range(11):
        m.apply(DiskEvent(ts=60.0 * i, path="/run", free_bytes=(100 - i) * gib, total_bytes=200 * gib))
    d = m.disks[("", "/run")]
    assert abs(d.write_rate() - gib / 60) < 1
    assert abs(d.time_to_full() - 90 * 60) < 1  # 90 GiB left at 1 GiB/min
    m.apply(DiskEvent(ts=700.0, path="/run", free_bytes=5 * gib, total_bytes=200 * gib))
    assert not m.alerts  # the disk-low alert is the engine's (engine.observe.watch, alerts.disk_free_min_gb)
    flat = RunModel()
    flat.apply(DiskEvent(ts=1, path="/dev/shm", free_bytes=gib, total_bytes=gib))
    flat.apply(DiskEvent(ts=2, path="/dev/shm", free_bytes=gib, total_bytes=gib))
    assert flat.disks[("", "/dev/shm")].time_to_full() is None


def test_the_console_judges_no_rule_of_its_own_it_shows_the_engines_alerts_and_levels():
    """Rules are judged once, in the engine: a throughput drop and 20% empty answers raise no console-side alert
    (the engine's telemetry and watch raise them, with the run's levels); the shards' problem marks use the levels
    the engine sends with its status."""
    m = RunModel()
    m.apply(ShardEvent(ts=0, id="s0", state="running", done=100, total=200, empty=20))
    for i in range(40):
        m.apply(DispatchEvent(ts=float(i), done=100, total=200, tokens_per_s=1000.0, in_flight=8))
    m.apply(DispatchEvent(ts=41.0, done=100, total=200, tokens_per_s=100.0, in_flight=8))
    assert not m.alerts
    m.apply(AlertEvent(ts=42.0, severity="error", key="empty:s0",
                       text="shard s0: 20% empty answers (threshold alerts.empty_share 5%)"))
    assert [a.text for a in m.alerts] == ["shard s0: 20% empty answers (threshold alerts.empty_share 5%)"]
    changed = m.apply_status(RunStatus.from_dict({"run_dir": "/r", "state": "running",
                                                  "levels": {"empty_share": 0.3, "truncated_share": 0.4}}))
    assert "shards" in changed and m.levels.empty_share == 0.3 and m.levels.truncated_share == 0.4


def test_recorded_run_folds_to_its_final_state():
    """A telemetry.jsonl written by the real engine (`regen demo`, 2 simulated GPUs)."""
    m = RunModel()
    lines = RECORDED.read_bytes().splitlines()
    m.apply_all(parse_event(line) for line in lines if line.strip())
    assert m.state == "done" and m.done == m.dispatch.done and m.total > 0
    assert set(m.workers) == {"gpu0", "gpu1"}
    assert all(s.state == "done" for s in m.shards.values())
    assert ("", "/dev/shm") in m.disks  # an old telemetry file (no host field): the dispatch host's
    assert all(g.mem_used_mb is None and g.error for g in m.gpus.values())  # no NVML here: N/A, with the reason


def test_text_helpers():
    assert duration_text(None) == "N/A" and duration_text(3725) == "1h02m" and duration_text(90061) == "1d01h01m"
    assert bytes_text(3 * 2**30) == "3.0 GiB" and bytes_text(None) == "N/A"


def test_status_reply_with_event_dicts_folds():
    """A real status reply carries each event's `type` key; it must fold, not raise."""
    m = RunModel()
    d = DispatchEvent(ts=5, done=3, total=9, tokens_per_s=10.0).to_dict()
    w = WorkerEvent(ts=5, name="gpu0", state="ready").to_dict()
    a = AlertEvent(ts=5, severity="warning", text="t", key="k").to_dict()
    m.apply_status(RunStatus.from_dict({"run_dir": "/r", "state": "running", "dispatch": d, "workers": [w],
                                        "alerts": [a], "rejects": {"total": 2}}))
    assert (m.done, m.total, m.workers["gpu0"].state, m.rejects.total) == (3, 9, "ready", 2)
    assert [x.text for x in m.alerts] == ["t"]


def test_a_workers_row_says_what_it_runs_what_waits_in_its_queue_and_what_regen_holds_for_it():
    from console.view.batch_text import queued_text

    m = RunModel("h", "/r")
    m.apply(WorkerEvent(ts=1, name="gpu0", state="ready", running_reqs=96, queued_reqs=3, in_flight=99, capacity=120,
                        held=40))
    w = m.workers["gpu0"]
    assert (w.running, w.queued, w.held, w.in_flight) == (96, 3, 40, 99)
    assert queued_text(w.queued, w.held) == "3 +40 held"  # the Workers tab's queued cell, as regen status says it
    assert queued_text(None) == "N/A" and queued_text(0.0) == "0"
