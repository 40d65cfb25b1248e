"""A server regen did not launch must never become a worker (issue 13, seen case 1).

Another SGLang-like server (the simulator, started outside regen) holds a worker's port. The worker
is refused with one critical alert naming the port, the holder's pid and command line and the
remedy; nothing is sent to the other server and nothing is committed while it holds the port; once
it is stopped the worker launches its own server and the run completes, every sample once."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import urllib.error
import urllib.request

import aiohttp
import pytest

from engine.config.load import SIMULATOR_LAUNCH, RunConfig
from engine.api.events import AlertEvent, WorkerEvent
from engine.api.wire import WorkerState
from engine.servers.identity_record import IdentityRecord
from engine.servers.launch import worker_specs
from engine.servers.workers import Worker
from tests.run_helpers import REPO, events, make_config, read_rows, sample_accounting, wait_for
from tests.run_helpers import renderer_for, supervisors  # noqa: F401  (fixtures)
from tests.waiting import await_until

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
    record = IdentityRecord.from_json((run_dir / "workers" / "gpu0" / "identity.json").read_text())
    assert record.state == "refused" and record.pid is None and f"pid {foreign.pid}" in record.error

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


# -- the port taken after regen checked it was free ---------------------------------------------------
GRABBER = REPO / "tests" / "port_grabber.py"


def grabbing_config(run_dir: Path, model: Path, mode: str, state: Path, **workers) -> RunConfig:
    """A one-GPU run whose launch command lets tests/port_grabber.py take the port first (see there)."""
    state.mkdir(parents=True, exist_ok=True)
    cfg = make_config(run_dir, model, prompts=40, gpus=1)
    launch = f"{{python}} {shlex.quote(str(GRABBER))} {mode} {shlex.quote(str(state))} -- {SIMULATOR_LAUNCH}"
    return cfg.model_copy(update=dict(workers=cfg.workers.model_copy(update=dict(launch=launch, **workers))))


def holder_pid(state: Path) -> int:
    return int(wait_for(lambda: (state / "holder.pid").exists() and (state / "holder.pid").read_text().strip(),
                        60, "the grabber's holder.pid"))


def kill_pid(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the holder leads its own session
    except ProcessLookupError:
        return  # already gone


@pytest.fixture
def grabbed():
    states: list[Path] = []
    yield states.append
    for state in states:
        if (state / "holder.pid").exists():
            kill_pid(int((state / "holder.pid").read_text()))


class WorkerRun:
    """One Worker in this process (no supervisor), its telemetry collected."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.events: list[object] = []

    async def __aenter__(self) -> "WorkerRun":
        self.session = aiohttp.ClientSession()
        self.worker = Worker(spec=worker_specs(self.cfg)[0], cfg=self.cfg, run_dir=Path(self.cfg.run_dir),
                             session=self.session, emit=self.events.append)
        self.worker.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.worker.stop()
        await self.session.close()

    async def wait(self, predicate, timeout: float, what: str) -> None:
        await await_until(predicate, timeout, what, interval=0.1,
                          describe=lambda: f"worker {self.worker.state}: {self.worker.error}")

    def alerts(self, key: str) -> list[AlertEvent]:
        return [e for e in self.events if isinstance(e, AlertEvent) and e.key == f"worker:gpu0:{key}"]

    def states(self) -> list[str]:
        return [e.state for e in self.events if isinstance(e, WorkerEvent)]


@pytest.mark.slow
async def test_a_port_taken_between_the_check_and_the_bind_is_diagnosed_with_its_holder(
        tmp_path, tiny_model_dir, grabbed):
    state = tmp_path / "grab"
    grabbed(state)
    cfg = grabbing_config(tmp_path / "run", tiny_model_dir, "socket", state)
    async with WorkerRun(cfg) as run:
        await run.wait(lambda: run.worker.state == WorkerState.REFUSED, 90, "refused after the bind failure")
        holder = holder_pid(state)
        [alert] = run.alerts("refused")
        assert alert.severity == "critical"
        assert (f"worker gpu0 refused: port {cfg.workers.base_port} on 127.0.0.1 was taken before the server could "
                f"bind it (") in alert.text and "[Errno 98]" in alert.text
        assert f"it is held by pid {holder} (" in alert.text and "workers.base_port" in alert.text
        assert run.alerts("crash") == [] and run.worker.restarts == 0, "a taken port is not a crash of the server"
        kill_pid(holder)
        await run.wait(lambda: run.worker.state == WorkerState.READY, 90, "ready once the holder is gone")
        assert run.alerts("refused")[-1].severity == "info"
        assert "ready" not in run.states()[:run.states().index("refused")]
        # what a multi-host dispatch host reads before admitting this server to its router
        record = IdentityRecord.from_json((Path(cfg.run_dir) / "workers" / "gpu0" / "identity.json").read_text())
        assert record.state == "ready" and record.pid == run.worker.pid
        assert record.served_model_name.startswith("regen-run-gpu0-")


@pytest.mark.slow
async def test_a_launch_that_drops_regens_served_name_is_never_ready(tmp_path, tiny_model_dir, grabbed):
    cfg = grabbing_config(tmp_path / "run", tiny_model_dir, "drop-name", tmp_path / "grab", max_restarts=0)
    async with WorkerRun(cfg) as run:
        await run.wait(lambda: run.worker.state == WorkerState.FAILED, 90, "failed")
        assert "ready" not in run.states()
        [crash] = run.alerts("crash")
        assert "crashed" in crash.text
        error = next(e.error for e in run.events if isinstance(e, WorkerEvent) and e.state == "crashed")
        assert f"serves port {cfg.workers.base_port} on 127.0.0.1 but answers as '{tiny_model_dir}'" in error
        assert "the launch command (workers.launch) must pass regen's --served-model-name on to SGLang" in error


@pytest.mark.slow
def test_a_server_that_takes_the_port_after_the_check_is_refused_and_never_gets_work(
        tmp_path, tiny_model_dir, supervisors, renderer_for, grabbed):
    run_dir, state = tmp_path / "run", tmp_path / "grab"
    grabbed(state)
    cfg = grabbing_config(run_dir, tiny_model_dir, "http", state)
    sup = supervisors(run_dir).start(cfg)
    refused = wait_for(lambda: alerts(run_dir, "worker:gpu0:refused"), 90, "the refused alert", sup)
    holder = holder_pid(state)
    text = refused[0]["text"]
    assert refused[0]["severity"] == "critical"
    assert f"worker gpu0 refused: port {cfg.workers.base_port} on 127.0.0.1 is served by pid {holder} (" in text
    assert "not by the server regen launched (pid " in text
    assert "answers as 'grabbed-after-the-check', expected 'regen-run-gpu0-" in text
    assert "stop that process, or set workers.base_port in run.toml to a free range" in text
    assert f"holder pid: {holder}" in refused[0]["evidence"]
    holder_log = state / "holder.log"
    time_refused = time.monotonic()
    wait_for(lambda: time.monotonic() - time_refused > 3, 10, "three seconds of refusal", sup)
    assert "ready" not in worker_states(run_dir, "gpu0") and read_rows(run_dir) == []
    assert regen_requests(holder_log) == 0
    kill_pid(holder)
    assert sup.wait(180) == 0, sup.log_text()[-3000:]
    acc = sample_accounting(run_dir, cfg, renderer_for(cfg))
    assert acc["lost"] == 0 and acc["duplicated"] == 0 and acc["committed"] > 0, acc
    assert regen_requests(holder_log) == 0
