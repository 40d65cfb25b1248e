"""Every figure the operator sees comes from committed state (issue 14): after each of three SIGKILL restarts
`regen status --json` says done/total, output tokens and per-shard figures equal to the sums over the
committed Parquet rows, and no ETA until one is measurable; a stopped run shows no rate, no ETA and no
shard `running`; a sample rejected at dispatch settles its shard, so the run ends at done == total with
every shard `done`, and each shard's last `shard` event equals its Parquet sums."""
from __future__ import annotations

import json
import os
import sqlite3
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.run_helpers import ctl, events, make_config, quick_state, status, wait_for
from tests.run_helpers import renderer_for, supervisors  # noqa: F401  (fixtures)
from tests.test_cli_run import regen

SLOW_SIM = ("--sim-output-mean", "60", "--sim-step-ms", "10", "--sim-tokens-per-step", "2",
            "--max-running-requests", "4")


def status_cli(run_dir: Path, home: Path, *args: str):
    """`regen status local` for a run not started by `regen start`: the host's python3 is this interpreter."""
    return regen("status", "local", "--run-dir", str(run_dir), *args, home=home,
                 env={"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})


def live_status(run_dir: Path) -> dict | None:
    """The supervisor's status reply (the ctl `status` op), in-process: no subprocess per poll."""
    from engine.control import request

    try:
        reply = request(run_dir / "control.sock", {"op": "status"}, timeout=5)
    except (OSError, ValueError):
        return None
    return reply.get("result") if reply.get("ok") else None


def parquet_sums(run_dir: Path) -> dict[str, dict[str, int]]:
    """Per shard, over the rows of the committed parts (listed in state.sqlite, read from Parquet)."""
    with sqlite3.connect(run_dir / "state.sqlite") as db:
        parts = db.execute("SELECT shard_id, path FROM parts").fetchall()
    sums: dict[str, dict[str, int]] = defaultdict(lambda: {"done": 0, "output_tokens": 0, "truncated": 0})
    for shard_id, path in parts:
        t = pq.read_table(run_dir / path, columns=["output_len", "finish_reason"])
        s = sums[shard_id]
        s["done"] += t.num_rows
        s["output_tokens"] += sum(t.column("output_len").to_pylist())
        s["truncated"] += sum(1 for fr in t.column("finish_reason").to_pylist() if fr == "length")
    return dict(sums)


def shard_figures(shards: list[dict]) -> dict[str, dict[str, int]]:
    return {sh["id"]: {"done": sh["done"], "output_tokens": sh["output_tokens"], "truncated": sh["truncated"]}
            for sh in shards if sh["done"]}


def steady_status(run_dir: Path, read) -> tuple[dict, dict]:
    """A status and the Parquet sums of the same committed state: read until no commit lands in between."""
    def attempt():
        before = read()
        sums = parquet_sums(run_dir)
        after = read()
        if before and after and before["dispatch"]["done"] == after["dispatch"]["done"] == sum(
                s["done"] for s in sums.values()):
            return before, sums
        return None
    return wait_for(attempt, 60, "a status with no commit landing while the Parquet files are read")


def check_against_parquet(st: dict, sums: dict) -> None:
    d = st["dispatch"]
    assert d["done"] == sum(s["done"] for s in sums.values())
    assert d["output_tokens"] == sum(s["output_tokens"] for s in sums.values())
    assert shard_figures(st["shards"]) == sums
    assert d["total"] == sum(sh["total"] for sh in st["shards"]) and d["done"] <= d["total"]


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_three_sigkill_restarts_keep_every_figure_equal_to_the_parquet_sums(tmp_path, tiny_model_dir, supervisors):
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=400, gpus=1, sim=SLOW_SIM)
    done_before = 0
    for restart in range(4):
        sup = supervisors(run_dir).start(cfg if restart == 0 else None)
        wait_for(lambda: quick_state(run_dir) == "running", 120, "a running supervisor", sup)
        if restart:
            # right after a restart: no ETA (nothing measured since this start), every committed figure is there
            first = live_status(run_dir)
            assert first["dispatch"]["eta_s"] is None, first["dispatch"]
            assert first["dispatch"]["done"] >= done_before > 0
            st, sums = steady_status(run_dir, lambda: live_status(run_dir))
            check_against_parquet(st, sums)
        # let it commit more than before, then kill it mid-dispatch
        target = done_before + 20
        wait_for(lambda: ((live_status(run_dir) or {}).get("dispatch") or {}).get("done", 0) >= target, 120,
                 f"{target} committed samples", sup)
        st = status(run_dir)  # over engine.ctl, as the console asks
        assert st["dispatch"]["output_tokens"] > 0 and st["dispatch"]["done"] >= target
        sup.kill()
        out = status_cli(run_dir, tmp_path, "--json")
        assert out.stdout, out.stderr
        offline = json.loads(out.stdout)
        sums = parquet_sums(run_dir)
        check_against_parquet(offline, sums)
        assert offline["dispatch"]["eta_s"] is None and offline["dispatch"]["tokens_per_s"] is None
        assert not [sh for sh in offline["shards"] if sh["state"] == "running"]
        done_before = offline["dispatch"]["done"]
    # the last round: the rate becomes measurable and an ETA appears, then stop: no rate, no ETA, nothing running
    sup = supervisors(run_dir).start()
    wait_for(lambda: ((live_status(run_dir) or {}).get("dispatch") or {}).get("eta_s") is not None, 120,
             "a measurable ETA", sup)
    assert ctl(run_dir, "stop").returncode == 0
    assert sup.wait(60) == 0, sup.log_text()[-3000:]
    human = status_cli(run_dir, tmp_path)
    said = " ".join(human.stdout.split())
    assert "- tok/s" in said and "ETA -" in said, said
    offline = json.loads(status_cli(run_dir, tmp_path, "--json").stdout)
    check_against_parquet(offline, parquet_sums(run_dir))
    assert offline["state"] == "stopped" and offline["dispatch"]["eta_s"] is None
    assert {sh["state"] for sh in offline["shards"]} <= {"done", "stopped", "pending"}
    last_shard_events = {ev["id"]: ev for ev in events(run_dir) if ev["type"] == "shard"}
    assert not [ev for ev in last_shard_events.values() if ev["state"] == "running"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_ends_at_done_equal_total_with_every_shard_done_and_its_last_event_the_parquet_sums(tmp_path):
    """The demo's too-long prompt is rejected at dispatch time (it does not fit the context): it settles its shard,
    counts apart as a rejected sample, and is one of the rows of rejects.jsonl (with the three bad input rows)."""
    run_dir = tmp_path / "demo"
    r = regen("demo", "--headless", "--until-done", "--gpus", "2", "--prompts", "120", "--run-dir", str(run_dir),
              "--sim-arg=--sim-step-ms", "--sim-arg=2", home=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = status_cli(run_dir, tmp_path, "--json")
    st = json.loads(out.stdout)
    d = st["dispatch"]
    assert st["state"] == "done" and d["done"] == d["total"] > 0, d
    assert d["rejected"] == 1 and d["planned"] == d["total"] + d["rejected"] + d["failed"]
    assert {sh["state"] for sh in st["shards"]} == {"done"}
    assert [sh["rejected"] for sh in st["shards"] if sh["rejected"]] == [1]
    assert st["rejects"]["total"] == 4 and st["rejects"]["by_reason"].get("context_overflow") == 1
    sums = parquet_sums(run_dir)
    check_against_parquet(st, sums)
    last = {ev["id"]: ev for ev in events(run_dir) if ev["type"] == "shard"}
    assert {sid: (ev["state"], ev["done"], ev["output_tokens"], ev["truncated"]) for sid, ev in last.items()} == {
        sid: ("done", s["done"], s["output_tokens"], s["truncated"]) for sid, s in sums.items()}
    human = " ".join(status_cli(run_dir, tmp_path).stdout.split())
    assert f"done: {d['done']}/{d['total']} samples (100.0%)" in human and "rejected samples 1" in human, human
