"""The SGLang simulator in-process as a pytest fixture: a real aiohttp server on 127.0.0.1."""
from __future__ import annotations

import io

import pytest

from engine.simulator import SimConfig, run_simulator
from engine.simulator.simlog import SimLog


class Sim:
    """A running simulator plus the log lines it printed."""

    def __init__(self, server, err: io.StringIO, out: io.StringIO):
        self.server, self._err, self._out = server, err, out

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def log(self) -> str:
        return self._err.getvalue() + self._out.getvalue()


@pytest.fixture
async def start_sim(tiny_model_dir):
    servers = []

    async def start(*, ready: bool = True, **overrides) -> Sim:
        overrides.setdefault("sim_step_ms", 2.0)
        overrides.setdefault("sim_step_ms_per_req", 0.0)
        overrides.setdefault("sim_output_mean", 60)
        overrides.setdefault("sim_prefill_ms_per_1k", 0.0)
        overrides.setdefault("model_path", str(tiny_model_dir))
        cfg = SimConfig(port=0, **overrides)
        err, out = io.StringIO(), io.StringIO()
        server = await run_simulator(cfg, SimLog(err=err, out=out))
        servers.append(server)
        if ready:
            await server.wait_ready(15)
        return Sim(server, err, out)

    yield start
    for server in servers:
        await server.stop()
