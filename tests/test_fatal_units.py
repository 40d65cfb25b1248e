"""The pieces that make a supervisor say why it died: the fatal record (what, where, remedy), where it is kept
(also on a full disk), logging and telemetry that degrade instead of crashing, the start checks, and how the
console folds and words a run that is not running."""
from __future__ import annotations

import errno
import json
import logging
import os
import sqlite3
from pathlib import Path

import pytest

from console.view.cause import not_running_lines
from console.commands.status_text import EXIT_NOT_RUNNING, EXIT_RUN_FAILED, exit_code_of, progress_line
from console.view.model import RunModel
from engine.config.load import ConfigError
from engine.fatal import (FATAL_FILE, PREVIOUS_FILE, SpaceReserve, WorkersFailed, archive_previous, fallback_path,
                          is_disk_full, read_fatal, record_for, write_fatal)
from engine.api.status import FatalRecord, RunStatus
from engine.text.row_errors import PromptFileError
from engine.text.render import RenderError
from engine.store.run_dir import ConfigChanged
from engine.safe_log import ResilientHandler
from engine.servers.startup import StartupChecks, open_prompt_files
from engine.telemetry import Telemetry
from engine.api.events import AlertEvent, DispatchEvent, FatalEvent, RunEndEvent, WorkerEvent, parse_event


# -- the record ------------------------------------------------------------------------------------
def test_record_names_type_message_path_and_remedy(tmp_path):
    missing = tmp_path / "data" / "chat.jsonl"
    try:
        open(missing)
    except FileNotFoundError as exc:
        err = PromptFileError(str(missing), str(exc))
    r = record_for(err, run_dir=tmp_path, phase="start", exit_code=5)
    assert r.exc_type == "PromptFileError" and r.path == str(missing)
    assert "No such file or directory" in r.message and str(missing) in r.message
    assert "fix `prompts` in run.toml" in r.remedy and "regen start" in r.remedy
    assert r.log == str(tmp_path / "supervisor.log") and r.exit_code == 5 and r.phase == "start"
    ev = r.event()
    assert isinstance(ev, FatalEvent) and parse_event(ev.to_json()) == ev


@pytest.mark.parametrize("exc,path,remedy", [
    (RenderError("tokenizer path /m: [Errno 2] No such file", "/m"), "/m", "set `model`"),
    (ConfigChanged(Path("/r"), [("sampling.temperature", 0.6, 0.9)]), "/r", "revert the changed fields"),
    (ConfigError("workers.gpus: expected a list"), None, "fix the field named above"),
    (WorkersFailed("every worker failed: gpu0: exit code 1", "/r/workers"), "/r/workers", "server logs"),
    (PermissionError(errno.EACCES, "Permission denied", "/p/x"), "/p/x", "give user"),
    (OSError(errno.ENOSPC, "No space left on device", "/r/state.sqlite"), "/r/state.sqlite", "free space"),
    (sqlite3.OperationalError("database or disk is full"), "RUN_DIR", "free space"),  # names no file: the run dir
    (WorkersFailed("every worker failed: gpu0: cannot launch: [Errno 28] No space left on device", "/r/w"), "/r/w",
     "free space"),
    (KeyError("boom"), None, "internal error"),
])
def test_remedy_table(tmp_path, exc, path, remedy):
    r = record_for(exc, run_dir=tmp_path, phase="run", exit_code=1)
    assert r.path == (str(tmp_path) if path == "RUN_DIR" else path) and remedy in r.remedy, r.remedy
    assert r.exc_type == type(exc).__name__ and r.message


def test_disk_full_is_found_through_the_exception_chain():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("commit failed") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)
    assert not is_disk_full(ValueError("x"))


def test_write_is_atomic_read_prefers_newest_and_archive_moves_it(tmp_path):
    r1 = record_for(ValueError("one"), run_dir=tmp_path, phase="start", exit_code=1)
    assert write_fatal(tmp_path, r1) == tmp_path / FATAL_FILE
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert read_fatal(tmp_path).message == "one"
    assert archive_previous(tmp_path).message == "one"
    assert read_fatal(tmp_path) is None
    assert json.loads((tmp_path / PREVIOUS_FILE).read_text())["message"] == "one"


def test_record_goes_to_the_fallback_when_the_run_dir_cannot_take_it(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / FATAL_FILE).mkdir()  # os.replace onto a directory fails: the run dir "cannot take it"
    r = record_for(ValueError("lost?"), run_dir=run_dir, phase="run", exit_code=1)
    try:
        where = write_fatal(run_dir, r)
        assert where == fallback_path(run_dir)
        (run_dir / FATAL_FILE).rmdir()
        assert read_fatal(run_dir).message == "lost?"  # readers look there too
        archive_previous(run_dir)
        assert not fallback_path(run_dir).exists() and read_fatal(run_dir) is None
    finally:
        fallback_path(run_dir).unlink(missing_ok=True)


def test_unreadable_record_is_reported_not_ignored(tmp_path):
    (tmp_path / FATAL_FILE).write_text("{not json")
    r = read_fatal(tmp_path)
    assert r.exc_type == "UnreadableFatalRecord" and str(tmp_path / FATAL_FILE) in r.message


def test_from_dict_keeps_unknown_fields_out():
    r = FatalRecord.from_dict({"exc_type": "X", "message": "m", "future_field": 1})
    assert r.exc_type == "X" and r.path is None
    with pytest.raises(ValueError):
        FatalRecord.from_dict({"message": "no type"})


def test_reserve_is_taken_and_released(tmp_path):
    reserve = SpaceReserve(tmp_path, size=4096)
    assert reserve.take() is None and (tmp_path / "fatal.reserve").stat().st_size == 4096
    assert reserve.release() is None and not (tmp_path / "fatal.reserve").exists()
    assert reserve.release() is None  # twice is fine


# -- logging and telemetry on a failing disk -------------------------------------------------------
class FlakyFd:
    """os.write replacement: fails with ENOSPC while `full`, else appends to `written`."""

    def __init__(self):
        self.full = False
        self.written = b""
        self.fails = 0

    def write(self, fd, data):
        if self.full:
            self.fails += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        self.written += bytes(data)
        return len(data)


def test_resilient_handler_goes_quiet_keeps_records_and_writes_them_when_space_returns(monkeypatch, capfd):
    flaky = FlakyFd()
    monkeypatch.setattr("engine.safe_log.os.write", flaky.write)
    now = [0.0]
    handler = ResilientHandler(99, "/run/supervisor.log", keep=3, retry_s=5.0, clock=lambda: now[0])
    logger = logging.getLogger("test.resilient")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        logger.warning("before")
        flaky.full = True
        for i in range(10):
            logger.error("while full %d", i)
        assert handler.failure and "No space left on device" in handler.failure
        assert flaky.fails <= 2  # the first write, and the one line to stderr (also the fake): no storm
        now[0] = 6.0
        flaky.full = False
        logger.error("after")
        text = flaky.written.decode()
        assert text.startswith("before\nwhile full 0\n")  # the record the first failing write cut, whole
        assert "writing /run/supervisor.log failed from" in text and "No space left on device" in text
        assert "7 log records were dropped" in text  # 10 more records until space returned, the last 3 kept
        assert text.rstrip().endswith("while full 8\nwhile full 9\nafter")
        assert handler.failure is None
    finally:
        logger.removeHandler(handler)
    assert "Logging error" not in capfd.readouterr().err


def test_telemetry_degrades_on_enospc_and_writes_kept_alerts_later(tmp_path, monkeypatch, caplog):
    t = Telemetry(tmp_path)
    real_write = t._f.write
    full = {"on": False}

    def write(data):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(data)

    monkeypatch.setattr(t, "_f", type("F", (), {"write": staticmethod(write), "fileno": t._f.fileno,
                                               "close": t._f.close})())
    t.emit(DispatchEvent(done=1))
    full["on"] = True
    with caplog.at_level(logging.ERROR, logger="regen.telemetry"):
        for i in range(20):
            t.emit(WorkerEvent(name=f"gpu{i}"))
        t.emit(AlertEvent(severity="critical", text="disk low", key="disk-low"))
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1  # once, not per event
    assert t.write_error and t.workers["gpu19"].name == "gpu19"  # the latest state stays in memory
    full["on"] = False
    assert t.flush_kept()
    t.emit(RunEndEvent(state="stopped"))
    t.close()
    kinds = [json.loads(line)["type"] for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert kinds == ["dispatch", "alert", "run_end"]


def test_telemetry_ends_a_torn_line_before_the_next(tmp_path):
    t = Telemetry(tmp_path)
    real = t._f
    calls = {"n": 0}

    class Torn:
        def write(self, data):
            calls["n"] += 1
            if calls["n"] == 1:
                return real.write(data[:10])  # a partial write ...
            if calls["n"] == 2:
                raise OSError(errno.ENOSPC, "No space left on device")  # ... then the disk is full
            return real.write(data)

        def fileno(self):
            return real.fileno()

        def close(self):
            real.close()

    t._f = Torn()
    t.emit(AlertEvent(text="first", key="a"))
    t._next_try = 0.0
    t.emit(AlertEvent(text="second", key="b"))
    t.close()
    lines = (tmp_path / "telemetry.jsonl").read_text().splitlines()
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line)["text"])
        except json.JSONDecodeError:
            continue  # the torn one
    assert parsed == ["first", "second"]


# -- start checks -----------------------------------------------------------------------------------
def test_start_checks_fail_at_the_first_pending(tmp_path):
    s = StartupChecks()
    s.ok("config", "run.toml")
    s.ok("run_dir")
    s.fail_pending("PromptFileError: x")
    states = {c.check: c.state for c in s.in_order()}
    assert states["prompts"] == "failed" and states["tokenizer"] == "pending" and not s.passed
    for name in ("prompts", "tokenizer", "count", "workers"):
        s.ok(name)
    assert s.passed


def test_open_prompt_files_names_the_missing_and_unreadable_file(tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text('{"messages": []}\n')
    assert open_prompt_files([str(good)]).startswith("1 file, ")
    with pytest.raises(PromptFileError) as e:
        open_prompt_files([str(good), str(tmp_path / "missing.jsonl")])
    assert "missing.jsonl" in str(e.value) and "No such file" in str(e.value)


# -- how the console words it -----------------------------------------------------------------------
FATAL = {"exc_type": "PromptFileError", "message": "prompt file /d/c.jsonl: [Errno 2] No such file or directory",
         "path": "/d/c.jsonl", "remedy": "fix `prompts`", "log": "/r/supervisor.log", "phase": "start", "ts": 50.0}


def test_status_words_and_exit_codes_for_runs_that_are_not_running():
    hint = "regen start gpu-box --config run.toml --ssh-config '/home/o/ssh config'"
    failed = RunStatus.from_dict({"state": "failed", "running": False, "fatal": FATAL, "run_dir": "/r dir; x"})
    lines = not_running_lines(failed, hint, "(run.toml: the config the run was started with)")
    assert lines[0] == "failed: PromptFileError: prompt file /d/c.jsonl: [Errno 2] No such file or directory"
    assert lines[1].split() == ["path:", "/d/c.jsonl"] and "fix `prompts`" in lines[2]
    assert lines[-2] == f"  after the fix, start again: {hint}" and lines[-1].startswith("  (run.toml:")
    assert exit_code_of(failed) == EXIT_RUN_FAILED
    stopped = RunStatus.from_dict({"state": "stopped", "running": False, "fatal": None, "run_dir": "/r",
                                   "run_end": {"state": "stopped", "cause": "SIGTERM received"}})
    assert not_running_lines(stopped, "regen start h --config /r/run.toml") == [
        "stopped: SIGTERM received; resume with: regen start h --config /r/run.toml"]
    assert exit_code_of(stopped) == EXIT_NOT_RUNNING
    dead = RunStatus.from_dict({"state": "dead", "running": False, "fatal": None, "run_dir": "/r",
                                "log": "/r/supervisor.log", "log_tail": ["line a", "line b"]})
    text = "\n".join(not_running_lines(dead, "regen start h --config /r/run.toml"))
    assert "supervisor not running (killed? no cause recorded; last log lines of /r/supervisor.log" in text
    assert "| line b" in text and exit_code_of(dead) == EXIT_NOT_RUNNING
    assert exit_code_of(RunStatus(run_dir="/r", state="done", running=False, offline=True)) == 0
    assert exit_code_of(RunStatus(run_dir="/r", state="running")) == 0


def test_progress_line_has_no_rates_for_a_run_that_is_not_running():
    d = DispatchEvent(state="disk_full", done=10, total=20, in_flight=5, tokens_per_s=7904.0, output_tokens=100)
    live = progress_line(d, "disk_full", running=True)
    assert "5 in flight, 7904 tok/s" in live and "ETA unknown" not in live
    dead = progress_line(d, "dead", running=False)
    assert "- in flight, - tok/s" in dead and dead.endswith("ETA -") and "7904" not in dead


def test_tui_model_folds_fatal_and_run_end_then_a_new_supervisor():
    m = RunModel()
    m.apply(DispatchEvent(ts=10, state="running", done=5, total=10, tokens_per_s=500.0, output_tokens=50,
                          in_flight=3))
    assert m.is_running and m.state_text() == "running"
    m.apply(FatalEvent(ts=20, exc_type="OSError", message="[Errno 28] No space left on device", path="/r",
                       remedy="free space", phase="run"))
    m.apply(RunEndEvent(ts=21, state="failed", exit_code=1, cause="OSError: ..."))
    assert not m.is_running and m.state_text() == "failed: OSError: [Errno 28] No space left on device"
    alert = [a for a in m.alerts if a.severity == "critical"][-1]
    assert "supervisor failed: OSError" in alert.text and "remedy: free space" in alert.evidence
    m.apply(DispatchEvent(ts=15, state="running"))  # a backfilled older event: the run stays failed
    assert m.state == "failed" and not m.is_running
    m.apply(DispatchEvent(ts=30, state="starting"))  # a new supervisor's first tick
    assert m.is_running and m.fatal is None and m.state == "starting"


def test_tui_model_offline_status_wins_over_backfilled_history():
    m = RunModel()
    m.apply_status(RunStatus(run_dir="/r", state="dead", running=False, checked_at=100.0))
    m.apply(RunEndEvent(ts=40, state="stopped"))  # an earlier life's end
    m.apply(DispatchEvent(ts=60, state="running", tokens_per_s=900.0))  # the killed life's last tick
    assert m.state == "dead" and not m.is_running
    m.apply_status(RunStatus.from_dict({"run_dir": "/r", "state": "failed", "running": False, "fatal": FATAL,
                                        "checked_at": 101.0}))
    assert m.state_text().startswith("failed: PromptFileError: prompt file /d/c.jsonl")
    m.apply_status(RunStatus(run_dir="/r", state="running", running=True))
    assert m.fatal is None and m.is_running
