"""A rehearsal's simulated GPUs (engine/servers/gpu_sim.py) once their server is gone: released (nothing held, idle),
never an error left on screen by a read the stop cut short."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from engine.servers.gpu_sim import SIM_GPU_PATH, SimGpuReader
from engine.api.wire import WorkerState

READING = [{"index": 0, "name": "simulated H100", "mem_used_mb": 61_000.0, "mem_total_mb": 81_559.0, "util_pct": 97.0}]


@pytest.fixture
async def sim_gpu():
    """A server answering GET /sim/gpu as the simulator does; `hold` makes it wait before answering."""
    state = SimpleNamespace(hold=None)

    async def gpu(request: web.Request) -> web.Response:
        if state.hold is not None:
            await state.hold.wait()
        return web.json_response(READING)

    app = web.Application()
    app.router.add_get(SIM_GPU_PATH, gpu)
    async with TestServer(app, host="127.0.0.1") as server:
        state.url = f"http://127.0.0.1:{server.port}"
        yield state


def worker(url: str) -> SimpleNamespace:
    return SimpleNamespace(name="gpu0", url=url, headers={}, state=WorkerState.READY, spec=SimpleNamespace(gpus=(0,)))


async def test_a_stopped_servers_gpu_reads_released_and_a_read_cut_by_the_stop_is_no_error(sim_gpu):
    w = worker(sim_gpu.url)
    async with aiohttp.ClientSession() as session:
        reader = SimGpuReader(session, lambda: [w])
        await reader.poll()
        [ev] = reader.sample()
        assert (ev.name, ev.mem_used_mb, ev.util_pct, ev.error) == ("simulated H100", 61_000.0, 97.0, None)

        # the stop lands while a reading is on its way: what comes back is not kept, error or not
        sim_gpu.hold = asyncio.Event()
        polling = asyncio.create_task(reader.poll())
        await asyncio.sleep(0)  # the poll has taken the worker as ready
        w.state = WorkerState.STOPPED
        sim_gpu.hold.set()
        await polling
        [ev] = reader.sample()
        assert (ev.name, ev.mem_used_mb, ev.mem_total_mb, ev.util_pct, ev.error) == \
            ("simulated H100", 0.0, 81_559.0, 0.0, None)

        await reader.poll()  # and it stays released, not dropped (the last reading would stay on every screen)
        [again] = reader.sample()
        assert (again.name, again.mem_used_mb, again.mem_total_mb, again.util_pct, again.error) == \
            ("simulated H100", 0.0, 81_559.0, 0.0, None)

        w.state = WorkerState.READY  # restarted: read again
        await reader.poll()
        assert reader.sample()[0].mem_used_mb == 61_000.0


async def test_a_gpu_whose_server_failed_to_answer_then_stopped_reads_released_without_the_error(sim_gpu):
    w = worker("http://127.0.0.1:9")  # nothing listens: an error reading
    async with aiohttp.ClientSession() as session:
        reader = SimGpuReader(session, lambda: [w])
        await reader.poll()
        [ev] = reader.sample()
        assert ev.error and "GET /sim/gpu failed" in ev.error and ev.mem_used_mb is None
        w.state = WorkerState.STOPPED
        await reader.poll()
        [ev] = reader.sample()
        assert (ev.name, ev.mem_used_mb, ev.util_pct, ev.error) == ("simulated", 0.0, 0.0, None)
