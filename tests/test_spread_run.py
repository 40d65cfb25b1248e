"""Work spread across servers (issue 25): the real supervisor against simulated SGLang 0.5.23 servers that report a
batch (internal_states) larger than their KV pool lets them run, one of them ready late."""
from __future__ import annotations

import re

import pytest

from tests.run_helpers import (  # noqa: F401  (fixture)
    check_rows, expected_samples, make_config, read_rows, renderer_for, status, supervisors, wait_for,
)
from tests.test_engine_capacity import unflagged

pytestmark = pytest.mark.timeout(300)
DECODE = re.compile(r"Decode batch, #running-req: (\d+),.*#queue-req: (\d+),")
POOL = 20_000  # reported batch: 2,048; the pool runs ~50-100 of these requests at once
SIM = ("--sim-sglang-version", "0.5.23", "--max-total-tokens", str(POOL), "--sim-output-mean", "300",
       "--sim-output-sigma", "0.5", "--sim-step-ms", "10", "--sim-step-ms-per-req", "0.05", "--sim-tokens-per-step", "2")


def peaks(log: str) -> tuple[int, int]:
    """(peak #running-req, peak #queue-req) over the server's decode steps."""
    seen = [(int(r), int(q)) for r, q in DECODE.findall(log)]
    return max(r for r, _ in seen), max(q for _, q in seen)


def test_a_batch_larger_than_the_kv_pool_does_not_pile_sglangs_own_queue(tmp_path, tiny_model_dir, supervisors):
    run_dir = tmp_path / "run"
    prompts = 600
    cfg = unflagged(make_config(run_dir, tiny_model_dir, prompts=prompts, gpus=2, sim=SIM))
    sup = supervisors(run_dir).start(cfg)
    st = wait_for(lambda: (s := status(run_dir)) and len(s.get("workers") or []) == 2 and all(
        w["state"] == "ready" for w in s["workers"]) and s, 120, "both servers ready", sup)
    assert all(w["batch_size"] < 2048 for w in st["workers"])  # never the reported 2,048
    assert sup.wait(240) == 0, sup.log_text()[-3000:]
    rows = read_rows(run_dir)
    assert len({r["sample_id"] for r in rows}) == len(rows) >= prompts  # every sample once (the demo's turns)
    served = {name: sum(1 for r in rows if r["worker"] == name) for name in ("gpu0", "gpu1")}
    assert min(served.values()) >= len(rows) // 3, served  # both servers served, about evenly
    for name in ("gpu0", "gpu1"):
        running, queued = peaks((run_dir / "workers" / name / "server.log").read_text())
        # sent the reported batch, a server would hold ~250 of its ~300 in its own queue; regen keeps what the
        # server runs now plus a margin, so its queue stays about under one batch of what it runs (a loaded
        # supervisor reads the running count late: 77 queued against 74 running was seen beside 3 other test workers)
        assert queued <= running * 1.25, (name, running, queued)
        assert queued < prompts // 4, (name, running, queued)


def test_a_server_ready_late_gets_its_share_at_once(tmp_path, tiny_model_dir, supervisors):
    run_dir = tmp_path / "run"
    prompts = 600
    base = unflagged(make_config(run_dir, tiny_model_dir, prompts=prompts, gpus=2, sim=SIM))
    # gpu1's server loads 4 s longer than gpu0's (per port: the supervisor formats {port} into the launch line)
    launch = ("sh -c '" + base.workers.launch + " \"$@\" --sim-load-s"  # after the extra args: this one wins
              f" $(( ({{port}} - {base.workers.base_port}) * 4 ))' regen-sim")
    cfg = base.model_copy(update=dict(workers=base.workers.model_copy(update=dict(launch=launch))))
    sup = supervisors(run_dir).start(cfg)

    def state(name: str, st: dict | None) -> dict:
        return next((w for w in (st or {}).get("workers") or [] if w["name"] == name), {})

    wait_for(lambda: (s := status(run_dir)) and state("gpu0", s).get("in_flight", 0) > 0
             and state("gpu1", s).get("state") != "ready" and s, 120, "gpu0 at work while gpu1 still loads", sup)
    # once ready, gpu1 has requests in flight while work is left (it was not all taken by gpu0 while it loaded)
    st = wait_for(lambda: (s := status(run_dir)) and state("gpu1", s).get("in_flight", 0) > 0 and s, 60,
                  "gpu1 with requests in flight", sup)
    assert st["dispatch"]["done"] < st["dispatch"]["total"]
    assert sup.wait(240) == 0, sup.log_text()[-3000:]
    rows = read_rows(run_dir)
    assert len({r["sample_id"] for r in rows}) == len(rows) >= prompts  # every sample once (the demo's turns)
    late = sum(1 for r in rows if r["worker"] == "gpu1")
    assert late >= len(rows) // 5, late  # a share of the work, not the leftovers


def test_work_moved_off_a_servers_queue_is_generated_exactly_once(tmp_path, tiny_model_dir, supervisors,
                                                                  renderer_for):
    run_dir = tmp_path / "run"
    base = unflagged(make_config(run_dir, tiny_model_dir, prompts=200, gpus=2, sim=SIM))
    # gpu0: a pool of 8,000 tokens (~10-25 of these requests run at once); gpu1: 200,000, and it loads 12 s longer,
    # past the fair share's grace. The operator's fixed cap (400) lets gpu0 take every request while it is alone:
    # they wait in gpu0's own queue until gpu1, with room to spare, is ready and work is moved to it
    i = f"({{port}} - {base.workers.base_port})"
    launch = ("sh -c '" + base.workers.launch + f" \"$@\" --sim-load-s $(( {i} * 12 ))"
              f" --max-total-tokens $(( 8000 + {i} * 192000 ))' regen-sim")
    # every later turn is generated even after a cut one (turns_after_cut "continue"): this test counts them all
    cfg = base.model_copy(update=dict(workers=base.workers.model_copy(update=dict(launch=launch)),
                                      dispatch=base.dispatch.model_copy(update=dict(max_in_flight_per_worker=400)),
                                      turns_after_cut="continue"))
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(240) == 0, sup.log_text()[-3000:]
    log = sup.log_text()
    moved = re.findall(r"gpu0: (\S+) moved off its queue \(Abort in waiting queue\)", log)
    assert moved, log[-3000:]
    # each move is one abort answered once: a request re-queued at most once per abort sent for it
    assert all(moved.count(rid) <= log.count(f"gpu0: moving {rid} off its queue") for rid in set(moved))
    rows = read_rows(run_dir)
    ids = [r["sample_id"] for r in rows]
    assert len(set(ids)) == len(ids)  # every sample committed once
    by_id = {r["sample_id"]: r for r in rows}
    assert all(rid in by_id for rid in moved)  # a moved request is generated (its rid is its sample id: no attempt)
    assert any(by_id[rid]["worker"] == "gpu1" for rid in moved)  # by the server that had room
    renderer = renderer_for(cfg)
    expected = expected_samples(cfg, renderer)[0]
    # every sample but the demo's prompt too long for any server (rejected up front)
    assert set(ids) <= expected and {sid.split("#")[0] for sid in expected - set(ids)} == {"too-long"}
    check_rows(rows, cfg, renderer)  # each exact, on the model's own earlier answers
