"""A server regen did not launch must never become a worker (issue 13, seen case 1).

Another SGLang-like server (the simulator, started outside regen) holds a worker's port. The worker
is refused with one critical alert naming the port, the holder's pid and command line and the
remedy; nothing is sent to the other server and nothing is committed while it holds the port; once
it is stopped the worker launches its own server and the run completes, every sample once."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import urllib.error
import urllib.request

import pytest

from tests.run_helpers import REPO, events, make_config, read_rows, sample_accounting, wait_for
from tests.run_helpers import renderer_for, supervisors  # noqa: F401  (fixtures)

FOREIGN_NAME = "someone-elses-model"
FOREIGN_SIM = ("--sim-step-ms", "2", "--sim-output-mean", "24", "--enable-metrics")


def start_foreign_server(model: Path, port: int, log_path: Path) -> subprocess.Popen:
    """A simulator on `port`, started as an operator's other job would be: not by regen."""
    argv = [sys.executable, "-m", "engine.simulator", "--model-path", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", FOREIGN_NAME, *FOREIGN_SIM]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True)
    wait_for(lambda: _healthy(port) or proc.poll() is not None, 60, f"the foreign server on :{port}")
    assert proc.poll() is None, log_path.read_text()
    return proc


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False  # not listening yet, or 503 while it warms up


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def regen_requests(log_path: Path) -> int:
    """/generate requests the foreign server answered for a client (its own warmup logs peer 127.0.0.1:0)."""
    return sum(1 for line in log_path.read_text(errors="replace").splitlines()
               if '"POST /generate' in line and "127.0.0.1:0 " not in line)


def written(run_dir: Path) -> list[dict]:
    """The telemetry events so far ([] before the supervisor opened telemetry.jsonl)."""
    return events(run_dir) if (run_dir / "telemetry.jsonl").exists() else []


def alerts(run_dir: Path, key: str) -> list[dict]:
    return [e for e in written(run_dir) if e["type"] == "alert" and e["key"] == key]


def worker_states(run_dir: Path, name: str) -> list[str]:
    return [e["state"] for e in written(run_dir) if e["type"] == "worker" and e["name"] == name]


@pytest.fixture
def foreign_servers():
    started: list[subprocess.Popen] = []

    def start(model: Path, port: int, log_path: Path) -> subprocess.Popen:
        proc = start_foreign_server(model, port, log_path)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        stop(proc)


@pytest.mark.slow
def test_a_server_already_on_the_port_is_refused_and_the_run_completes_once_it_is_gone(
        tmp_path, tiny_model_dir, supervisors, renderer_for, foreign_servers):
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=40, gpus=1)
    port = cfg.workers.base_port
    foreign_log = tmp_path / "foreign.log"
    foreign = foreign_servers(tiny_model_dir, port, foreign_log)

    sup = supervisors(run_dir).start(cfg)
    refused = wait_for(lambda: alerts(run_dir, "worker:gpu0:refused"), 90, "the refused alert", sup)
    assert len(refused) == 1 and refused[0]["severity"] == "critical"
    shown = refused[0]["text"] + "\n" + refused[0]["evidence"]
    assert f"port {port}" in refused[0]["text"] and f"pid {foreign.pid}" in refused[0]["text"]
    assert "engine.simulator" in shown and f"--served-model-name {FOREIGN_NAME}" in shown  # its command line
    assert "stop that process" in refused[0]["text"] and "workers.base_port" in refused[0]["text"]
    wait_for(lambda: worker_states(run_dir, "gpu0")[-1:] == ["refused"], 30, "gpu0 refused", sup)

    # while it holds the port: nothing is sent to it and nothing is committed
    time_refused = time.monotonic()
    wait_for(lambda: time.monotonic() - time_refused > 3 and worker_states(run_dir, "gpu0")[-1] == "refused",
             30, "three seconds of refusal", sup)
    assert "ready" not in worker_states(run_dir, "gpu0")
    assert read_rows(run_dir) == []
    assert regen_requests(foreign_log) == 0
    assert len(alerts(run_dir, "worker:gpu0:refused")) == 1, "the refusal is alerted once, not on every re-check"

    stop(foreign)
    assert sup.wait(180) == 0, sup.log_text()[-3000:]
    acc = sample_accounting(run_dir, cfg, renderer_for(cfg))
    assert acc["lost"] == 0 and acc["duplicated"] == 0 and acc["committed"] > 0, acc
    assert regen_requests(foreign_log) == 0
    states = worker_states(run_dir, "gpu0")
    assert states.index("ready") > states.index("refused")
    cleared = alerts(run_dir, "worker:gpu0:refused")[-1]
    assert cleared["severity"] == "info" and f"port {port} on 127.0.0.1 is free again" in cleared["text"]
    assert {r["worker"] for r in read_rows(run_dir)} == {"gpu0"}
