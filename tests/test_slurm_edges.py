"""A [slurm] run's edges against the real Slurm test cluster (tests/slurm_fixtures.py), as the operator sees them in
the status: each server behind the router has its pid, node and job and its in-flight count (the router's, under
cache_aware), the start retries nothing, and once the run is done each allocation shows its last Slurm state and
`ended`, not RUNNING; a job lost mid-run (its node set down: NODE_FAIL) keeps no live figure of its servers."""
from __future__ import annotations

import json

import pytest

from engine.ctl import answer
from engine.api.ops import LastStatus
from engine.api.protocol import encode_reply
from tests.test_engine_run import renderer_for, status, supervisors, wait_for  # noqa: F401
from tests.test_slurm_run import alert, every_sample_once, job_of, slurm_config

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]


def cache_aware(cfg):
    """The router's default policy: the one under which it counts the requests open on each server."""
    return cfg.model_copy(update={"router": cfg.router.model_copy(update={"policy": "cache_aware"})})


def last_status(run_dir) -> dict:
    reply = answer(run_dir, LastStatus(), None, 30.0)
    assert reply.ok, reply.error
    return json.loads(encode_reply(reply))["result"]


def test_each_server_has_its_pid_node_job_and_in_flight_and_the_end_is_final(tmp_path, tiny_model_dir, slurm,
                                                                              supervisors, renderer_for):  # noqa: F811
    cfg = cache_aware(slurm_config(tmp_path, tiny_model_dir, prompts=60, nodes=1,
                                   sim=("--sim-step-ms", "40", "--sim-output-mean", "120", "--max-running-requests",
                                        "4")))
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)

    def busy():
        s = status(run_dir)
        workers = (s or {}).get("workers") or []
        return s if workers and all(w["state"] == "ready" for w in workers) and any(
            (w["in_flight"] or 0) > 0 for w in workers) else None

    st = wait_for(busy, 120, "every server ready, requests open on one", sup)
    job = job_of(run_dir, "regen-0")
    for w in st["workers"]:
        assert isinstance(w["pid"], int) and w["pid"] > 0, w  # the host agent's launch, on its node
        assert (w["node"], w["job_id"], w["in_flight_source"]) == ("n1", job["job_id"], "router"), w
    # what the router lists of the servers given to it (the second may be listed a second after the first)
    assert st["router"]["in_flight"] > 0 and st["router"]["routed"] and set(st["router"]["routed"]) <= set(
        st["router"]["members"])
    assert sup.wait(180) == 0, sup.log_text()[-4000:]
    every_sample_once(run_dir, cfg, renderer_for)
    log = (run_dir / "supervisor.log").read_text()
    assert "No available workers" not in log and " retry " not in log, [
        line for line in log.splitlines() if " retry " in line][:5]

    # the supervisor is gone: the allocation is read from Slurm now, its last state and `ended`
    st = last_status(run_dir)
    [host] = st["hosts"]
    assert host["name"] == "regen-0" and host["state"] == "ended", host
    assert host["job"]["job_id"] == job["job_id"] and host["job"]["ended"] is True, host
    assert host["job"]["state"] in ("CANCELLED", "COMPLETED") and host["job"]["time_left"] == "", host
    assert st["dispatch"]["retried"] == 0
    assert f"group regen-0: job {job['job_id']} CANCELLED" in log, log[-3000:]  # read at the stop, not assumed


def test_a_job_lost_mid_run_keeps_no_live_figure_of_its_servers(tmp_path, tiny_model_dir, slurm,
                                                                 supervisors):  # noqa: F811
    cfg = slurm_config(tmp_path, tiny_model_dir, prompts=300, nodes=1, extra_args=("--no-requeue",),
                       sim=("--sim-step-ms", "50", "--sim-output-mean", "200", "--max-running-requests", "4"))
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    wait_for(lambda: (lambda s: s if s and (s.get("dispatch") or {}).get("done", 0) >= 5 and all(
        w["running_reqs"] for w in s["workers"]) else None)(status(run_dir)), 120, "both servers running", sup)
    job = job_of(run_dir, "regen-0")
    slurm.run("scontrol", "update", f"nodename={job['nodes']}", "state=down", "reason=edge-test")
    wait_for(lambda: alert(run_dir, f"slurm job {job['job_id']} (regen-0) ended: NODE_FAIL"), 60, "the NODE_FAIL alert",
             sup)
    st = wait_for(lambda: (lambda s: s if s and all(w["state"] in ("lost", "unreachable") for w in s["workers"])
                           else None)(status(run_dir)), 15, "its servers lost", sup)
    for w in st["workers"]:
        # not the last reading (running 4, queued ..., gen tok/s ...): nothing live of a server whose job is gone
        assert (w["running_reqs"], w["queued_reqs"], w["gen_throughput"], w["pid"], w["in_flight"]) == (None,) * 5, w
    assert all(w["error"] for w in st["workers"])
    slurm.run("scontrol", "update", f"nodename={job['nodes']}", "state=resume")
    # the run itself is not the point here: `regen stop` ends it (and cancels the next job regen submitted)
    from tests.test_engine_run import ctl

    assert ctl(run_dir, "stop").returncode == 0
    assert sup.wait(60) == 0, sup.log_text()[-3000:]
