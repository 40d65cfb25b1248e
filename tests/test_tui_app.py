"""The console driven with Pilot against a real simulated run (the same start path `regen demo` uses,
over the local transport): every panel and action, as the operator sees it."""
from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from console.commands.demo import demo_config, write_prompts
from console.host.deploy import start_run
from console.host.run_client import RunClient
from console.host.transport_local import LocalTransport
from console.tui.app import RegenApp
from console.tui.screens import ConfirmScreen, HelpScreen
from console.tui.shard_table import ShardTable
from console.host.source import HostSource
from textual.widgets import DataTable, Log, Static
from tests.run_helpers import children_with_cmdlines
from tests.waiting import poll_until

# slow enough that the run is still going while the tests act on it (a few minutes of work on 2 workers)
SLOW_SIM = ["--sim-step-ms", "60", "--sim-tokens-per-step", "1", "--sim-output-mean", "200"]


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("tui") / "run dir"
    run_dir.mkdir()
    prompts = write_prompts(run_dir / "prompts", 400, 0)
    cfg = demo_config(run_dir, tiny_model_dir, prompts, 2, SLOW_SIM)

    async def start():
        t = LocalTransport()
        try:
            return await start_run(t, cfg, host_python=sys.executable)
        finally:
            await t.close()

    started = asyncio.run(start())
    yield started
    pid_file = Path(started.run_dir) / "supervisor.pid"
    try:
        pgid = int(pid_file.read_text())
    except (FileNotFoundError, ValueError):
        return  # it already exited
    try:
        os.killpg(pgid, signal.SIGTERM)
        if not poll_until(lambda: not psutil.pid_exists(pgid), 10, interval=0.1):
            os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return  # exited between the read and the kill


def make_app(started, tmp_path) -> tuple[RegenApp, RunClient]:
    transport = LocalTransport()
    source = HostSource("local", started.run_dir, host_python=sys.executable, transport=transport)
    return RegenApp(source, export_dir=tmp_path), started.client(transport)


async def wait_until(pilot, predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await pilot.pause(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def cell(table: DataTable, row: str, col: str) -> str:
    value = table.get_cell(row, col)
    return getattr(value, "plain", str(value))


def text_of(widget: Static, width: int = 200) -> str:
    """What a Static shows, as plain text (rich renderables rendered at `width`)."""
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(widget.content if isinstance(widget, Static) else widget.render())  # the header renders
    return console.export_text()


def header(app) -> str:
    return text_of(app.query_one("#run-header"))


async def test_shards_pause_resume_reach_the_supervisor(live_run, tmp_path):
    app, client = make_app(live_run, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("3")
        table = app.query_one("#shards-table", ShardTable)
        await wait_until(pilot, lambda: table.row_count >= 5, "the shard rows")
        assert "connected" in header(app) and "local" in header(app)
        footer = {k: b.binding.description for k, b in app.screen.active_bindings.items() if b.binding.show}
        assert footer["q"] == "Quit (run continues)" and {"p", "r", "P", "R"} <= set(footer)  # a live run's hints
        table.move_cursor(row=table.row_count - 1)  # the last shard: still pending, so pausing it matters
        sid = app.panel("shards").selected_shard
        await pilot.press("p")

        async def paused_on_host():
            return any(s.id == sid and s.state == "paused" for s in (await client.status()).shards)

        await wait_until(pilot, lambda: "paused" in table.cells(sid)["state"], f"{sid} shown paused")
        assert await paused_on_host()
        assert "⏸" in table.cells(sid)["state"]
        await pilot.press("r")
        await wait_until(pilot, lambda: "paused" not in table.cells(sid)["state"], f"{sid} shown resumed")
        assert not any(s.id == sid and s.state == "paused" for s in (await client.status()).shards)
        await pilot.press("P")
        await wait_until(pilot, lambda: app.model.state == "paused" or all(
            s.state in ("paused", "done") for s in app.model.shards.values()), "every shard paused")
        st = await client.status()
        assert all(s.state in ("paused", "done") for s in st.shards)
        await pilot.press("R")
        await wait_until(pilot, lambda: not app.model.paused_shards(), "every shard resumed")
        assert not [s for s in (await client.status()).shards if s.state == "paused"]
    await app.source.transport.close()
    # quitting the console left the run alone
    assert (await client.status()).state in ("running", "starting", "paused")


async def test_workers_table_log_tail_and_restart_with_confirmation(live_run, tmp_path):
    app, client = make_app(live_run, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        table = app.query_one("#workers-table", DataTable)
        await wait_until(pilot, lambda: table.row_count == 2, "two worker rows")
        await wait_until(pilot, lambda: cell(table, "gpu0", "state") == "ready", "gpu0 ready")
        # no NVML on this machine: a rehearsal shows the simulator's modelled memory (once read), never a crash;
        # what NVML would give and the simulator does not model stays N/A
        await wait_until(pilot, lambda: cell(table, "gpu0", "VRAM used/total").endswith(" GiB"), "simulated VRAM")
        assert cell(table, "gpu0", "temp") == "N/A"
        # the ledger's figures of its committed samples, through the worker events
        await wait_until(pilot, lambda: "% of " in cell(table, "gpu0", "cache hit"), "gpu0's cache-hit share")
        log = app.query_one("#worker-log", Log)
        await wait_until(pilot, lambda: "fired up and ready to roll" in "\n".join(log.lines), "the server log tail")
        # regen's own polls (GET /metrics every second or so) are hidden by default; the title counts them, h shows them
        await wait_until(pilot, lambda: "of regen's polls hidden" in str(log.border_title), "polls counted in the title")
        assert not [line for line in log.lines if '"GET /metrics HTTP/1.1" 200' in line]
        panel = app.panel("workers")
        panel.action_toggle_polls()
        await wait_until(pilot, lambda: any('"GET /metrics HTTP/1.1" 200' in line for line in log.lines), "polls shown")
        assert "h hides regen's polls" in str(log.border_title)
        panel.action_toggle_polls()
        await wait_until(pilot, lambda: not [line for line in log.lines if '"GET /metrics' in line], "polls hidden")
        await wait_until(pilot, lambda: len(app.model.throughput) >= 2, "throughput history")
        table.move_cursor(row=1)
        await pilot.press("x")
        assert isinstance(app.screen, ConfirmScreen) and "gpu1" in app.screen.question
        await pilot.press("n")
        assert not isinstance(app.screen, ConfirmScreen)
        await pilot.press("x")
        await pilot.press("y")
        await wait_until(pilot, lambda: app.model.workers["gpu1"].restarts >= 1, "the restart in status")
        st = await client.status()
        assert next(w for w in st.workers if w.name == "gpu1").restarts >= 1
    await app.source.transport.close()


async def test_quality_disk_alerts_preflight_panels(live_run, tmp_path):
    app, _client = make_app(live_run, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.model.done > 0, "some samples done", timeout=60)
        await pilot.press("4")
        await wait_until(pilot, lambda: app.model.stats is not None or app.model.stats_error, "the stats")
        assert app.model.stats_error == "" and app.model.stats is not None and app.model.stats.samples > 0
        figures = text_of(app.query_one("#quality-figures", Static))
        assert "empty answers" in figures and "loss-mask sum" in figures
        await pilot.press("5")
        await wait_until(pilot, lambda: ("", "/dev/shm") in app.model.disks, "disk events")
        disk = text_of(app.query_one("#disk-table", Static))
        assert "/dev/shm" in disk and live_run.run_dir in disk
        await pilot.press("1")
        probe_table = app.query_one("#probe-table", DataTable)
        await wait_until(pilot, lambda: probe_table.row_count > 3, "the probe table", timeout=120)
        report = app.panel("preflight").report
        ids = [r.id for r in report.results]
        assert "connection" in ids and "ports" not in ids  # the live workers hold the ports: not probed
        detail = text_of(app.query_one("#probe-detail", Static))
        assert "command" in detail or "summary" in detail
        await pilot.press("e")
        await wait_until(pilot, lambda: list(tmp_path.glob("probe-*.json")), "the exported report")
        exported = json.loads(next(tmp_path.glob("probe-*.json")).read_text())
        assert exported["schema"] == "regen.probe/1" and len(exported["probes"]) == len(ids)
        probe_table.move_cursor(row=0)
        await pilot.press("r")
        await pilot.pause(0.5)
        await pilot.press("6")
        assert app.active_tab == "alerts"
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
    await app.source.transport.close()


async def test_a_dead_channel_is_opened_again_and_the_follow_goes_on_from_its_last_event(live_run, tmp_path):
    """The follow goes over the control channel: its process killed (the connection holds), a new channel carries the
    follow on from the last event's ts, with a note; a lost connection is test_control_channel_tui's (real sshd)."""
    app, client = make_app(live_run, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.model.connection.state == "connected" and app.events_applied > 0,
                         "connected with events")

        def channel_process():
            return next((p for p, cmd in children_with_cmdlines() if "engine.ctl" in " ".join(cmd) and "serve" in cmd),
                        None)

        first = await wait_until(pilot, lambda: app.source.client.channel, "the open channel")
        proc = await wait_until(pilot, channel_process, "the channel's process")
        assert not [p for p, cmd in children_with_cmdlines() if "follow" in cmd]  # no process of its own
        proc.kill()
        await wait_until(pilot, lambda: first.closed is not None, "the channel to see its process die")
        before = app.model.last_ts
        await wait_until(pilot, lambda: app.model.last_ts > before, "events after the new channel opened")
        assert app.source.client.channel is not first and app.model.connection.state == "connected"
        texts = [a.text for a in app.model.alerts]
        assert any("closed: `engine.ctl serve` exited with status 137" in t and t.endswith("opening a new one")
                   for t in texts), texts
    await app.source.transport.close()
    assert (await client.status()).state in ("running", "paused", "starting")


async def test_command_palette_runs_actions(live_run, tmp_path):
    app, _client = make_app(live_run, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+p")
        await pilot.pause(0.3)
        for ch in "Show Disk":
            await pilot.press("space" if ch == " " else ch)
        await pilot.pause(0.5)
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.active_tab == "disk", "the Disk tab from the palette")
    await app.source.transport.close()
