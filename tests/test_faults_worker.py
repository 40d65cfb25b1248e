"""Faults of one SGLang worker: SIGKILL of the simulator process, a hang (port open, nothing answers),
and a CUDA OOM logged before exit. Each time: detected, restarted and ready again, its in-flight
samples re-dispatched, and every sample present exactly once at the end."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.run_helpers import events, make_config, quick_state, record_figures, sample_accounting, wait_for
from tests.run_helpers import renderer_for, supervisors  # noqa: F401  (fixtures)

SLOW_ANSWERS = ("--sim-output-mean", "80", "--sim-step-ms", "6", "--max-running-requests", "8")


def _worker_events(evs: list[dict], name: str) -> list[dict]:
    return [e for e in evs if e["type"] == "worker" and e["name"] == name]


def _recovery(evs: list[dict], name: str, since: float) -> tuple[dict, dict]:
    """The first crashed event of `name` at or after `since` and the first ready event after it."""
    ws = _worker_events(evs, name)
    crashed = next(e for e in ws if e["ts"] >= since and e["state"] == "crashed")
    ready = next(e for e in ws if e["ts"] > crashed["ts"] and e["state"] == "ready")
    return crashed, ready


def _requeued(log_text: str, name: str) -> int:
    """In-flight requests of `name` sent again: failed on the lost connection (retry lines) or
    cancelled and re-queued at the worker's state change. A streamed answer cut by the crash reads
    as ClientPayloadError; one the dying scheduler refused as HTTP 503."""
    retried = len(re.findall(rf"retry \d+ of \S+: {name}: (?:ServerDisconnectedError|ClientOSError|"
                             rf"ClientConnectorError|TimeoutError|ClientPayloadError|HTTP 503)", log_text))
    return retried + sum(int(m) for m in re.findall(rf"worker {name} \w+: re-queued (\d+) in-flight", log_text))


def _committed(run_dir) -> int:
    from engine.api.control_socket import request

    try:
        reply = request(run_dir / "control.sock", {"op": "status"}, timeout=5)
    except OSError:
        return 0
    return ((reply.get("result") or {}).get("dispatch") or {}).get("done", 0)


def _finish_and_account(sup, run_dir, cfg, renderer_for) -> dict:
    assert sup.wait(180) == 0, sup.log_text()[-3000:]
    acc = sample_accounting(run_dir, cfg, renderer_for(cfg))
    assert acc["lost"] == 0, acc["lost_ids"]
    assert acc["duplicated"] == 0 and acc["unreadable_parts"] == 0
    assert acc["failed_after_retries"] == 0
    return acc


@pytest.mark.slow
def test_sigkill_of_a_worker_is_detected_restarted_and_requeued(tmp_path, tiny_model_dir, supervisors,
                                                                renderer_for):
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=80, gpus=1, sim=SLOW_ANSWERS)
    sup = supervisors(run_dir).start(cfg)
    wait_for(lambda: quick_state(run_dir) == "running" and _committed(run_dir) >= 10, 90, "10 samples done", sup)
    pid = int((run_dir / "workers" / "gpu0" / "server.pid").read_text())
    killed_at = time.time()
    os.killpg(pid, signal.SIGKILL)
    acc = _finish_and_account(sup, run_dir, cfg, renderer_for)
    evs = events(run_dir)
    crashed, ready = _recovery(evs, "gpu0", killed_at)
    assert "signal 9" in crashed["error"]
    alert = next(e for e in evs if e["type"] == "alert" and e["key"] == "worker:gpu0:crash" and e["ts"] >= killed_at)
    assert "crashed (signal 9)" in alert["text"]
    requeued = _requeued(sup.log_text(), "gpu0")
    record_figures("worker_sigkill", faults_injected=1, survived=1, detection_s=round(crashed["ts"] - killed_at, 2),
                   ready_again_s=round(ready["ts"] - killed_at, 2), in_flight_requeued=requeued,
                   samples_lost=acc["lost"], samples_duplicated=acc["duplicated"],
                   parts_unreadable=acc["unreadable_parts"], samples_committed=acc["committed"])
    assert requeued > 0, "the killed worker had requests in flight; none were re-queued"


@pytest.mark.slow
def test_hung_worker_is_detected_killed_restarted_and_requeued(tmp_path, tiny_model_dir, supervisors, renderer_for):
    run_dir = tmp_path / "run"
    # 60 answers take ~3.6 s at 8 in flight: at least one 2 s /metrics scrape and telemetry tick see the worker
    # answering before it hangs (with 25, a fast start could hang it before the first tick)
    cfg = make_config(run_dir, tiny_model_dir, prompts=100, gpus=1, sim=SLOW_ANSWERS + ("--sim-hang-after", "60"))
    cfg = cfg.model_copy(update=dict(
        workers=cfg.workers.model_copy(update=dict(health_timeout_s=2.0, health_failures=2)),
        dispatch=cfg.dispatch.model_copy(update=dict(request_timeout_s=300.0))))
    sup = supervisors(run_dir).start(cfg)
    acc = _finish_and_account(sup, run_dir, cfg, renderer_for)
    evs = events(run_dir)
    hung = next(e for e in evs if e["type"] == "alert" and e["key"] == "worker:gpu0:hung")
    # the hang starts after the last /metrics scrape that answered (running_reqs known)
    ws = _worker_events(evs, "gpu0")
    answered = [e for e in ws if e["ts"] < hung["ts"] and e["running_reqs"] is not None]
    # no answered scrape before the hang (a very slow machine): measure from the worker's first ready instead
    reference = answered[-1] if answered else next(e for e in ws if e["state"] == "ready")
    crashed, ready = _recovery(evs, "gpu0", hung["ts"])
    requeued = _requeued(sup.log_text(), "gpu0")
    hangs = sum(1 for e in evs if e["type"] == "alert" and e["key"] == "worker:gpu0:hung")
    record_figures("worker_hang", faults_injected=hangs, survived=1,
                   detection_s=round(hung["ts"] - reference["ts"], 2),
                   detection_note=("from the last answered /metrics scrape" if answered else "from the worker's ready")
                   + " to the hung alert (health_timeout_s=2, health_failures=2)",
                   ready_again_s=round(ready["ts"] - hung["ts"], 2), in_flight_requeued=requeued,
                   samples_lost=acc["lost"], samples_duplicated=acc["duplicated"],
                   parts_unreadable=acc["unreadable_parts"], samples_committed=acc["committed"])
    assert "hung: /health failed 2 times" in hung["evidence"]
    assert requeued > 0


@pytest.mark.slow
def test_oom_is_reported_with_the_log_line_and_recovered(tmp_path, tiny_model_dir, supervisors, renderer_for):
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=60, gpus=1, sim=SLOW_ANSWERS + ("--sim-oom-after", "30"))
    sup = supervisors(run_dir).start(cfg)
    acc = _finish_and_account(sup, run_dir, cfg, renderer_for)
    evs = events(run_dir)
    alert = next(e for e in evs if e["type"] == "alert" and e["key"] == "worker:gpu0:crash")
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in alert["evidence"]
    assert "crashed (exit code 1)" in alert["text"]
    crashed, ready = _recovery(evs, "gpu0", 0.0)
    log_text = (run_dir / "workers" / "gpu0" / "server.log").read_text()
    stamp = re.search(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\][^\n]*Received sigquit", log_text)
    oom_at = time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")) if stamp else None
    requeued = _requeued(sup.log_text(), "gpu0")
    ooms = sum(1 for e in evs if e["type"] == "alert" and e["key"] == "worker:gpu0:crash")
    record_figures("worker_oom", faults_injected=ooms, survived=1,
                   detection_s=round(crashed["ts"] - oom_at, 2) if oom_at else None,
                   detection_note="from the SGLang sigquit log line (1 s resolution) to the crashed state",
                   ready_again_s=round(ready["ts"] - crashed["ts"], 2), in_flight_requeued=requeued,
                   alert_quotes_oom_line=True, samples_lost=acc["lost"], samples_duplicated=acc["duplicated"],
                   parts_unreadable=acc["unreadable_parts"], samples_committed=acc["committed"])
    assert requeued > 0
