"""The Slurm test cluster itself (tests/slurm_fixtures.py): nodes come up idle with their fake GPUs,
a job step sees the GPUs it asked for, and nothing is left running after the cluster is closed."""
from __future__ import annotations

import pytest

from tests.slurm_fixtures import require_slurm, start_slurm

pytestmark = pytest.mark.slurm


def test_one_node_runs_a_gpu_step(slurm):
    assert slurm.node_states() == {"n1": "idle"}
    r = slurm.run("srun", "-p", slurm.partition, "--gres=gpu:2", "-t", "1", "sh", "-c",
                  "echo $CUDA_VISIBLE_DEVICES $SLURM_GPUS_ON_NODE")
    assert r.stdout.split() == ["0,1", "2"]
    refused = slurm.run("srun", "-p", slurm.partition, "--gres=gpu:5", "-t", "1", "true", check=False)
    assert refused.returncode != 0 and "Requested node configuration is not available" in refused.stderr


def test_three_nodes_each_its_own_name_and_address(tmp_path):
    require_slurm()
    cluster = start_slurm(tmp_path / "slurm", 3)
    try:
        assert cluster.node_states() == {"n1": "idle", "n2": "idle", "n3": "idle"}
        r = cluster.run("srun", "-N", "3", "--ntasks-per-node=1", "-t", "1", "sh", "-c", "echo $SLURMD_NODENAME $(hostname)")
        lines = sorted(r.stdout.splitlines())
        assert [line.split()[0] for line in lines] == ["n1", "n2", "n3"]
        if cluster.mode == "netns":
            assert [line.split()[1] for line in lines] == ["n1", "n2", "n3"]
    finally:
        cluster.close()
    assert not [p for p in __import__("psutil").process_iter(["cmdline"])
                if str(cluster.root) in " ".join(p.info["cmdline"] or [])]
