"""`python -m engine.placement.slurm.step --work-dir W --group G`: one node's part of a regen Slurm job (the srun step).

It makes the job's own dir (W/g<G>/job-<id>[.r<restart>]), writes there host.toml bound to this node's address, a copy
of the group's tuning record (where its servers start) and node.json (where the login node finds the servers), then
runs the host agent until Slurm ends the step. In a group of several nodes a rank > 0 waits for rank 0's node.json and
runs its own agent in the job dir's rank<I>/. A life of the job that a later one superseded (requeued) stops its agent.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from engine.placement.hosts import agent as host_agent
from engine.config.load import ConfigError, dump_toml, load_config
from engine.servers.ranks import DistInitAddr
from engine.servers.launch import SLURM_GPUS_VAR
from engine.servers.tuning_record import RECORD_FILE

NODE_FILE = "node.json"
EXIT_NOT_IN_SLURM = 2
EXIT_NO_HEAD = 3
HEAD_WAIT_S = 120.0  # a rank > 0 waits this long for rank 0's node.json (the shared dir may lag)
SUPERSEDED_FILE = "superseded.txt"
LIFE_CHECK_S = 1.0  # how often a job life looks for a later one (end_when_superseded)


def node_address(node: str) -> str:
    """The address other hosts reach this node at: its name resolved, unless that is a loopback alias (Debian's
    127.0.1.1 for its own hostname), then the address of the interface that routes to the controller."""
    try:
        address = socket.gethostbyname(node)
    except OSError:
        address = ""
    if address and not address.startswith("127."):
        return address
    launcher = os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "")
    if launcher and not launcher.startswith("127."):
        return launcher
    return address or "127.0.0.1"


def group_dir(work_dir: Path, group: int) -> Path:
    return work_dir / f"g{group}"


def job_dir(work_dir: Path, group: int, job_id: str, restarts: int = 0) -> Path:
    """One life of a job: a requeued job (preempted, its node failed, `scontrol requeue`) keeps its id and runs
    again with SLURM_RESTART_COUNT=N, in a dir of its own (job-<id>.r<N>): the login node never mistakes the last
    life's node.json, pid files or records for this one's."""
    return group_dir(work_dir, group) / (f"job-{job_id}" if restarts == 0 else f"job-{job_id}.r{restarts}")


def rank_dir(here: Path, node_rank: int) -> Path:
    """Where a node's agent runs: rank 0 (and a one-node group) in the job's dir, a rank > 0 under it."""
    return here if node_rank == 0 else here / f"rank{node_rank}"


def later_life(work_dir: Path, group: int, job_id: str, restarts: int) -> Path | None:
    """The dir of a later life of this job (Slurm requeued it: this life's node was set down, it was preempted), or
    None while this life is the job's last."""
    for life in group_dir(work_dir, group).glob(f"job-{job_id}.r*"):
        n = life.name.rpartition(".r")[2]
        if n.isdigit() and int(n) > restarts:
            return life
    return None


def end_when_superseded(here: Path, work_dir: Path, group: int, job_id: str, restarts: int) -> None:
    """SIGTERM this step (its agent stops its servers) once a later life of the job exists, saying why in
    <here>/SUPERSEDED_FILE (the step's stderr may have no srun left to reach). Slurm kills a life's processes itself,
    except on a node whose slurmd stopped answering: there they run on, and a rank > 0 there would join the next
    life's server (same head node, same dist-init port) in place of that life's own rank."""
    def watch() -> None:
        while (life := later_life(work_dir, group, job_id, restarts)) is None:
            time.sleep(LIFE_CHECK_S)
        said = (f"regen slurm step: job {job_id} runs again in {life} (Slurm requeued it): this life (restart "
                f"{restarts}) stops its servers")
        (here / SUPERSEDED_FILE).write_text(said + "\n")
        print(said, file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="job-life", daemon=True).start()


def wait_for_head(here: Path, timeout_s: float = HEAD_WAIT_S) -> dict | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return json.loads((here / NODE_FILE).read_text())
        except (FileNotFoundError, ValueError):
            time.sleep(0.2)  # not written yet (no event to wait on across nodes: the shared dir is all there is)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.placement.slurm.step", description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--dist-init-port", type=int, default=None,
                        help="the group is one server across its nodes: rank 0 waits for the others on this port")
    parser.add_argument("--base-port", type=int, default=None,
                        help="the group's second port block (a job taking over while the last one drains)")
    args = parser.parse_args(argv)
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        print("regen slurm step: SLURM_JOB_ID is not set: this runs inside a Slurm job step (srun), started by "
              "`regen start` with [slurm]", file=sys.stderr)
        return EXIT_NOT_IN_SLURM
    nnodes = int(os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_NNODES") or "1")
    node_rank = int(os.environ.get("SLURM_NODEID") or "0")
    if nnodes > 1 and args.dist_init_port is None:
        print(f"regen slurm step: this step has {nnodes} nodes but no --dist-init-port: a group of several nodes is "
              "one server across them; submit it with the srun line `regen plan` prints", file=sys.stderr)
        return EXIT_NOT_IN_SLURM
    work_dir = Path(args.work_dir)
    restart_count = os.environ.get("SLURM_RESTART_COUNT", "")
    restarts = int(restart_count) if restart_count.isdigit() else 0
    job_here = job_dir(work_dir, args.group, job_id, restarts)
    here = rank_dir(job_here, node_rank)
    here.mkdir(parents=True, exist_ok=True)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    name = os.environ.get("SLURM_JOB_NAME") or f"g{args.group}"
    try:
        cfg = load_config(group_dir(work_dir, args.group) / "host.toml")
    except ConfigError as exc:
        print(f"regen slurm step: {exc}", file=sys.stderr)
        return host_agent.EXIT_CONFIG
    address = node_address(node)
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES") or os.environ.get("SLURM_STEP_GPUS") or ""
    os.environ[SLURM_GPUS_VAR] = gpus
    ports = {"base_port": args.base_port} if args.base_port is not None else {}
    node_cfg = cfg.model_copy(update={"run_dir": str(here),
                                      "workers": cfg.workers.model_copy(update={"host": address, **ports})})
    (here / "host.toml").write_text(dump_toml(node_cfg))
    # where the servers start (the run's pilot choice, each server's last restart): the group's record, as the login
    # node last wrote it, is this job's own from here on (its agent records its restarts' changes in it)
    tuning = group_dir(work_dir, args.group) / RECORD_FILE
    try:
        shutil.copyfile(tuning, here / RECORD_FILE)
    except FileNotFoundError:
        pass  # the run has none: the servers start at SGLang's default or the operator's value
    except OSError as exc:
        print(f"regen slurm step: cannot copy {tuning} into {here}: {exc}; the servers start at SGLang's default "
              "--schedule-conservativeness (their status rows say so)", file=sys.stderr)
    record = {"job": job_id, "restarts": restarts, "node": node, "address": address, "gpus": gpus, "pid": os.getpid()}
    if nnodes > 1:
        record.update(node_rank=node_rank, nnodes=nnodes)
    tmp = here / (NODE_FILE + ".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, here / NODE_FILE)  # whole or absent: the login node and the other ranks read it
    agent = ["--work-dir", str(here), "--host-name", name]
    end_when_superseded(here, work_dir, args.group, job_id, restarts)
    if nnodes > 1:
        if node_rank == 0:
            head_address = address  # the head is this node (its record, just written)
        else:
            head = wait_for_head(job_here)
            if head is None:
                print(f"regen slurm step: node rank {node_rank} on {node}: rank 0 wrote no {job_here / NODE_FILE} "
                      f"within {HEAD_WAIT_S:.0f} s; is {work_dir} shared between the nodes? (see its job-{job_id}.out)",
                      file=sys.stderr)
                return EXIT_NO_HEAD
            head_address = head["address"]
        dist = DistInitAddr(head_address, args.dist_init_port)
        agent += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", str(dist)]
    return host_agent.main(agent)


if __name__ == "__main__":
    sys.exit(main())
