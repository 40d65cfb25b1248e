"""`python -m engine.simulator`: parse SGLang's launch line, run until SIGTERM, exit like SGLang."""
from __future__ import annotations

import asyncio
import signal
import sys

from engine.simulator.config import parse_args
from engine.simulator.server import SimServer, format_exception
from engine.simulator.startup import StartupFailure
from engine.simulator.simlog import SimLog


def throughput(batch: int, *, step_ms: float, step_ms_per_req: float, tokens_per_step: int = 1) -> float:
    """Decode throughput (tokens/s) the simulator is configured for with `batch` running requests."""
    return batch * tokens_per_step / ((step_ms + step_ms_per_req * batch) / 1000.0)


async def _serve(server: SimServer) -> int:
    loop = asyncio.get_running_loop()
    draining: list[asyncio.Task] = []

    def on_signal(signum: int) -> None:
        if draining:  # a second signal: stop now
            server.log.warning("Second termination signal: shutting down without draining.")
            loop.create_task(server.stop())
            return
        draining.append(loop.create_task(server.drain_and_stop(signum)))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await server.start()
    except StartupFailure:  # its lines are logged
        await server.stop()
        return 1
    except OSError as exc:
        if "while attempting to bind" not in str(exc):
            server.log.error(f"Simulator startup failed: {format_exception(exc)}")
        await server.stop()
        return 1
    await server.wait_stopped()
    return server.exit_code or 0


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    cfg.exit_process_on_fault = True
    server = SimServer(cfg, SimLog(cfg.log_level, cfg.log_level_http))
    return asyncio.run(_serve(server))
