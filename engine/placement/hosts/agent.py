"""`python -m engine.placement.hosts.agent --work-dir D --host-name H`: the SGLang servers of one host of a multi-host
run (or one rank of a multi-node Slurm server), supervised with the same Worker code as a one-host run.

One agent per work dir (a second exits at once with EXIT_LOCKED); it runs until SIGTERM (`--stop WAIT_S` sends it and
waits), stopping its servers; its events go to D/telemetry.jsonl, its host's readings to D/host_readings.json. Its
servers start where D/tuning.json (written by the dispatch host) says, and their restarts' changes are recorded there.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import aiohttp
import psutil

from engine.config.load import ConfigError, RunConfig, load_config
from engine.servers.gpu import GpuSampler
from engine.placement.hosts.deploy import named_specs
from engine.placement.hosts.readings import Sampler, publish_readings
from engine.servers.ranks import DistInitAddr, ServerRank
from engine.telemetry import Telemetry
from engine.servers.launch import WorkerSpec
from engine.servers.tuning import RunTuning, ServerTuner
from engine.servers.workers import Worker

log = logging.getLogger("regen.agent")

EXIT_OK, EXIT_STILL_RUNS, EXIT_CONFIG, EXIT_LOCKED = 0, 1, 2, 4
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


@dataclass(frozen=True)
class NodeRank:
    """This node's place in a server across nodes (the agent's --nnodes/--node-rank/--dist-init-addr)."""
    nnodes: int
    node_rank: int
    dist_init: DistInitAddr


def rank_specs(specs: list[WorkerSpec], node: str, where: NodeRank) -> list[WorkerSpec]:
    """The host's server (one, tp_size the total over the nodes) as this node's rank of it: this node's share of
    its GPUs, the rank's flags; a rank > 0 is named apart (it is never a router member)."""
    out = []
    for s in specs:
        gpus = s.gpus[:len(s.gpus) // where.nnodes]
        rank = ServerRank(server=s.name, node=node, node_rank=where.node_rank, nnodes=where.nnodes, gpus=gpus,
                          dist_init=where.dist_init)
        name = s.name if rank.serves_http else f"{s.name}.rank{where.node_rank}"
        out.append(replace(s, name=name, gpus=gpus, rank=rank))
    return out


def parse_dist_init(text: str) -> DistInitAddr:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--dist-init-addr {text}: give HOST:PORT")
    return DistInitAddr(host.strip("[]"), int(port))


async def run_agent(work_dir: Path, host_name: str, sampler: Callable[[], Sampler] = GpuSampler,
                    where: NodeRank | None = None) -> int:
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
        specs = named_specs(cfg.workers, host_name)
        if where is not None:
            specs = rank_specs(specs, cfg.workers.host, where)
        tuning = agent_tuning(cfg, work_dir)
        workers = [Worker(spec=s, cfg=cfg, run_dir=work_dir, session=session, emit=telemetry.emit, host_name=host_name,
                          tuner=server_tuner(tuning, s)) for s in specs]
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


def agent_tuning(cfg: RunConfig, work_dir: Path) -> RunTuning:
    """The servers' --schedule-conservativeness: from the record the dispatch host wrote beside host.toml (the run's
    pilot choice, each server's last restart), changed at a restart as on one host and recorded there; said in the
    agent's log (the dispatch host shows each server's value from its identity record)."""
    tuning = RunTuning(cfg, work_dir)
    start = tuning.start_alert()
    log.info("%s\n%s", start.text, start.evidence)
    for note in tuning.notes:
        log.warning("%s", note)
    return tuning


def server_tuner(tuning: RunTuning, spec: WorkerSpec) -> ServerTuner:
    """A server's tuner; each rank of a server across nodes starts where the server does, and keeps it at its
    restarts: every rank runs the same scheduler rules, and one rank's agent cannot change the others' within a job."""
    if spec.rank is None:
        return tuning.for_server(spec.name)
    tuner = tuning.for_server(spec.rank.server)
    tuner.held = (f"a server across {spec.rank.nnodes} nodes keeps its value within a job (its ranks' agents "
                  "cannot change it together)")
    return tuner


def _readings_ended(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the host readings stopped (the dispatch host shows them as stale)", exc_info=task.exception())


def stop_holder(work_dir: Path, wait_s: float) -> tuple[int, str]:
    """`--stop`: SIGTERM the agent holding `work_dir` and wait for it to exit (it stops its servers first), so that
    "stopped" means the host's GPUs are free. (exit code, the line said)."""
    pid = _holder(work_dir / PID_FILE)
    if pid is None:
        return EXIT_OK, f"no agent runs in {work_dir}"
    try:
        proc = psutil.Process(pid)
        proc.terminate()
        proc.wait(timeout=wait_s)
    except psutil.NoSuchProcess:
        pass  # it exited between the check and the signal: stopped all the same
    except psutil.TimeoutExpired:
        return EXIT_STILL_RUNS, f"agent pid {pid} in {work_dir} still runs {wait_s:.0f} s after SIGTERM (see its agent.log)"
    except psutil.AccessDenied as exc:
        return EXIT_STILL_RUNS, f"cannot stop agent pid {pid} in {work_dir}: {exc}"
    return EXIT_OK, f"stopped agent pid {pid} in {work_dir} and its servers"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.placement.hosts.agent", description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--host-name")
    parser.add_argument("--stop", type=float, metavar="WAIT_S",
                        help="stop the agent that runs in --work-dir, waiting up to WAIT_S for it and its servers")
    parser.add_argument("--nnodes", type=int, default=1, help="the server spans this many nodes")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank of it (0 serves HTTP)")
    parser.add_argument("--dist-init-addr", default="", help="HOST:PORT where rank 0 waits for the other ranks")
    args = parser.parse_args(argv)
    if args.stop is not None:
        code, said = stop_holder(Path(args.work_dir).expanduser().resolve(), args.stop)
        print(said)
        return code
    if not args.host_name:
        parser.error("--host-name is required to run an agent")
    where = None
    if args.nnodes > 1:
        try:
            where = NodeRank(args.nnodes, args.node_rank, parse_dist_init(args.dist_init_addr))
        except ValueError as exc:
            parser.error(str(exc))
        if not 0 <= args.node_rank < args.nnodes:
            parser.error(f"--node-rank {args.node_rank}: must be in 0..{args.nnodes - 1}")
    work_dir = Path(args.work_dir).expanduser().resolve()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pid_path = work_dir / PID_FILE
    holder = _holder(pid_path)
    if holder is not None:
        log.info("an agent (pid %d) already runs on %s: leaving it", holder, work_dir)
        return EXIT_LOCKED
    pid_path.write_text(f"{os.getpid()}\n")
    try:
        return asyncio.run(run_agent(work_dir, args.host_name, where=where))
    finally:
        try:
            if pid_path.read_text().strip() == str(os.getpid()):
                pid_path.unlink()
        except FileNotFoundError:
            pass  # removed by hand: nothing to release


if __name__ == "__main__":
    sys.exit(main())
