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


def test_the_shared_cluster_is_handed_to_the_next_test_as_it_was_started(shared_slurm):
    """A test's jobs, a drained node and a changed partition limit are undone when it hands the cluster back."""
    from tests.waiting import wait_until

    cluster = shared_slurm.lend(1)
    job = cluster.run("sbatch", "--parsable", "--gres=gpu:4", "--wrap", "sleep 600").stdout.strip()
    wait_until(lambda: cluster.run("squeue", "-h", "-j", job, "-o", "%T").stdout.strip() == "RUNNING", 30, "it running")
    cluster.run("scontrol", "update", "nodename=n1", "state=drain", "reason=regen-test")
    cluster.run("scontrol", "update", "PartitionName=gpu", "MaxTime=20")
    shared_slurm.give_back(1)
    assert cluster.jobs() == [] and cluster.node_states() == {"n1": "idle"}
    assert "MaxTime=UNLIMITED" in cluster.run("scontrol", "show", "partition", "gpu").stdout
    assert shared_slurm.lend(1) is cluster


def test_a_shared_cluster_that_cannot_be_reset_fails_the_test_and_is_replaced(shared_slurm):
    cluster = shared_slurm.lend(1)
    cluster.kill_slurmd("n1")
    with pytest.raises(RuntimeError, match=r"the shared 1-node Slurm cluster could not be reset after this test "
                                           r"\(closed; the next test starts another\): a daemon exited: .*slurmd"):
        shared_slurm.give_back(1)
    assert not cluster.processes  # closed
    fresh = shared_slurm.lend(1)
    assert fresh is not cluster and fresh.node_states() == {"n1": "idle"}
