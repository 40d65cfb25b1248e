"""The status of a run whose supervisor is gone, read from its run dir alone (engine.ctl last-status) through
engine.observe.status's one builder, `running: false`; `state` is how it ended: failed (with `fatal`), done / drained
/ stopped (its run_end), or dead (no cause recorded: killed; `log_tail` has supervisor.log's last lines)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import orjson

from engine.api.wire import FINAL_RUN_STATES, AlertLevels, RunState
from engine.fatal import read_fatal
from engine.api.brake import BrakeStatus
from engine.observe.status import build_run_status, levels_of
from engine.api.status import Rejects, RunStatus
from engine.api.events import AlertEvent, DispatchEvent, Event, RunEndEvent, parse_event

LOG_TAIL_LINES = 3
ALERTS_KEPT = 20


class NotARunDir(Exception):
    """Nothing at that path says a run was ever started there."""


def offline_status(run_dir: Path) -> RunStatus:
    from engine.store.rejects import RejectLog, RejectLogError
    from engine.run.counts import counts_from_store
    from engine.store.shard_store import ShardProgress, ShardStore

    fatal = read_fatal(run_dir)
    has_store = (run_dir / "state.sqlite").exists()
    log_path = run_dir / "supervisor.log"
    if not has_store and fatal is None and not log_path.exists():
        raise NotARunDir(f"{run_dir} holds no state.sqlite: not a run dir, or the run never started")
    progress: list[ShardProgress] = []
    read_errors: list[str] = []
    brake, levels = None, AlertLevels()
    raised: list[AlertEvent] = []
    if has_store:
        try:  # a full disk (the reason the run died, perhaps) must not hide its recorded cause
            store = ShardStore(run_dir)
            try:
                progress = store.progress()
                brake, levels = _brake(run_dir, store, read_errors)
                raised = _raised(store, read_errors)
            finally:
                store.close()
        except OSError as exc:
            read_errors.append(f"shard store: {exc}")
    started, dispatch, said, ended = _telemetry(run_dir / "telemetry.jsonl")
    rejects = Rejects()
    if has_store:
        try:
            with RejectLog(run_dir) as log:
                rejects = Rejects(total=log.count, by_reason=log.counts_by_reason())
        except (OSError, RejectLogError) as exc:
            read_errors.append(f"reject log: {exc}")
    last_state = dispatch.state if dispatch is not None else None
    state: str  # a run_end event's word: an unknown one (a newer engine) stays a string
    if fatal is not None:
        state = RunState.FAILED
    elif ended is not None:
        state = ended.state or RunState.STOPPED
    elif last_state in FINAL_RUN_STATES:  # a last dispatch state that was final (before run_end events)
        state = last_state  # a run from before run_end events
    else:
        state = RunState.DEAD
    counts = counts_from_store(progress)
    # the figures are the committed state's, as of now (the last dispatch event may be older: a full disk drops
    # telemetry lines, a kill cuts the last ones; a console folds the backfilled events older than these as history);
    # nothing is in flight without a supervisor, so no rate and no ETA
    return build_run_status(
        run_dir=str(run_dir.resolve()), state=state, shards=counts if (counts or dispatch is not None) else None,
        paused=(p.shard_id for p in progress if p.paused), retried=int(dispatch.retried or 0) if dispatch is not None else 0,
        rejects=rejects, running=False, offline=True,
        fatal=fatal, run_end=ended, last_state=last_state, log=str(log_path),
        log_tail=_log_tail(log_path) if state == RunState.DEAD else [], started_at=started, host=os.uname().nodename,
        alerts=raised, alert_events=said[-ALERTS_KEPT:], read_errors=read_errors, checked_at=time.time(), brake=brake, levels=levels)


def _brake(run_dir: Path, store, read_errors: list[str]) -> tuple[BrakeStatus | None, AlertLevels]:
    """The brake as the next start would load it (the store's record and last samples, run.toml's [brake]), and the
    run's alert levels."""
    from engine.config.load import ConfigError, load_config
    from engine.run.brake import RunBrake

    try:
        cfg = load_config(run_dir / "run.toml")
    except ConfigError as exc:
        read_errors.append(f"run config (for the data-quality brake): {exc}")
        return None, AlertLevels()
    brake = RunBrake(cfg, str(run_dir))
    record, after = store.brake()
    brake.load(record, store.recent_shapes(cfg.brake.window, after))
    return brake.status(), levels_of(cfg)


def _raised(store, read_errors: list[str]) -> list[AlertEvent]:
    """The alerts the run records as raised now (the conditions that held when its last supervisor judged them)."""
    from engine.store.alert_record import raised_alerts_in

    try:
        return raised_alerts_in(store)
    except OSError as exc:
        read_errors.append(f"raised alerts: {exc}")
        return []


def _telemetry(path: Path) -> tuple[float | None, DispatchEvent | None, list[AlertEvent], RunEndEvent | None]:
    """From telemetry.jsonl: the first event's time, the last dispatch event, the alert events said (history), and
    the last run_end when no later supervisor wrote after it."""
    started, dispatch, alerts, run_end, after_end = None, None, [], None, False
    try:
        with open(path, "rb") as f:
            for line in f:
                ev = _event(line)
                if ev is None:
                    continue
                started = started or ev.ts
                if isinstance(ev, RunEndEvent):
                    run_end, after_end = ev, False
                    continue
                after_end = after_end or run_end is not None  # a later supervisor wrote after that end
                if isinstance(ev, DispatchEvent):
                    dispatch = ev
                elif isinstance(ev, AlertEvent):
                    alerts.append(ev)
    except FileNotFoundError:
        pass  # stopped before its first event
    return started, dispatch, alerts, run_end if not after_end else None


def _event(line: bytes) -> Event | None:
    try:
        return parse_event(line)
    except (orjson.JSONDecodeError, ValueError, TypeError, AttributeError):
        return None  # a line cut by a kill or a full disk, or not an event


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
            text = f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return [f"(cannot read {path}: {exc})"]
    return [line for line in text.splitlines() if line.strip()][-lines:]
