"""`regen demo`'s console, driven with Pilot until the run is done: every shard row done with its Parquet sums."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal

import psutil
import pytest

from console.commands.demo import _demo, demo_config, write_prompts
from console.tui.app import RegenApp
from console.tui.shard_table import ShardTable
from console.host.source import HostSource
from tests.test_figures_true import parquet_sums, status_cli
from tests.test_tui_app import header, wait_until
from tests.waiting import poll_until

DEMO_SIM = ["--sim-step-ms", "2"]  # the demo's simulator, faster: 120 prompts on 2 GPUs in ~15 s


def stop_supervisor(run_dir) -> None:
    """A test that failed before the run ended must not leave its supervisor (and simulators) running."""
    try:
        pgid = int((run_dir / "supervisor.pid").read_text())
        os.killpg(pgid, signal.SIGTERM)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return  # never started, or already exited
    if not poll_until(lambda: not psutil.pid_exists(pgid), 10, interval=0.1):
        os.killpg(pgid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_demo_console_shows_every_shard_done_with_its_parquet_sums_and_rejects_apart(tmp_path,
                                                                                              tiny_model_dir):
    run_dir = (tmp_path / "demo").resolve()
    prompts = write_prompts(run_dir / "prompts", 120, 0)
    cfg = demo_config(run_dir, tiny_model_dir, prompts, 2, DEMO_SIM)
    args = argparse.Namespace(headless=False, until_done=False)
    seen: dict = {}

    async def console(host: str, started_run_dir: str, *, host_python: str) -> int:
        """What the demo hands the run to (console.tui.app.run_tui), under Pilot."""
        source = HostSource(host, started_run_dir, host_python=host_python)
        app = RegenApp(source)
        try:
            async with app.run_test(size=(140, 40)) as pilot:
                await wait_until(pilot, lambda: app.model.state == "done" and app.model.running is False,
                                 "the run done and its supervisor gone", timeout=240)
                total = app.model.total
                await wait_until(pilot, lambda: f"{total:,}/{total:,} (100.0%)" in header(app)
                                 and f"rejects {4 + app.model.dispatch.after_cut}" in header(app),
                                 "the header at 100% with the rejects apart")
                seen["header"] = header(app)
                await pilot.press("3")
                table = app.query_one("#shards-table", ShardTable)
                sums = parquet_sums(run_dir)
                await wait_until(pilot, lambda: table.row_count == len(app.model.shards) == len(sums),
                                 f"{len(sums)} shard rows")
                seen["rows"] = {sid: {c: table.cells(sid)[c] for c in ("state", "samples", "tokens")}
                                for sid in sums}
                seen["summary"] = " ".join(str(app.query_one("#shards-summary").content).split())
                seen["sums"] = sums
                await pilot.press("q")  # the operator quits the console (the run is over anyway)
        finally:
            await source.close()
        return int(app.return_code or 0)

    try:
        assert await _demo(args, cfg, console) == 0
    finally:
        stop_supervisor(run_dir)
    st = json.loads(status_cli(run_dir, tmp_path, "--json").stdout)
    d = st["dispatch"]
    cut = d["after_cut"]  # later turns after a turn cut at max_new_tokens (turns_after_cut = "stop")
    assert st["state"] == "done" and d["done"] == d["total"] > 0 and d["rejected"] == 1 + cut, d
    assert st["rejects"]["total"] == 4 + cut, st["rejects"]
    # the header: done N/N at 100%, the rejects (3 bad input rows, 1 prompt too long for the context, the turns
    # after a cut one) apart
    assert f"{d['done']:,}/{d['total']:,} (100.0%)" in seen["header"] and f"rejects {4 + cut}" in seen["header"], \
        seen["header"]
    # every shard row: done, its samples and tokens those of its committed Parquet rows
    sums = seen["sums"]
    totals = {sh["id"]: sh["total"] for sh in st["shards"]}
    assert seen["rows"] == {sid: {"state": "done", "samples": f"{s['done']}/{totals[sid]}",
                                  "tokens": f"{s['output_tokens']:,}"} for sid, s in sums.items()}, seen["rows"]
    assert all(s["done"] == totals[sid] for sid, s in sums.items())
    assert f"{len(sums)} shards: {len(sums)} done" in seen["summary"], seen["summary"]


async def test_a_status_landing_while_the_console_shuts_down_on_the_shards_tab_is_no_error(tmp_path):
    from console.tui.messages import StatusReceived
    from console.host.source import ReplaySource
    from engine.api.status import RunStatus
    from engine.api.wire import ShardFigures
    from tests.test_tui_snapshots import DATA

    app = RegenApp(ReplaySource(DATA / "tui_telemetry.jsonl", host="h", run_dir=str(tmp_path)), live=False,
                   run_probes_on_start=False)
    status = RunStatus(run_dir=str(tmp_path), running=False, state="done",
                       shards=[ShardFigures(id="s00000", state="done", done=1, total=1)])

    async def replies():  # status replies landing at any moment, as the follow loop's do
        for _ in range(200):
            app.post_message(StatusReceived(status))
            await asyncio.sleep(0)

    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("3")
        app.post_message(StatusReceived(status))
        table = app.query_one("#shards-table", ShardTable)
        await wait_until(pilot, lambda: app.active_tab == "shards" and table.row_count == 1, "the Shards tab drawn")
        posting = asyncio.ensure_future(replies())
    await posting
