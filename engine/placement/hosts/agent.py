"""`python -m engine.placement.hosts.agent --work-dir D --host-name H`: the SGLang servers of one host of a
multi-host run, supervised with the same Worker code as a one-host run.

Started detached by the dispatch host (engine/placement/hosts/link.py) in D, where host.toml holds this
host's [workers]. It launches one server per GPU group, restarts crashed ones (pid files and
logs under D/workers/<name>/), and runs until SIGTERM (`regen stop`, or the run ending), when it
stops its servers. A second agent on the same work dir exits at once with EXIT_LOCKED, so the
dispatch host can start one on every (re)join without checking first. Events go to
D/telemetry.jsonl; the dispatch host watches the servers over HTTP and reads the host's GPU and disk
readings, which the agent keeps in D/host_readings.json (engine/placement/hosts/readings.py).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Callable

import aiohttp
import psutil

from engine.config import ConfigError, load_config
from engine.servers.gpu import GpuSampler
from engine.placement.hosts.link import named_specs
from engine.placement.hosts.readings import Sampler, publish_readings
from engine.telemetry import Telemetry
from engine.servers.workers import Worker

log = logging.getLogger("regen.agent")

EXIT_OK, EXIT_CONFIG, EXIT_LOCKED = 0, 2, 4
PID_FILE = "agent.pid"


def _holder(pid_path: Path) -> int | None:
    """The pid of a live agent holding this work dir, if any."""
    try:
        pid = int(pid_path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    if pid == os.getpid():
        return None
    try:
        cmdline = " ".join(psutil.Process(pid).cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None
    return pid if "engine.placement.hosts.agent" in cmdline else None


async def run_agent(work_dir: Path, host_name: str, sampler: Callable[[], Sampler] = GpuSampler) -> int:
    try:
        cfg = load_config(work_dir / "host.toml")
    except ConfigError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    telemetry = Telemetry(work_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with aiohttp.ClientSession() as session:
        # the same Worker as a one-host run: a busy port or a server that cannot prove it is this launch is
        # refused here, and its identity.json tells the dispatch host (engine/placement/hosts/link.py) not to admit it
        workers = [Worker(spec=s, cfg=cfg, run_dir=work_dir, session=session, emit=telemetry.emit, host_name=host_name)
                   for s in named_specs(cfg.workers, host_name)]
        for w in workers:
            w.start()
        log.info("host agent %s: %d servers: %s", host_name, len(workers),
                 ", ".join(f"{w.name} on :{w.spec.port}" for w in workers))
        gpus = sampler()
        if gpus.init_error:
            log.warning("%s (this host's GPU readings will show N/A)", gpus.init_error)
        readings = asyncio.create_task(publish_readings(work_dir, host_name, gpus, stop), name="host-readings")
        readings.add_done_callback(_readings_ended)
        await stop.wait()
        log.info("stopping %d servers", len(workers))
        await asyncio.gather(*(w.stop() for w in workers), readings, return_exceptions=True)
        gpus.close()
    telemetry.close()
    return EXIT_OK


def _readings_ended(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the host readings stopped (the dispatch host shows them as stale)", exc_info=task.exception())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.placement.hosts.agent", description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--host-name", required=True)
    args = parser.parse_args(argv)
    work_dir = Path(args.work_dir).expanduser().resolve()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pid_path = work_dir / PID_FILE
    holder = _holder(pid_path)
    if holder is not None:
        log.info("an agent (pid %d) already runs on %s: leaving it", holder, work_dir)
        return EXIT_LOCKED
    pid_path.write_text(f"{os.getpid()}\n")
    try:
        return asyncio.run(run_agent(work_dir, args.host_name))
    finally:
        try:
            if pid_path.read_text().strip() == str(os.getpid()):
                pid_path.unlink()
        except FileNotFoundError:
            pass  # removed by hand: nothing to release


if __name__ == "__main__":
    sys.exit(main())
