"""`regen probe` with [slurm], against the real Slurm test cluster: Slurm's commands present, the partition has
nodes with the GPUs asked, `sbatch --test-only` accepts the run's job, and the allocation's time limit against the
servers' load time. Each row says what to change when it fails."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from console.cli import main as cli_main
from probes.catalog.slurm import gres_gpus, judge_slurm_submit, slurm_minutes
from probes.catalog.probe import JudgeInput
from probes.context import ProbeContext, SlurmAsk
from probes.model import CommandResult, Status

pytestmark = pytest.mark.slurm


def write_config(tmp_path, tiny_model_dir, **slurm) -> str:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"s{i}", "prompt": f"q {i}"}) + "\n" for i in range(5)))
    keys = {"partition": "gpu", "gpus_per_node": 4, "time_limit": "30", "handover_s": 60, **slurm}
    path = tmp_path / "run.toml"
    path.write_text(f"""
run_dir = {json.dumps(str(tmp_path / 'run'))}
model = {json.dumps(str(tiny_model_dir))}
prompts = [{json.dumps(str(prompts))}]
host_python = {json.dumps(sys.executable)}
[workers]
tp_size = 2
ready_timeout_s = 60
[slurm]
""" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
    return str(path)


def probe(capsys, path: str) -> dict[str, dict]:
    code = cli_main(["probe", "local", "--config", path, "--only", "slurm", "--json"])
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)["probes"]}
    rows["exit"] = code
    return rows


def test_a_run_the_cluster_can_take_passes_every_slurm_probe(slurm, tmp_path, tiny_model_dir, capsys):
    rows = probe(capsys, write_config(tmp_path, tiny_model_dir))
    assert {k: rows[k]["status"] for k in ("slurm.commands", "slurm.partition", "slurm.submit", "slurm.time_limit")} \
        == dict.fromkeys(("slurm.commands", "slurm.partition", "slurm.submit", "slurm.time_limit"), "PASS"), rows
    assert rows["slurm.commands"]["summary"] == "slurm-wlm 22.05.8"
    assert rows["slurm.partition"]["summary"] == "gpu: 1 node(s) up with >= 4 GPUs (the run needs 1); time limit infinite"
    assert "to start at" in rows["slurm.submit"]["summary"] and "--test-only" in rows["slurm.submit"]["command"]
    assert rows["exit"] == 0
    # the full probe of a [slurm] run is the login node's: no GPU probe there
    assert cli_main(["probe", "local", "--config", write_config(tmp_path, tiny_model_dir), "--json"]) in (0, 1)
    ids = {r["id"] for r in json.loads(capsys.readouterr().out)["probes"]}
    assert {"slurm.submit", "router.package", "prompts.paths"} <= ids and not {i for i in ids if i.startswith("gpu")}


def test_more_gpus_than_a_node_has_fails_with_what_the_nodes_have(slurm, tmp_path, tiny_model_dir, capsys):
    rows = probe(capsys, write_config(tmp_path, tiny_model_dir, gpus_per_node=8))
    part, submit = rows["slurm.partition"], rows["slurm.submit"]
    assert part["status"] == "FAIL" and "its nodes have at most 4 GPUs" in part["summary"]
    assert "lower slurm.gpus_per_node to 4" in part["remedy"]
    assert submit["status"] == "FAIL" and "Requested node configuration is not available" in submit["summary"]
    assert "slurm.gpus_per_node" in submit["remedy"] and rows["exit"] == 1


def test_an_unknown_partition_or_feature_is_named_with_the_fix(slurm, tmp_path, tiny_model_dir, capsys):
    rows = probe(capsys, write_config(tmp_path, tiny_model_dir, partition="a100"))
    assert rows["slurm.partition"]["status"] == "FAIL"
    assert rows["slurm.partition"]["summary"] == "partition 'a100' not found; the cluster has: gpu, urgent"
    assert "Invalid partition name specified" in rows["slurm.submit"]["summary"]
    assert rows["slurm.submit"]["remedy"].startswith("set slurm.partition")
    rows = probe(capsys, write_config(tmp_path, tiny_model_dir, constraint="h100"))
    assert "have feature h100" in rows["slurm.partition"]["summary"]
    assert "Invalid feature specification" in rows["slurm.submit"]["summary"]
    assert "slurm.constraint" in rows["slurm.submit"]["remedy"]


def test_a_time_limit_above_the_partitions_fails_and_a_short_one_warns(slurm, tmp_path, tiny_model_dir, capsys):
    slurm.run("scontrol", "update", "PartitionName=gpu", "MaxTime=20")
    rows = probe(capsys, write_config(tmp_path, tiny_model_dir))
    assert rows["slurm.partition"]["status"] == "FAIL"
    assert "slurm.time_limit 30 is above partition gpu's limit 20:00" in rows["slurm.partition"]["summary"]
    assert "lower slurm.time_limit to 20:00" in rows["slurm.partition"]["remedy"]
    rows = probe(capsys, write_config(tmp_path, tiny_model_dir, time_limit="2", handover_s=60))
    assert rows["slurm.time_limit"]["status"] == "PASS"  # 60 s serving, servers loading within 60 s
    rows = probe(capsys, write_config(tmp_path, tiny_model_dir, time_limit="1:30", handover_s=60))
    assert rows["slurm.time_limit"]["status"] == "WARN", rows["slurm.time_limit"]
    assert "an allocation serves for 30 s but a server may take up to 60 s" in rows["slurm.time_limit"]["summary"]
    # time_min: backfill may start a job with that limit, the shortest allocation is the one judged
    rows = probe(capsys, write_config(tmp_path, tiny_model_dir, time_limit="20", time_min="1:30", handover_s=60))
    assert rows["slurm.time_limit"]["status"] == "WARN", rows["slurm.time_limit"]
    assert "an allocation serves for 30 s" in rows["slurm.time_limit"]["summary"]
    assert rows["slurm.time_limit"]["remedy"].startswith("raise slurm.time_min ")


def test_no_slurm_on_path_fails_the_first_row_and_skips_the_rest(tmp_path, tiny_model_dir, capsys, monkeypatch):
    bin_dir = tmp_path / "bin"  # the usual tools without Slurm's (/bin is /usr/bin here, with Slurm in it)
    bin_dir.mkdir()
    for tool in ("id", "uname", "df", "cat"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.path.dirname(sys.executable)}")
    rows = probe(capsys, write_config(tmp_path, tiny_model_dir))
    assert rows["slurm.commands"]["status"] == "FAIL"
    assert rows["slurm.commands"]["summary"].startswith("sinfo, sbatch, srun, squeue, scancel not found on PATH")
    assert "login node" in rows["slurm.commands"]["remedy"]
    assert {rows[k]["status"] for k in ("slurm.partition", "slurm.submit", "slurm.time_limit")} == {"SKIP"}


@pytest.mark.parametrize("said,fix", [
    ("sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
     "slurm.account"),
    ("sbatch: error: Batch job submission failed: Invalid qos specification", "slurm.qos"),
    ("sbatch: error: Batch job submission failed: Requested time limit is invalid (missing or exceeds some limit)",
     "slurm.time_limit"),
])
def test_refusals_a_cluster_with_accounting_gives_name_the_key(said, fix):
    """This cluster runs without accounting (no slurmdbd), so it takes any account and qos: these are the words
    sbatch 22.05 prints where accounting refuses them."""
    ask = SlurmAsk(partition="gpu", gpus_per_node=4, nodes=1, nodes_per_job=1, time_limit="30", time_limit_s=1800,
                   handover_s=60, ready_timeout_s=60, test_command="sbatch --test-only ...")
    v = judge_slurm_submit(CommandResult("sbatch --test-only ...", 1, "", said + "\n", 0.1),
                           JudgeInput(ProbeContext(slurm=ask), {}))
    assert v.status is Status.FAIL and said in v.summary and fix in v.remedy


def test_sinfo_fields_are_read_as_slurm_writes_them():
    assert [gres_gpus(g) for g in ("gpu:4", "gpu:h100:8(S:0-1)", "gpu:a100:2,shard:4", "(null)")] == [4, 8, 2, 0]
    assert [slurm_minutes(t) for t in ("infinite", "1-00:00:00", "4:00:00", "30:00")] == [None, 86400, 14400, 1800]
