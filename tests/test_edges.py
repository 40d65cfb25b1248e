"""A run's life at its edges, as one operator sees it: the TUI attached (Pilot), `regen status --json` and the metrics
endpoint, each held against the truth (the process table, the Parquet rows) within 2 s of the edge:

1. the supervisor SIGKILLed mid-run: dead everywhere, no live server on screen, the endpoint refused, the resume line;
2. the run started again and finished: done everywhere, every worker ended, no resume line, the endpoint refused, the
   Parquet rows the whole plan;
3. the finished run started again: said so with its own exit code, and nothing left running.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request

import psutil
import pyarrow.parquet as pq
import pytest

from console.host.source import HostSource
from console.host.transport_local import LocalTransport
from console.tui.app import RegenApp
from engine.config.schema import Metrics
from tests.run_helpers import make_config, process_alive, wait_for
from tests.waiting import loaded_bound
from tests.sshd_fixtures import free_port
from tests.test_cli_run import cleanup_runs, regen  # noqa: F401  (fixture)
from tests.test_faults_fatal import write_config
from tests.test_tui_app import header, text_of, wait_until

EDGE_S = 2.0  # what the operator sees follows the edge within this


def refused(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
    except urllib.error.URLError as exc:
        return isinstance(exc.reason, ConnectionRefusedError)
    return False


def status_json(run_dir, home) -> dict:
    out = regen("status", "local", "--run-dir", str(run_dir), "--json", home=home)
    assert out.returncode in (0, 3, 4), out.stderr
    return json.loads(out.stdout)


def server_pids(run_dir) -> list[int]:
    """The simulator servers this run launched, from the process table."""
    pids = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "engine.simulator" in cmd and str(run_dir) in cmd:
            pids.append(p.info["pid"])
    return pids


def parquet_rows(run_dir) -> int:
    return sum(pq.ParquetFile(f).metadata.num_rows for f in (run_dir / "shards").rglob("*.parquet"))


def worker_rows(app) -> list[list[str]]:
    table = app.query_one("#workers-table")
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_killed_then_finished_then_started_again_each_edge_seen_everywhere(tmp_path, tiny_model_dir,
                                                                                  cleanup_runs):  # noqa: F811
    run_dir = tmp_path / "run"
    cleanup_runs.append(run_dir)
    port = free_port()
    # ~40 s of run (answers of ~3 s, 4 at a time a server): the kill lands mid-run on a loaded box (with 64 running
    # and 8 tokens a step it had settled 109 of 111 samples before the TUI saw it running)
    cfg = make_config(run_dir, tiny_model_dir, prompts=80, gpus=2, shard_size=20, metrics=Metrics(port=port),
                      sim=("--sim-step-ms", "20", "--sim-output-mean", "300", "--sim-tokens-per-step", "2",
                           "--max-running-requests", "4"))
    config = write_config(tmp_path, cfg)
    started = regen("start", "local", "--config", str(config), "--no-preflight", home=tmp_path)
    assert started.returncode == 0, started.stderr
    source = HostSource("local", str(run_dir), host_python=sys.executable, transport=LocalTransport())
    app = RegenApp(source, run_probes_on_start=False, export_dir=tmp_path)
    try:
        async with app.run_test(size=(200, 45)) as pilot:
            await wait_until(pilot, lambda: "running" in header(app) and app.model.done > 0, "a running run", 120)
            # 1. the supervisor SIGKILLed mid-run
            pid = int((run_dir / "supervisor.pid").read_text())
            os.killpg(pid, signal.SIGKILL)
            killed = time.monotonic()
            await wait_until(pilot, lambda: "dead" in header(app), "dead in the header", 30)
            assert time.monotonic() - killed <= loaded_bound(EDGE_S)
            wait_for(lambda: refused(port), EDGE_S + 5, "the metrics endpoint refused after the kill")
            st = status_json(run_dir, tmp_path)
            assert st["state"] == "dead" and st["running"] is False
            wait_for(lambda: not server_pids(run_dir), 30, "the servers gone with their supervisor")
            await wait_until(pilot, lambda: worker_rows(app) and all(r[1].startswith("gone (was ")
                                                                      or r[1] in ("crashed", "stopped", "failed")
                                                                      for r in worker_rows(app)),
                             "no live server on the Workers tab", 10)
            assert all(r[4] == "-" for r in worker_rows(app)), worker_rows(app)  # no tok/s of a dead server
            banner = " ".join(text_of(app.query_one("#next-step")).split())
            assert f"next: cd {tmp_path} && regen start local --config {config}" in banner, banner

            # 2. started again, to the end
            again = regen("start", "local", "--config", str(config), "--no-preflight", home=tmp_path)
            assert again.returncode == 0, again.stderr
            await wait_until(pilot, lambda: app.model.state == "done", "done in the TUI", 240)
            wait_for(lambda: not (run_dir / "supervisor.pid").exists(), 60, "the finished supervisor's exit")
            ended = time.monotonic()
            wait_for(lambda: refused(port), EDGE_S + 5, "the metrics endpoint refused after the run's end")
            await wait_until(pilot, lambda: worker_rows(app) and all(r[1] == "ended (was ready)" or r[1] == "stopped"
                                                                     for r in worker_rows(app)),
                             "every worker ended", EDGE_S + 5)
            assert time.monotonic() - ended <= EDGE_S + 5
            assert not app.query_one("#next-step").display  # a finished run has nothing to resume
            st = status_json(run_dir, tmp_path)
            assert st["state"] == "done" and st["running"] is False
            assert st["dispatch"]["done"] == st["dispatch"]["total"] == parquet_rows(run_dir) > 0
            assert not server_pids(run_dir)
    finally:
        await source.close()

    # 3. the finished run started again: said so, nothing started
    third = regen("start", "local", "--config", str(config), "--no-preflight", home=tmp_path)
    assert third.returncode not in (0, 1, 2), (third.returncode, third.stdout, third.stderr)
    assert "already finished" in third.stdout + third.stderr
    assert not (run_dir / "supervisor.pid").exists() or not process_alive(
        int((run_dir / "supervisor.pid").read_text()))
    assert not server_pids(run_dir)
