"""SGLang server simulator: SGLang's HTTP protocol, log lines and continuous batching, without GPUs.

Plays one SGLang version (`--sim-sglang-version`, profiles.py); one process per node rank (dist.py).
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
