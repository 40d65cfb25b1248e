"""A run behind SGLang's real router (sglang-router) starts without false retries: dispatch waits until the router
lists the servers it was given (POST /workers is queued: the router lists a server about a second later, and until then
answers 503 "No available workers"), and a 503 of a router with no server listed is no attempt of the sample."""
from __future__ import annotations

import json
import sys

import pytest

from engine.config import Host, Router
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
