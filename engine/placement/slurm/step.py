"""`python -m engine.placement.slurm.step --work-dir W --group G`: one node's part of a regen Slurm job (the srun step).

Run by srun on each node of job `<job_name>-<G>` (engine/placement/slurm/plan.py prints the line). It makes this job's
own work dir W/g<G>/job-<SLURM_JOB_ID> (a new job on another node never meets the last one's pid files), writes
there the group's host.toml (W/g<G>/host.toml, written by the login node's link) with the servers bound to this
node's address, and node.json (job, node, address, GPUs) that tells the login node where the servers are; then it
runs regen's host agent (engine/placement/hosts/agent.py), the same one as on [[hosts]], until Slurm ends the step. The GPUs
are the ids Slurm gave the step (CUDA_VISIBLE_DEVICES): the servers keep the names <host>.gpu0.. whatever ids those
are (engine.servers.workers.visible_gpus).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

from engine.placement.hosts import agent as host_agent
from engine.config import ConfigError, dump_toml, load_config
from engine.servers.workers import SLURM_GPUS_VAR

NODE_FILE = "node.json"
EXIT_NOT_IN_SLURM = 2


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


def job_dir(work_dir: Path, group: int, job_id: str) -> Path:
    return group_dir(work_dir, group) / f"job-{job_id}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.placement.slurm.step", description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--group", type=int, required=True)
    args = parser.parse_args(argv)
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        print("regen slurm step: SLURM_JOB_ID is not set: this runs inside a Slurm job step (srun), started by "
              "`regen start` with [slurm]", file=sys.stderr)
        return EXIT_NOT_IN_SLURM
    if os.environ.get("SLURM_NNODES", "1") != "1":
        print(f"regen slurm step: this job has {os.environ['SLURM_NNODES']} nodes; regen launches servers of one "
              "node each (a server across nodes is not launched yet)", file=sys.stderr)
        return EXIT_NOT_IN_SLURM
    work_dir = Path(args.work_dir)
    here = job_dir(work_dir, args.group, job_id)
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
    node_cfg = cfg.model_copy(update={"run_dir": str(here),
                                      "workers": cfg.workers.model_copy(update={"host": address})})
    (here / "host.toml").write_text(dump_toml(node_cfg))
    (here / NODE_FILE).write_text(json.dumps({"job": job_id, "node": node, "address": address, "gpus": gpus,
                                              "pid": os.getpid()}) + "\n")
    return host_agent.main(["--work-dir", str(here), "--host-name", name])


if __name__ == "__main__":
    sys.exit(main())
