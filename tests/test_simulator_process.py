"""`python -m engine.simulator` as a real process: ready line, exit codes and SGLang's error lines."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.waiting import await_until

pytestmark = pytest.mark.timeout(90)
REPO = Path(__file__).resolve().parents[1]


class SimProcess:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.lines: list[str] = []
        self.port: int | None = None
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                return
            text = line.decode(errors="replace").rstrip("\n")
            self.lines.append(text)
            m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+) ", text)
            if m:
                self.port = int(m.group(1))

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def wait_for_line(self, needle: str, timeout: float = 30) -> None:
        await await_until(lambda: any(needle in line for line in self.lines), timeout, f"the line {needle!r}",
                          stop=lambda: self._reader.done() and "the process ended", describe=lambda: self.log)

    async def wait_exit(self, timeout: float = 30) -> int:
        rc = await asyncio.wait_for(self.proc.wait(), timeout)
        await self._reader
        return rc


@pytest.fixture
async def launch(tiny_model_dir):
    procs: list[SimProcess] = []

    async def start(*args: str) -> SimProcess:
        env = dict(os.environ, PYTHONPATH=str(REPO), TRANSFORMERS_VERBOSITY="error")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "engine.simulator", "--model-path", str(tiny_model_dir), "--port", "0",
            "--sim-step-ms", "2", "--sim-output-mean", "40", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env, cwd=str(REPO))
        sim = SimProcess(proc)
        procs.append(sim)
        return sim

    yield start
    for sim in procs:
        if sim.proc.returncode is None:
            sim.proc.kill()
            await sim.proc.wait()
        sim._reader.cancel()


async def running_requests(url: str) -> float:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("sglang:num_running_reqs"))


async def generate(url: str, payload: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/generate", json=payload, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)


async def test_cli_ready_line_serves_and_drains_on_sigterm(launch):
    sim = await launch("--enable-metrics", "--trust-remote-code", "--sim-load-s", "0.5")
    await sim.wait_for_line("Uvicorn running on")
    await sim.wait_for_line("The server is fired up and ready to roll!")
    assert "ignoring SGLang flag(s) it does not model: --trust-remote-code" in sim.log
    status, out = await generate(sim.url, {"text": "hello", "sampling_params": {"max_new_tokens": 1000}})
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "stop"
    assert re.search(r'INFO:     127\.0\.0\.1:\d+ - "POST /generate HTTP/1\.1" 200', sim.log)

    slow = asyncio.create_task(generate(sim.url, {"text": "slow", "sampling_params": {
        "max_new_tokens": 1500, "ignore_eos": True}}))
    await sim.wait_for_line("#new-token")
    await await_until(lambda: running_requests(sim.url), 10, "the slow request running (its /metrics say so)")
    sim.proc.send_signal(signal.SIGTERM)
    await sim.wait_for_line("Draining requests and shutting down...")
    async with aiohttp.ClientSession() as session:  # draining: /health is 503 at once ...
        async with session.get(sim.url + "/health") as resp:
            assert resp.status == 503
    # ... while /generate still serves, new requests included (contract 7.4)
    status, late = await generate(sim.url, {"text": "late", "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
    assert status == 200 and late["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert not slow.done()
    status, out = await slow  # in flight at SIGTERM: still answered
    assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 1500}
    assert await sim.wait_exit() == -signal.SIGKILL  # SGLang kills its own process tree when drained
    assert "SIGTERM received. signum=15, frame=None. Draining requests and shutting down..." in sim.log


async def test_crash_after_exits_1_with_scheduler_traceback(launch):
    sim = await launch("--sim-crash-after", "2")
    await sim.wait_for_line("The server is fired up and ready to roll!")
    for i in range(2):
        status, _ = await generate(sim.url, {"rid": f"c{i}", "text": "x", "sampling_params": {"max_new_tokens": 500}})
        assert status == 200
    assert await sim.wait_exit() == 1
    assert re.search(r"^\[[\d\- :]+\] Scheduler hit an exception: Traceback \(most recent call last\):$", sim.log,
                     re.M)
    assert "RuntimeError: CUDA error: an illegal memory access was encountered" in sim.log
    assert "SIGQUIT received. signum=None, frame=None. It usually means one child failed." in sim.log


async def test_oom_after_exits_1_with_cuda_oom_text(launch):
    sim = await launch("--sim-oom-after", "1")
    await sim.wait_for_line("The server is fired up and ready to roll!")
    await generate(sim.url, {"text": "x", "sampling_params": {"max_new_tokens": 500}})
    assert await sim.wait_exit() == 1
    assert "Scheduler hit an exception: Traceback (most recent call last):" in sim.log
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB." in sim.log
    assert "Received sigquit from a child process. It usually means the child failed." in sim.log
    assert sim.log.index("Scheduler hit an exception") < sim.log.index("Received sigquit")


async def test_busy_port_fails_with_errno_98_and_exit_1(launch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        sim = await launch("--port", str(port))
        assert await sim.wait_exit() == 1
    assert (f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
            "address already in use") in sim.log
    assert "The server is fired up" not in sim.log


async def test_api_key_never_printed_by_the_process(launch):
    secret = "sk-process-secret-9876"
    sim = await launch("--api-key", secret)
    await sim.wait_for_line("The server is fired up and ready to roll!")
    status, body = await generate(sim.url, {"text": "x"})
    assert (status, body) == (401, {"error": "Unauthorized"})
    status, _ = await generate(sim.url, {"text": "x"}, headers={"Authorization": f"Bearer {secret}"})
    assert status == 200
    sim.proc.send_signal(signal.SIGTERM)
    assert await sim.wait_exit() == -signal.SIGKILL
    assert secret not in sim.log and "server_args=ServerArgs(" in sim.log


async def test_weights_that_leave_no_kv_room_fail_at_start_with_not_enough_memory(launch):
    sim = await launch("--sim-gpu-mem-gb", "48")  # the tiny model's config is a 27B's: 57 GB of weights at TP 1
    assert await sim.wait_exit() == 1
    assert "Scheduler hit an exception: Traceback (most recent call last):" in sim.log
    assert ("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: "
            "self.server_args.mem_fraction_static=0.88") in sim.log
    assert "Received sigquit from a child process. It usually means the child failed." in sim.log
    assert "Uvicorn running" not in sim.log
