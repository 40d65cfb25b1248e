"""A [[hosts]] entry whose every server crashes at once (a 27B model's weights on one 48 GB GPU: SGLang's "Not enough
memory") is told to the operator with its servers' own words: a critical alert and a `failed` host while the other
host finishes the run; and when it is the only host, the run ends with a fatal record naming it."""
from __future__ import annotations

import json
import sys

import pytest

from engine.config.load import Host, Router
from tests.netns_hosts import start_hosts
from tests.sshd_fixtures import find_sshd, free_port, free_port_base
from tests.test_engine_run import (REPO, ctl, expected_samples, make_config, read_rows, renderer_for,  # noqa: F401
                                   status, supervisors, wait_for)
from tests.test_multihost import events, regen_cli

pytestmark = pytest.mark.timeout(240)
NO_ROOM = "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."


@pytest.fixture
def two_hosts(tmp_path):
    if find_sshd() is None:
        pytest.skip("sshd not installed (apt-get install openssh-server)")
    hosts = start_hosts(tmp_path / "hosts", 2, force_loopback=True)
    yield hosts
    hosts.close()


def config(tmp_path, tiny_model_dir, hosts, tp: dict[str, int], prompts: int, sim: tuple = ()):
    """Hosts of 48 GB GPUs: TP 2 holds the model, TP 1 cannot; a crashed server is given up after one restart."""
    cfg = make_config(tmp_path / "run", tiny_model_dir, prompts=prompts, sim=("--sim-gpu-mem-gb", "48", *sim))
    return cfg.model_copy(update=dict(
        workers=cfg.workers.model_copy(update=dict(max_restarts=1)),
        hosts=tuple(Host(name=h.name, address=h.address, gpus=tuple(range(tp[h.name])), tp_size=tp[h.name],
                         work_dir=str(h.work_dir), host_python=sys.executable, base_port=h.base_port,
                         ssh_options=("-F", str(hosts.ssh_config))) for h in hosts.hosts if h.name in tp),
        router=Router(policy="round_robin", port=free_port(), prometheus_port=free_port(), python=sys.executable,
                      forward_base_port=free_port_base(sum(tp.values())), host_lost_after_s=4.0)))


def status_json(run_dir, code: int = 0) -> dict:
    (run_dir / ".regen").mkdir(exist_ok=True)  # as `regen start` records it: this checkout's engine and python
    (run_dir / ".regen" / "launch.json").write_text(json.dumps({"host_python": sys.executable,
                                                                 "engine_path": str(REPO), "run_dir": str(run_dir)}))
    shown = regen_cli("status", "local", "--run-dir", str(run_dir), "--json")
    assert shown.returncode == code, shown.stderr
    return json.loads(shown.stdout)


@pytest.mark.sshd
@pytest.mark.slow  # ~30 s: two hosts, h2 crashes twice, then the run finishes on h1
def test_a_host_whose_servers_all_fail_is_alerted_and_the_run_goes_on(tmp_path, tiny_model_dir, two_hosts,
                                                                        supervisors, renderer_for):  # noqa: F811
    cfg = config(tmp_path, tiny_model_dir, two_hosts, {"h1": 2, "h2": 1}, prompts=30,
                 sim=("--sim-step-ms", "20", "--max-running-requests", "8", "--sim-output-mean", "80"))
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    # held from the start (paused once the ledger is open), so that it still runs when h2 has failed
    wait_for(lambda: ctl(run_dir, "pause", "--all").returncode == 0, 60, "the run paused", sup)
    alert = wait_for(lambda: (run_dir / "telemetry.jsonl").exists() and next(
        (e for e in events(run_dir) if e["type"] == "alert" and e.get("key") == "host-failed:h2"), None),
        120, "the host-failed alert", sup)
    assert alert["severity"] == "critical" and "the run goes on with h1" in alert["text"]
    assert NO_ROOM in alert["evidence"] and "h2.gpu0" in alert["evidence"]
    assert f"log: h2:{two_hosts.host('h2').work_dir}/workers/h2.gpu0/server.log" in alert["evidence"]
    # the server's own alerts, from the agent's records: each of its two crashes told (the agent's count says the
    # one it relaunched before a read, merged with the next if both fell between two reads), then the failure
    crashes = [e["text"] for e in events(run_dir) if e["type"] == "alert" and e.get("key") == "worker:h2.gpu0:crash"]
    assert sum(2 if "(2 crashes since the last one told)" in t else 1 for t in crashes) == 2, crashes
    failed = next(e for e in events(run_dir) if e["type"] == "alert" and e.get("key") == "worker:h2.gpu0:failed")
    assert failed["severity"] == "critical" and NO_ROOM in failed["evidence"]

    st = status_json(run_dir)
    assert st["running"] and "hosts" in st, st
    hosts = {h["name"]: h for h in st["hosts"]}
    assert hosts["h2"]["state"] == "failed" and "Not enough memory" in hosts["h2"]["error"]
    assert hosts["h1"]["state"] == "up"
    h2_server = next(w for w in st["workers"] if w["name"] == "h2.gpu0")
    assert h2_server["state"] == "failed" and "Not enough memory" in h2_server["error"]

    assert ctl(run_dir, "resume", "--all").returncode == 0
    assert sup.wait(180) == 0, sup.log_text()[-4000:]
    rows = read_rows(run_dir)
    expected, _ = expected_samples(cfg, renderer_for(cfg))
    rejected = sum(1 for line in (run_dir / "rejects.jsonl").read_text().splitlines()
                   if json.loads(line)["reason"].startswith("turn "))
    assert len({r["sample_id"] for r in rows}) == len(rows) and len(rows) + rejected == len(expected)


@pytest.mark.sshd
def test_when_no_host_can_serve_the_run_ends_with_the_hosts_last_words(tmp_path, tiny_model_dir, two_hosts,
                                                                         supervisors):  # noqa: F811
    cfg = config(tmp_path, tiny_model_dir, two_hosts, {"h1": 1}, prompts=10)
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(120) == 1, sup.log_text()[-4000:]
    fatal = json.loads((run_dir / "fatal.json").read_text())
    assert fatal["exc_type"] == "HostsFailed"
    assert "every server of every host failed: host h1: h1.gpu0: exit code 1: RuntimeError: Not enough memory" \
        in fatal["message"] and "(log h1:" in fatal["message"]
    assert "Not enough memory" in fatal["message"]
    assert "read each host's server logs" in fatal["remedy"]
    alerts = [e for e in events(run_dir) if e["type"] == "alert" and e.get("key") == "host-failed:h1"]
    assert alerts and "no host is left to serve" in alerts[0]["text"]

    st = status_json(run_dir, code=3)  # the run failed, its cause recorded
    assert st["state"] == "failed"
    assert st["fatal"]["exc_type"] == "HostsFailed" and "Not enough memory" in st["fatal"]["message"]


def test_a_local_host_whose_servers_all_fail_ends_the_run_the_same_way(tmp_path, tiny_model_dir,
                                                                       supervisors):  # noqa: F811
    cfg = make_config(tmp_path / "run", tiny_model_dir, prompts=10, sim=("--sim-gpu-mem-gb", "48"))
    cfg = cfg.model_copy(update=dict(
        workers=cfg.workers.model_copy(update=dict(max_restarts=0)),
        hosts=(Host(name="here", address="local", gpus=(0,), tp_size=1, host_python=sys.executable),),
        router=Router(policy="round_robin", port=free_port(), prometheus_port=free_port(), python=sys.executable)))
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(120) == 1, sup.log_text()[-4000:]
    fatal = json.loads((run_dir / "fatal.json").read_text())
    assert fatal["exc_type"] == "HostsFailed" and fatal["path"] == str(run_dir / "workers")
    assert "host here: here.gpu0: exit code 1: RuntimeError: Not enough memory" in fatal["message"]
    assert f"(log {run_dir / 'workers' / 'here.gpu0' / 'server.log'})" in fatal["message"]
