"""The small fixes of issue 18, each asserted on what the operator sees: the printed text, the screen."""
from __future__ import annotations

import json
import re
import subprocess
import sys

from rich.console import Console

from console.commands.status import WIDE, render_status, status_console
from console.host.transport_ssh import kill_outcome
from engine.api.status import RunStatus
from engine.api.events import DiskEvent, GpuEvent, WorkerEvent
from probes.host import script as host_script
from probes.model import ProbeReport, ProbeResult, Status
from probes.render import render_report

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_kill_outcome_never_prints_an_empty_reason():
    assert kill_outcome(7, 0, "").text == "killed remote process group 7"
    gone = kill_outcome(7, 1, "sh: 1: kill: No such process\nsh: 1: kill: No such process")
    assert gone.ok and gone.text == "remote process group 7 had already exited"
    silent = kill_outcome(7, None, "")
    assert not silent.ok and "()" not in silent.text
    assert silent.text == "kill of remote process group 7 failed (no exit status; it printed nothing)"
    denied = kill_outcome(7, 1, "kill: Operation not permitted")
    assert not denied.ok and denied.text.endswith("(exit status 1; stderr: kill: Operation not permitted)")


# -- regen status: sized to the terminal, whole when piped ------------------------------------------
def loading_status() -> RunStatus:
    error = "CUDA out of memory while capturing cuda graph batch size 160; lower --cuda-graph-max-bs"
    workers = [WorkerEvent(name=f"gpu{i}", state="loading", gpus=[i], pid=2061234 + i, restarts=3, in_flight=0,
                           capacity=512, batch_size=160, batch_source="internal_states", running_reqs=0.0,
                           queued_reqs=0.0, gen_throughput=1387.0, token_usage=0.42, prompt_tokens=1_200_000,
                           cached_tokens=996_000, error=error) for i in range(2)]
    return RunStatus.from_dict({"run_dir": "/data/regen/run1", "state": "running", "running": True, "pid": 4242,
                                "started_at": 1.0, "host": "gpubox", "workers": [w.to_dict() for w in workers],
                                "disk": [DiskEvent(path="/tiny", free_bytes=512 * 1024, total_bytes=2**20).to_dict()],
                                "gpus": [GpuEvent(index=g, name="NVIDIA H100 80GB HBM3", mem_used_mb=61234.0,
                                                  mem_total_mb=81559.0, util_pct=87.0, temp_c=61.0, power_w=420.0,
                                                  error="temperature: NVMLError_NotSupported: Not Supported" if g
                                                  else None).to_dict() for g in range(2)]})


def printed(console: Console, capsys) -> list[str]:
    console.print(render_status(loading_status(), console))
    return ANSI.sub("", capsys.readouterr().out).splitlines()


def worker_rows(lines: list[str]) -> list[str]:
    return [line for line in lines if re.match(r"^│ gpu\d ", line)]


def test_status_in_an_80_column_terminal_keeps_pid_and_state_whole(monkeypatch, capsys):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # the output is a terminal of 80 columns
    monkeypatch.setenv("COLUMNS", "80")
    console = status_console(wide=False)
    assert console.width == 80
    lines = printed(console, capsys)
    rows = worker_rows(lines)
    assert len(rows) == 2 and all(len(line) <= 80 for line in lines)
    for i, row in enumerate(rows):
        cells = [c.strip() for c in row.strip("│").split("│")]
        assert cells[:6] == [f"gpu{i}", "loading", str(i), str(2061234 + i), "3", "0/512"]
        assert "…" not in row
    assert any("error" in line and "not shown" in line and "--wide" in line for line in lines)
    gpu_rows = [[c.strip() for c in line.strip("│").split("│")] for line in lines if re.match(r"^│ [01] ", line)]
    assert [r[0] for r in gpu_rows] == ["0", "1"] and all(r[2:6] == ["61234/81559", "87%", "61C", "420W"]
                                                          for r in gpu_rows)


def test_status_piped_or_wide_prints_every_column_whole(monkeypatch, capsys):
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    piped = status_console(wide=False)  # capsys: stdout is not a terminal
    assert piped.width == WIDE
    rows = worker_rows(printed(piped, capsys))
    assert len(rows) == 2 and "2061234" in rows[0] and "loading" in rows[0]
    assert "CUDA out of memory while capturing cuda graph batch size 160; lower --cuda-graph-max-bs" in rows[0]
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    assert status_console(wide=True).width == WIDE


def test_status_says_a_small_filesystem_in_small_units(monkeypatch, capsys):
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    lines = printed(status_console(wide=False), capsys)
    assert "disk /tiny: 512.0 KiB free of 1.0 MiB" in lines


# -- probes ------------------------------------------------------------------------------------------
def test_probe_summary_counts_the_connection_time():
    report = ProbeReport(host="gpubox", started_at=0.0, duration_s=0.04, connect_s=0.33, results=[
        ProbeResult("connection", "connection", Status.PASS, "ok", duration_s=0.01),
        ProbeResult("disk.run_dir", "disk", Status.PASS, "ok", duration_s=0.03)])
    console = Console(width=200, record=True)
    render_report(report, console)
    assert "2 probes in 0.4s (connecting 0.3s, probes 0.0s): PASS 2" in console.export_text()
    assert ProbeReport(host="h", started_at=0.0, duration_s=1.25, results=[]).timing_text("h") == "0 probes on h in 1.2s"


def test_a_json_array_of_300_records_is_300_rows(tmp_path):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([{"messages": [{"role": "user", "content": f"question {i} " + "x" * (i % 37)}]}
                                for i in range(300)], indent=2))
    args = json.dumps({"mode": "format", "patterns": [str(path)]})
    out = subprocess.run([sys.executable, "-c", host_script("prompts"), args], capture_output=True, text=True,
                         check=True)
    facts = json.loads(out.stdout)["files"][0]
    assert (facts["rows"], facts["rows_exact"], facts["read"], facts["complete"]) == (300, True, 300, True)


# -- the console ------------------------------------------------------------------------------------
def replay_app(tmp_path):
    from console.tui.app import RegenApp
    from console.host.source import ReplaySource
    from tests.test_tui_snapshots import DATA, frozen_report

    source = ReplaySource(DATA / "tui_telemetry.jsonl", host="gpu-host", run_dir="/data/runs/demo",
                          stats=json.loads((DATA / "tui_stats.json").read_text()), probe_report=frozen_report())
    return RegenApp(source, live=False, export_dir=tmp_path)


async def wait_for(pilot, predicate, what: str, timeout: float = 30.0):
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.1)


def footer_keys(app) -> dict[str, str]:
    return {k: b.binding.description for k, b in app.screen.active_bindings.items() if b.binding.show}


async def test_every_tab_key_works_from_the_preflight_tab(tmp_path):
    app = replay_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.panel("preflight").report is not None, "the probe report")
        for key, tab in (("4", "quality"), ("5", "disk"), ("6", "alerts"), ("2", "workers"), ("3", "shards")):
            await pilot.press("1")
            await wait_for(pilot, lambda: app.active_tab == "preflight", "the Preflight tab")
            await pilot.press(key)
            await wait_for(pilot, lambda: app.active_tab == tab, f"key {key} showing {tab}")


async def test_a_replay_offers_no_pause_resume_and_quits_without_saying_the_run_continues(tmp_path):
    app = replay_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.model.connection.state == "ended", "the replay to end")
        await pilot.press("3")
        await wait_for(pilot, lambda: app.active_tab == "shards", "the Shards tab")
        keys = footer_keys(app)
        assert keys.get("q") == "Quit"
        assert not {"p", "r", "P", "R"} & set(keys)
        await pilot.press("2")
        await wait_for(pilot, lambda: app.active_tab == "workers", "the Workers tab")
        assert "x" not in footer_keys(app)
        await pilot.press("q")
        await wait_for(pilot, lambda: not app.is_running, "the console to quit")
    assert app.return_code == 0


async def test_a_probe_report_for_a_preflight_table_not_composed_is_kept_and_drawn_on_mount():
    """Seen in the suite: a probe report reached the Preflight panel while its table was not there (the app exiting),
    and its NoMatches ended the app. A report with no table is kept and drawn when the panel mounts."""
    from textual.app import App
    from textual.widgets import DataTable

    from console.tui.panel_preflight import PreflightPanel
    from tests.test_tui_snapshots import frozen_report

    panel = PreflightPanel()
    report = frozen_report()
    panel.set_report(report)  # not composed: nothing to draw into, and no error

    class Host(App):
        def compose(self):
            yield panel

    async with Host().run_test(size=(120, 40)):
        assert panel.query_one("#probe-table", DataTable).row_count == len(report.results)
