"""A [slurm] run against the real Slurm test cluster (tests/slurm_fixtures.py): the supervisor and the router stay
here (the login node); each server group is a Slurm job whose step runs regen's host agent on its node (a network
namespace). Every sample exactly once (sample ids against the input), the jobs visible in `status`, and stopping
cancels what regen submitted and nothing else."""
from __future__ import annotations

import json
import sys
import tomllib

import pytest

from engine.config import Router, Slurm, config_from_dict, dump_toml
from tests.slurm_fixtures import require_slurm, start_slurm
from tests.sshd_fixtures import free_port
from tests.test_engine_run import (expected_samples, make_config, read_rows, renderer_for, status,  # noqa: F401
                                   supervisors, wait_for)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]


@pytest.fixture
def cluster2(tmp_path, monkeypatch):
    require_slurm()
    cluster = start_slurm(tmp_path / "slurm", 2)
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    try:
        yield cluster
    finally:
        cluster.close()


def slurm_config(tmp_path, tiny_model_dir, *, prompts: int, sim: tuple = (), **slurm):
    cfg = make_config(tmp_path / "run", tiny_model_dir, prompts=prompts, sim=sim)
    cfg = cfg.model_copy(update=dict(
        slurm=Slurm(partition="gpu", nodes=2, gpus_per_node=2, time_limit="10", handover_s=60, **slurm),
        router=Router(policy="round_robin", port=free_port(), prometheus_port=free_port(), python=sys.executable,
                      host_lost_after_s=4.0)))
    doc = tomllib.loads(dump_toml(cfg))
    doc["workers"].pop("gpus")  # derived from [slurm] gpus_per_node
    doc["workers"]["base_port"] = 30000  # every node is its own network namespace
    return config_from_dict(doc)


def test_a_run_across_two_slurm_nodes_every_sample_once(tmp_path, tiny_model_dir, cluster2, supervisors,
                                                        renderer_for):
    cfg = slurm_config(tmp_path, tiny_model_dir, prompts=120, extra_args=("--exclusive",))  # one job per node
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    st = wait_for(lambda: (lambda s: s if s and len((s.get("router") or {}).get("members", [])) == 4 else None)(
        status(run_dir)), 120, "four servers (two per node) in the router", sup)
    jobs = {h["name"]: h["job"] for h in st["hosts"]}
    assert set(jobs) == {"regen-0", "regen-1"} and {j["state"] for j in jobs.values()} == {"RUNNING"}
    assert sorted(j["nodes"] for j in jobs.values()) == ["n1", "n2"]
    assert sup.wait(180) == 0, sup.log_text()[-4000:]
    rows = read_rows(run_dir)
    expected, _ = expected_samples(cfg, renderer_for(cfg))
    ids = [r["sample_id"] for r in rows]
    rejects = [json.loads(line) for line in (run_dir / "rejects.jsonl").read_text().splitlines()]
    rejected = {r["excerpt"] for r in rejects if r["reason"].startswith("turn ")}  # a turn refused: its sample id
    assert len(ids) == len(set(ids)), "a sample was written twice"
    assert set(ids) | rejected == expected and not set(ids) & rejected, "a sample was lost"
    # the run is over: the jobs regen submitted are cancelled, nothing else of the cluster's is touched
    submitted = [json.loads(line)["job"] for line in (run_dir / "slurm" / "jobs.jsonl").read_text().splitlines()]
    assert sorted(submitted) == sorted(j["job_id"] for j in jobs.values())
    wait_for(lambda: not cluster2.run("squeue", "-h", "-o", "%i").stdout.strip(), 30, "the jobs to leave the queue")
