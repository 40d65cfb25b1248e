"""SGLang server simulator: rehearsal of the whole regen flow without GPUs.

Speaks SGLang's HTTP protocol (/generate, /v1/chat/completions, /health, /metrics, ...), logs its
startup, ready and error lines, and models continuous batching. With B running requests:

    tokens/s = B * tokens_per_step / ((step_ms + step_ms_per_req * B) / 1000)

One server across nodes is one process per node rank (`--nnodes --node-rank --dist-init-addr`; dist.py).

Plays one real SGLang version (`--sim-sglang-version 0.5.5|0.5.10|0.5.23`, default the newest; profiles.py).

CLI: `python -m engine.simulator --model-path DIR [SGLang flags] [--sim-* knobs]`.
In-process: `server = await run_simulator(SimConfig(model_path=...)); await server.wait_ready()`.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.simulator.cli import main, throughput
    from engine.simulator.config import SimConfig, parse_args
    from engine.simulator.server import SimServer, run_simulator

# imported on first use: the supervisor reads engine.simulator.profiles (a launch's SGLang version) before it
# launches a server, and importing the whole simulator (its app, scheduler, tokenizer) there delayed the launch
_EXPORTS = {"SimConfig": "config", "parse_args": "config", "SimServer": "server", "run_simulator": "server",
            "main": "cli", "throughput": "cli"}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
