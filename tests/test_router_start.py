"""A run behind SGLang's real router (sglang-router) starts without false retries: dispatch waits until the router
lists the servers it was given (POST /workers is queued: the router lists a server about a second later, and until then
answers 503 "No available workers"), and a 503 of a router with no server listed is no attempt of the sample."""
from __future__ import annotations

import json
import sys

import pytest

from engine.config.load import Host, Router
from tests.sshd_fixtures import free_port
from tests.test_engine_run import make_config, supervisors, wait_for  # noqa: F401

pytestmark = pytest.mark.timeout(120)


def test_a_start_behind_the_router_retries_nothing(tmp_path, tiny_model_dir, supervisors):  # noqa: F811
    cfg = make_config(tmp_path / "run", tiny_model_dir, prompts=60, gpus=2,
                      sim=("--sim-output-mean", "40", "--max-running-requests", "8", "--sim-step-ms", "20"))
    cfg = cfg.model_copy(update=dict(
        hosts=(Host(name="here", address="local", gpus=(0, 1), tp_size=1, host_python=sys.executable),),
        router=Router(policy="round_robin", port=free_port(), prometheus_port=free_port(), python=sys.executable)))
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(100) == 0, sup.log_text()[-4000:]
    log = (run_dir / "supervisor.log").read_text()
    assert "No available workers" not in log, [line for line in log.splitlines() if "No available" in line][:5]
    assert " retry " not in log, [line for line in log.splitlines() if " retry " in line][:5]
    assert "router endpoint: starting -> ready" in log and "router: routes to " in log, log[-3000:]
    dispatch = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()
                if '"dispatch"' in line]
    final = [e for e in dispatch if e["type"] == "dispatch"][-1]
    assert (final["retried"], final["failed"], final["done"]) == (0, 0, final["total"]), final


@pytest.mark.sshd
def test_a_multihost_start_retries_nothing_and_each_remote_server_has_its_pid(tmp_path, tiny_model_dir, supervisors):  # noqa: F811
    """Two SSH hosts (loopback sshd, tests/netns_hosts.py) behind the router: the start retries nothing, and each
    remote server shows its host agent's pid; under round_robin the router keeps no count per server, so a server's
    in-flight figure is not known (None, said so) while the router's own row has what is open through it."""
    from tests.netns_hosts import start_hosts
    from tests.sshd_fixtures import find_sshd
    from tests.test_engine_run import status
    from tests.test_multihost import multihost_config

    if find_sshd() is None:
        pytest.skip("sshd not installed (apt-get install openssh-server)")
    hosts = start_hosts(tmp_path / "hosts", 2, force_loopback=True)
    try:
        cfg = multihost_config(tmp_path, tiny_model_dir, hosts, prompts=80, gpus=1,
                               sim=("--sim-output-mean", "120", "--max-running-requests", "4", "--sim-step-ms", "40"))
        run_dir = tmp_path / "run"
        sup = supervisors(run_dir).start(cfg)
        st = wait_for(lambda: (lambda s: s if s and s.get("router", {}).get("in_flight", 0) > 0 and all(
            w["state"] == "ready" for w in s["workers"]) else None)(status(run_dir)), 120,
            "both servers ready, requests open through the router", sup)
        for w in st["workers"]:
            assert w["remote"] and isinstance(w["pid"], int) and w["pid"] > 0, w  # not N/A: the agent's launch
            assert (w["in_flight"], w["in_flight_source"]) == (None, "unknown"), w  # not 0: not known
        assert sup.wait(150) == 0, sup.log_text()[-4000:]
        log = (run_dir / "supervisor.log").read_text()
        assert "No available workers" not in log and " retry " not in log, [
            line for line in log.splitlines() if " retry " in line or "No available" in line][:5]
        final = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()
                 if '"type": "dispatch"' in line or '"type":"dispatch"' in line][-1]
        assert (final["retried"], final["failed"]) == (0, 0), final
    finally:
        hosts.close()
