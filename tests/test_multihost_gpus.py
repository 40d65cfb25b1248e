"""Every host's GPUs and disks in a multi-host run (tests/netns_hosts.py hosts): each remote row carries what that
host's own agent read (its NVML's error where it has no GPU, its figures where it has), shown under the host's
name by `regen status` and the console; a host that is cut off goes N/A with why, not frozen. Each host's servers
start at the run's --schedule-conservativeness (the pilot's choice in the run dir), shown per server."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from console.view.model import RunModel
from tests.test_engine_run import REPO, status, supervisors, wait_for  # noqa: F401  (fixture)
from tests.test_multihost import multihost_config, regen_cli, sim_hosts  # noqa: F401  (fixture)
from engine.api.status import RunStatus
from tests.test_tuning_config import pilot_record

pytestmark = [pytest.mark.sshd, pytest.mark.timeout(420)]

H1_ERROR = "no NVIDIA driver on h1 (the test's stand-in NVML)"
H2_GPU = {"name": "NVIDIA H200 (h2 stand-in)", "used_mb": 71_000, "total_mb": 143_771, "util": 87, "temp_c": 66,
          "power_w": 612}


def fake_nvml(work_dir: Path, spec: dict) -> None:
    """The host agent (cwd: its work dir) imports this pynvml instead of the machine's."""
    work_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(__file__).with_name("fake_pynvml.py"), work_dir / "pynvml.py")
    (work_dir / "fake_nvml.json").write_text(json.dumps(spec))


def by_host(st: dict | None, kind: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for ev in (st or {}).get(kind) or []:
        out.setdefault(ev.get("host", ""), []).append(ev)
    return out


def test_each_hosts_gpus_and_disks_come_from_its_own_agent(tmp_path, tiny_model_dir, sim_hosts, supervisors):
    cfg = multihost_config(tmp_path, tiny_model_dir, sim_hosts, prompts=300, names=["h1", "h2"], gpus=1,
                           sim=("--sim-output-mean", "200", "--max-running-requests", "4", "--sim-step-ms", "80",
                                "--sim-tokens-per-step", "2"))
    h1, h2 = sim_hosts.host("h1"), sim_hosts.host("h2")
    fake_nvml(h1.work_dir, {"error": H1_ERROR})
    fake_nvml(h2.work_dir, {"gpus": [H2_GPU]})
    run_dir = tmp_path / "run"
    pilot_record(cfg, 0.3)  # `regen plan --pilot` chose 0.3 for this run
    sup = supervisors(run_dir).start(cfg)

    def readings() -> dict | None:
        st = status(run_dir)
        gpus, disks = by_host(st, "gpus"), by_host(st, "disk")
        ok = (any(g.get("error") == f"NVML unavailable: NVMLError: {H1_ERROR}" for g in gpus.get("h1", []))
              and any(g.get("mem_used_mb") for g in gpus.get("h2", [])) and "h1" in disks and "h2" in disks
              and any(w["host"] == "h2" and w["state"] == "ready" for w in st["workers"]))
        return st if ok else None

    st = wait_for(readings, 180, "both hosts' agents' GPU and disk readings, and h2's server ready", sup)
    wait_for(lambda: all(w.get("conservativeness") is not None for w in status(run_dir)["workers"]), 60,
             "each server's --schedule-conservativeness from its agent's identity record", sup)
    gpus, disks = by_host(st, "gpus"), by_host(st, "disk")
    # h1: N/A with h1's own NVML error (the dispatch host's NVML, if it has none, fails differently)
    assert [(g["index"], g["mem_used_mb"]) for g in gpus["h1"]] == [(0, None)]
    assert all(H1_ERROR not in (g.get("error") or "") for g in gpus.get("", []))
    # h2: the figures its agent read
    [g2] = gpus["h2"]
    assert (g2["name"], g2["mem_used_mb"], g2["mem_total_mb"], g2["util_pct"], g2["temp_c"], g2["power_w"]) == (
        H2_GPU["name"], 71_000, 143_771, 87, 66, 612)
    # disks: each agent's work dir (and /dev/shm), with that filesystem's figures
    for h in (h1, h2):
        rows = {d["path"]: d for d in disks[h.name]}
        assert set(rows) == {str(h.work_dir.resolve()), "/dev/shm"}, rows
        fs = os.statvfs(h.work_dir)
        assert rows[str(h.work_dir.resolve())]["total_bytes"] == fs.f_frsize * fs.f_blocks
        assert rows[str(h.work_dir.resolve())]["error"] is None

    # the console: h2's worker row has h2's VRAM; h1's is N/A (h1's NVML), not the dispatch host's GPU 0
    m = RunModel()
    m.apply_status(RunStatus.from_dict(st))
    assert m.worker_gpu(m.workers["h2.gpu0"])["mem_used_mb"] == 71_000
    assert m.worker_gpu(m.workers["h1.gpu0"])["mem_used_mb"] is None
    assert m.gpus[("h1", 0)].error.endswith(H1_ERROR) and m.gpus[("h2", 0)].label == "h2/gpu0"

    # regen status, text and --json, grouped by host
    (run_dir / ".regen").mkdir(exist_ok=True)
    (run_dir / ".regen" / "launch.json").write_text(json.dumps({"host_python": sys.executable,
                                                                 "engine_path": str(REPO), "run_dir": str(run_dir)}))
    shown = regen_cli("status", "local", "--run-dir", str(run_dir))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert any("GPUs (by host)" in line for line in lines), shown.stdout
    h1_row = next(line for line in lines if line.strip("│┃ ").startswith("h1 ") and H1_ERROR in line)
    assert "N/A" in h1_row
    h2_row = next(line for line in lines if line.strip("│┃ ").startswith("h2 ") and "71000/143771" in line)
    assert "87%" in h2_row and "66C" in h2_row
    assert f"disk h2:{h2.work_dir.resolve()}: " in shown.stdout
    as_json = json.loads(regen_cli("status", "local", "--run-dir", str(run_dir), "--json").stdout)
    assert {g["host"] for g in as_json["gpus"]} >= {"h1", "h2"}
    # the pilot's choice reached each host's agent: its server was launched with it, and its row says so
    assert [(w["name"], w["conservativeness"], w["conservativeness_source"]) for w in as_json["workers"]] == [
        ("h1.gpu0", 0.3, "pilot"), ("h2.gpu0", 0.3, "pilot")], as_json["workers"]
    launch = next(line for line in (h2.work_dir / "workers" / "h2.gpu0" / "server.log").read_text().splitlines()
                  if "launching:" in line)
    assert "--schedule-conservativeness 0.3" in launch, launch
    assert "--schedule-conservativeness: 0.3 (pilot) on every server" in shown.stdout, shown.stdout

    # h2 cut off: its GPU and disks go N/A with why, not its last figures
    sim_hosts.cut("h2")

    def h2_na() -> dict | None:
        st = status(run_dir)
        gpus = by_host(st, "gpus").get("h2") or [{}]
        return st if all(g.get("mem_used_mb") is None and (g.get("error") or "").startswith("no reading from h2: ")
                         for g in gpus) else None

    st = wait_for(h2_na, 90, "h2's GPU N/A once h2 is cut off", sup)
    assert all(d["error"] and d["error"].startswith("no reading from h2: ") for d in by_host(st, "disk")["h2"])
    why = by_host(st, "gpus")["h2"][0]["error"]
    # the link's loss or the failed fetch, whichever the loaded machine saw first; with when the last reading came
    assert "(last reading " in why and "\n" not in why, why
    assert by_host(st, "gpus")["h1"][0]["error"].endswith(H1_ERROR)  # h1's still flow
    stopped = regen_cli("stop", "local", "--run-dir", str(run_dir))
    assert stopped.returncode == 0, stopped.stderr
