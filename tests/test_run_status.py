"""The one status shape (engine.api.status.RunStatus): its JSON round trip, an older engine's reply read back, and
the live (Supervisor.status) and offline (engine.observe.offline_status) replies built by the one builder."""
from __future__ import annotations

import asyncio
import dataclasses

import orjson
import pytest

from engine.api.ops import ControlError
from engine.fatal import write_fatal
from engine.api.status import FatalRecord, HostStatus, Rejects, RouterStatus, RunStatus, StartCheck
from engine.text.row_errors import Reject
from engine.store.rejects import RejectLog
from engine.api.ops import DrainHost, Pause, Status
from engine.observe.offline_status import NotARunDir, offline_status
from engine.api.wire import ShardFigures
from engine.store.shard_store import ShardStore
from engine.supervisor.supervisor import Supervisor
from engine.telemetry import Telemetry
from engine.api.events import (AlertEvent, DiskEvent, DispatchEvent, GpuEvent, RunEndEvent, ShardEvent,
                                     WorkerEvent)
from tests.test_engine_run import make_config
from tests.test_shard_store import make_row

FATAL = FatalRecord(exc_type="PromptFileError", message="prompt file /d/c.jsonl: [Errno 2] No such file",
                    path="/d/c.jsonl", remedy="fix `prompts`", phase="start", exit_code=5, pid=42,
                    log="/r/supervisor.log", ts=50.0)


def rich_status() -> RunStatus:
    return RunStatus(
        run_dir="/r", state="running", phase="run", pid=42, started_at=10.0, config_hash="abc", host="gpu-box",
        startup=[StartCheck("config", "config read", "ok", "run.toml", 11.0)], write_errors=["/r/x.log: ENOSPC"],
        dispatch=DispatchEvent(ts=20.0, in_flight=3, done=5, failed=1, retried=2, rejected=1, total=8, planned=10,
                               output_tokens=500, tokens_per_s=99.5, eta_s=30.0, state="running"),
        workers=[WorkerEvent(ts=20.0, name="w0", state="ready", url="http://127.0.0.1:1", gpus=[0], pid=7,
                             running_reqs=2.0, host="h1")],
        shards=[ShardFigures(id="s00000", state="running", done=5, total=8, planned=10, output_tokens=500, empty=1,
                            truncated=0, failed=1, rejected=1, dispatched=9)],
        gpus=[GpuEvent(ts=20.0, index=0, name="H200", mem_used_mb=1.0, mem_total_mb=2.0)],
        disk=[DiskEvent(ts=20.0, path="/r", free_bytes=1, total_bytes=2)],
        alerts=[AlertEvent(ts=19.0, severity="warning", text="slow", evidence="e", key="k", kind="raised")],
        alert_events=[AlertEvent(ts=18.0, severity="error", text="worker w0 crashed", key="worker:w0:crash"),
                      AlertEvent(ts=19.0, severity="warning", text="slow", evidence="e", key="k", kind="raised")],
        rejects=Rejects(total=3, by_reason={"malformed_json": 2, "generation_failed": 1}),
        run_end=RunEndEvent(ts=21.0, state="stopped", exit_code=0, cause="SIGTERM received", done=5, total=8),
        fatal=FATAL, log="/r/supervisor.log", log_tail=["a"], checked_at=22.0, read_errors=["reject log: x"],
        hosts=[HostStatus(name="h1", address="local", state="up", workers=["w0"], work_dir="/r"),
               HostStatus(name="h2", address="u@h2", state="lost", error="ssh: timeout", workers=["h2-w0"],
                          work_dir="/w", joins=2, lost=1)],
        router=RouterStatus(url="http://127.0.0.1:9", up=True, policy="cache_aware", members=["http://a"]))


def test_a_status_survives_its_json_round_trip():
    status = rich_status()
    d = orjson.loads(orjson.dumps(status.to_dict()))
    assert RunStatus.from_dict(d) == status
    assert RunStatus.from_dict(d).to_dict() == d
    assert d["dispatch"]["type"] == "dispatch" and d["alerts"][0]["type"] == "alert"  # events keep their type
    local, remote = d["hosts"]
    assert "joins" not in local and (remote["joins"], remote["lost"]) == (2, 1)  # the local host has no link


def test_a_single_host_status_has_no_fleet_keys():
    d = dataclasses.replace(rich_status(), hosts=None, router=None).to_dict()
    assert "hosts" not in d and "router" not in d
    assert RunStatus.from_dict(d).hosts is None


def test_an_older_engines_reply_reads_with_defaults():
    old = {"run_dir": "/r", "state": "running", "pid": 7, "dispatch": {"done": 3, "total": 9, "type": "dispatch"},
           "shards": [{"id": "s00000", "state": "running", "done": 3, "total": 9}], "unknown_field": 1}
    status = RunStatus.from_dict(old)
    assert status.running and not status.offline and status.fatal is None and status.rejects == Rejects()
    assert (status.dispatch.done, status.dispatch.total, status.shards[0].planned) == (3, 9, 0)
    assert RunStatus.from_dict({"run_dir": "/r", "state": "dead", "offline": True}).running is False


# -- offline and live: one builder ------------------------------------------------------------------
def stored_run(run_dir):
    store = ShardStore(run_dir)
    store.ensure_shards({"s00000": 4, "s00001": 4, "s00002": 4}, {"s00000": 4, "s00001": 4, "s00002": 4})
    store.commit("s00000", [make_row(f"c{i}") for i in range(4)])
    store.commit("s00001", [make_row("d0", output_len=6)])
    store.set_paused(["s00001"], True)
    store.close()
    with RejectLog(run_dir) as log:
        log.add(Reject(file="p.jsonl", line=3, row=None, reason="malformed JSON", excerpt="{", kind="malformed_json"))


def write_events(run_dir, *events):
    with open(run_dir / "telemetry.jsonl", "ab") as f:
        for ev in events:
            f.write(ev.to_json() + b"\n")


def test_offline_status_is_the_committed_figures_with_the_last_events_cause(tmp_path):
    stored_run(tmp_path)
    write_events(tmp_path, DispatchEvent(ts=100.0, state="running", retried=4, done=2),
                 AlertEvent(ts=101.0, text="worker w0 crashed", key="w0"),
                 ShardEvent(ts=102.0, id="s00000", state="running"),
                 RunEndEvent(ts=103.0, state="drained", cause="drain requested"))
    (tmp_path / "telemetry.jsonl").open("ab").write(b'{"type": "dispatch", "ts": 1')  # a line cut by a kill
    s = offline_status(tmp_path)
    assert (s.state, s.running, s.offline, s.last_state, s.fatal) == ("drained", False, True, "running", None)
    assert s.run_end.cause == "drain requested" and [a.text for a in s.alert_events] == ["worker w0 crashed"]
    assert s.alerts == []  # a crash is an event (history), not a condition raised now: the store records none
    assert (s.dispatch.done, s.dispatch.retried, s.dispatch.tokens_per_s) == (5, 4, None)
    assert s.dispatch.ts > 103.0  # the committed figures as read now, newer than every recorded event
    assert {sh.id: sh.state for sh in s.shards} == {"s00000": "done", "s00001": "paused", "s00002": "pending"}
    assert s.rejects == Rejects(total=1, by_reason={"malformed_json": 1}) and s.started_at == 100.0
    assert s.log_tail == [] and s.log == str(tmp_path / "supervisor.log")


def test_offline_status_says_failed_with_the_cause_or_dead_with_the_log_tail(tmp_path):
    (tmp_path / "nothing").mkdir()
    with pytest.raises(NotARunDir, match="holds no state.sqlite"):
        offline_status(tmp_path / "nothing")
    stored_run(tmp_path)
    write_events(tmp_path, RunEndEvent(ts=5.0, state="stopped"), DispatchEvent(ts=6.0, state="running"))
    (tmp_path / "supervisor.log").write_text("one\ntwo\n\nthree\nfour\n")
    dead = offline_status(tmp_path)  # a later supervisor wrote after that run_end, then died without a word
    assert (dead.state, dead.run_end, dead.log_tail) == ("dead", None, ["two", "three", "four"])
    write_fatal(tmp_path, FATAL)
    failed = offline_status(tmp_path)
    assert failed.state == "failed" and failed.fatal.message == FATAL.message and failed.log_tail == []


@pytest.fixture
def idle_supervisor(tmp_path):
    """A supervisor object before its run began: no ledger, no workers (its status op still answers)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = make_config(run_dir, tmp_path / "model", prompts=4)
    telemetry = Telemetry(run_dir)
    sup = Supervisor(cfg, run_dir, telemetry)
    sup.rejects = RejectLog(run_dir)
    yield sup
    sup.rejects.close()
    telemetry.close()


def test_the_live_and_offline_replies_have_the_same_keys(idle_supervisor):
    sup = idle_supervisor
    live = asyncio.run(sup.handle(Status())).to_dict()  # the handler returns the typed reply (RunStatus)
    assert (live["state"], live["running"], live["offline"], live["dispatch"], live["shards"]) == (
        "starting", True, False, None, [])
    assert [c["check"] for c in live["startup"]][0] == "config"
    stored_run(sup.run_dir)
    offline = offline_status(sup.run_dir).to_dict()
    assert set(live) == set(offline)


def test_ops_a_starting_supervisor_cannot_serve_say_why(idle_supervisor):
    with pytest.raises(ControlError, match="still starting"):
        asyncio.run(idle_supervisor.handle(Pause(shards=None)))
    with pytest.raises(ControlError, match=r"drain_host: this run has no \[\[hosts\]\]"):
        asyncio.run(idle_supervisor.handle(DrainHost(host="h2")))


def test_status_shows_each_workers_prefix_cache_hit_share_in_text_and_json():
    from rich.console import Console

    from console.commands.status import render_status

    workers = [WorkerEvent(name="gpu0", state="ready", prompt_tokens=1_200_000, cached_tokens=996_000),
               WorkerEvent(name="gpu1", state="ready", prompt_tokens=0, cached_tokens=0),
               WorkerEvent(name="h2.gpu0", state="ready")]  # behind a router: not a dispatch target
    status = RunStatus.from_dict({"run_dir": "/r", "state": "running", "workers": [w.to_dict() for w in workers]})
    assert [(w["prompt_tokens"], w["cached_tokens"]) for w in status.to_dict()["workers"]] == [
        (1_200_000, 996_000), (0, 0), (None, None)]
    console = Console(width=240, record=True)
    console.print(render_status(status))
    rows = {line.split("│")[1].strip(): line for line in console.export_text().splitlines()
            if line.count("│") > 3 and "gpu" in line}
    assert "83% of 1.2M" in rows["gpu0"] and " - " in rows["gpu1"] and "N/A" in rows["h2.gpu0"]


def test_status_shows_per_server_what_runs_what_waits_in_its_queue_and_what_regen_holds_for_it():
    from rich.console import Console

    from console.commands.status import render_status

    workers = [WorkerEvent(name="gpu0", state="ready", running_reqs=96, queued_reqs=3, in_flight=99, capacity=120,
                           held=40),
               WorkerEvent(name="gpu1", state="ready", running_reqs=90, queued_reqs=0, in_flight=90, capacity=120)]
    status = RunStatus.from_dict({"run_dir": "/r", "state": "running", "workers": [w.to_dict() for w in workers]})
    assert [(w["running_reqs"], w["queued_reqs"], w["held"]) for w in status.to_dict()["workers"]] == [
        (96, 3, 40), (90, 0, 0)]  # --json
    console = Console(width=240, record=True)
    console.print(render_status(status))
    rows = {line.split("│")[1].strip(): line for line in console.export_text().splitlines()
            if line.count("│") > 3 and "gpu" in line}
    assert "│ 96 " in rows["gpu0"] and "3 +40 held" in rows["gpu0"] and "99/120" in rows["gpu0"]
    assert "held" not in rows["gpu1"]
