"""Death shown as death: a supervisor killed with SIGKILL is `dead` in the TUI's header within 2 s (the follow stream's
end is the signal), its figures go to `-` (the header's and every worker's: no live server), a critical alert says it
(the recorded cause, or that none was recorded), and the resume line from the run's start record is under the header,
copied on `y`."""
from __future__ import annotations

import os
import signal
import sys
import time

import psutil

from console.host.transport_local import LocalTransport
from console.tui.app import RegenApp
from console.host.source import HostSource
from tests.run_helpers import make_config, process_alive, wait_for
from tests.test_cli_run import cleanup_runs, regen  # noqa: F401  (fixture)
from tests.test_faults_fatal import write_config
from tests.test_tui_app import header, text_of, wait_until
from tests.waiting import await_until, loaded_bound


async def test_a_killed_supervisor_is_dead_in_the_header_within_2_s_with_a_critical_alert_and_the_hint(
        tmp_path, tiny_model_dir, cleanup_runs):
    run_dir = tmp_path / "run"
    cleanup_runs.append(run_dir)
    cfg = make_config(run_dir, tiny_model_dir, prompts=300, gpus=1, sim=("--sim-step-ms", "30", "--sim-output-mean",
                                                                         "3000"))
    config = write_config(tmp_path, cfg)
    started = regen("start", "local", "--config", str(config), "--no-preflight", home=tmp_path)
    assert started.returncode == 0, started.stderr
    children_before = {c.pid for c in psutil.Process().children()}
    source = HostSource("local", str(run_dir), host_python=sys.executable, transport=LocalTransport())
    app = RegenApp(source, run_probes_on_start=False, export_dir=tmp_path)
    pid = 0
    try:
        async with app.run_test(size=(200, 45)) as pilot:
            await wait_until(pilot, lambda: "running" in header(app), "a running header", timeout=90)
            pid = int((run_dir / "supervisor.pid").read_text())
            os.killpg(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            await wait_until(pilot, lambda: "dead" in header(app), "dead in the header", timeout=30)
            seen_after = time.monotonic() - killed_at
            shown = " ".join(header(app).split())
            assert "- tok/s" in shown and "ETA -" in shown, shown
            critical = [a for a in app.model.alerts if a.severity == "critical"]
            assert critical and "killed, no cause recorded" in critical[-1].text, [a.text for a in app.model.alerts]
            await pilot.press("6")
            table = app.query_one("#alerts-table")
            row = next(i for i in range(table.row_count) if "supervisor dead" in str(table.get_row_at(i)))
            table.move_cursor(row=row)
            await wait_until(pilot, lambda: "resume with: cd " in text_of(app.query_one("#alert-detail")),
                             "the resume hint from the start record, under the dead alert")
            detail = " ".join(text_of(app.query_one("#alert-detail")).split())
            # the Workers tab shows no live server: the worker is gone, its figures "-", not its last readings
            await pilot.press("2")
            workers = app.query_one("#workers-table")
            def worker_gone() -> bool:
                return bool(workers.row_count) and "gone (was ready)" in str(workers.get_row_at(0))

            await wait_until(pilot, worker_gone, "the worker gone")
            row = [str(c) for c in workers.get_row_at(0)]
            assert row[4:8] == ["-", "-", "-", "-"], row  # tok/s, running, queued, in flight
            # the next step where the operator looks: the start record's line under the header, copied on y
            banner = " ".join(text_of(app.query_one("#next-step")).split())
            banner_shown = app.query_one("#next-step").display
            copied: list[str] = []
            app.copy_to_clipboard = copied.append
            await pilot.press("y")
            await wait_until(pilot, lambda: bool(copied), "the resume line copied")
    finally:
        await source.close()
        # the killed commands' transports see their exit while the loop runs: every child the TUI started is reaped
        await await_until(lambda: not [c for c in psutil.Process().children() if c.pid not in children_before], 10,
                          "the TUI's commands reaped", describe=lambda: f"children left: {psutil.Process().children()}")
        wait_for(lambda: not process_alive(pid), 30, "the killed supervisor gone")
    assert seen_after <= loaded_bound(2.0), f"dead shown {seen_after:.1f} s after the kill"
    line = f"cd {tmp_path} && regen start local --config {config} --no-preflight"
    assert line in detail
    assert banner_shown and f"next: {line}" in banner and "y copies it" in banner, banner
    assert copied == [line]
