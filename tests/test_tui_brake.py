"""The data-quality brake on the console: the TUI's header, Shards summary and Data quality status say it braked, why
(the numbers) and the likely causes, from the brake alert and from a status reply (Pilot, frozen data)."""
from __future__ import annotations

import dataclasses
import io

from rich.console import Console
from textual.widgets import Static

from console.tui.app import RegenApp
from console.view.model import RunModel
from console.host.source import ReplaySource
from engine.config.load import RunConfig
from engine.run.brake import RunBrake
from engine.api.status import RunStatus
from engine.api.events import AlertEvent, DispatchEvent, ShardEvent
from tests.test_brake import EMPTY, GOOD

T0 = 1796219900.0


def brake_status(now: float = T0):
    brake = RunBrake(RunConfig(run_dir="/data/runs/r", model="/m", prompts=("/p.jsonl",)), "/data/runs/r")
    brake.window.add([EMPTY] * 174 + [GOOD] * 26)
    return brake.judge(now=now), brake


def alert_of(status, ts: float) -> AlertEvent:
    return AlertEvent(ts=ts, severity="error", key="brake", text=f"data-quality brake: dispatch paused run-wide: "
                      f"{status.text}", evidence=status.evidence())


def text_of(widget: Static, width: int = 300) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(widget.content if isinstance(widget, Static) else widget.render())  # the header renders
    return " ".join(console.export_text().split())


async def test_the_tui_shows_the_brake_and_its_cause(tmp_path):
    status, _ = brake_status()
    events = [
        DispatchEvent(ts=T0 - 2, done=180, total=990, state="running"),
        ShardEvent(ts=T0 - 2, id="s00000", state="running", done=180, total=500, empty=157),
        alert_of(status, T0),
        DispatchEvent(ts=T0 + 2, done=412, total=990, state="paused"),
    ]
    path = tmp_path / "telemetry.jsonl"
    path.write_bytes(b"\n".join(e.to_json() for e in events) + b"\n")
    app = RegenApp(ReplaySource(path, host="gpu-host", run_dir="/data/runs/r"), clock=lambda: T0 + 10,
                   monotonic=lambda: 1000.0, live=False, export_dir=tmp_path)
    async with app.run_test(size=(160, 40)) as pilot:
        for _ in range(100):
            if app.model.dispatch is not None and app.model.dispatch.done == 412:
                break
            await pilot.pause(0.1)
        header = text_of(app.query_one("#run-header"))
        assert "BRAKED: empty answers" in header and "87.0% (174 of the last 200 committed samples" in header
        await pilot.press("3")
        await pilot.pause(0.3)
        summary = text_of(app.query_one("#shards-summary", Static))
        assert "BRAKED: empty answers" in summary and "R (resume all) releases the brake" in summary
        assert "chat template" in summary and "prompt extraction" in summary
        await pilot.press("4")
        await pilot.pause(0.3)
        quality = text_of(app.query_one("#quality-status", Static))
        assert "⚑ BRAKED: empty answers" in quality and "likely cause: enable_thinking" in quality
        assert "regen resume gpu-host --run-dir /data/runs/r --all" in quality  # the console's host, not HOST


def test_the_model_takes_the_brake_from_status_replies_and_newer_alerts_only():
    status, brake = brake_status()
    m = RunModel("gpu-host", "/data/runs/r")
    reply = RunStatus(run_dir="/data/runs/r", state="paused", checked_at=T0 + 5, brake=brake.status())
    assert {"shards", "stats"} <= m.apply_status(reply)
    assert m.brake.engaged and m.brake_line().startswith("BRAKED: empty answers") and m.brake.samples == 200
    m.apply(alert_of(status, T0))  # a backfilled copy, older than the reply: the reply's stays
    assert m.brake.samples == 200 and m.brake.crossed
    m.apply(AlertEvent(ts=T0 + 9, severity="info", key="brake", text="cleared: data-quality brake released"))
    assert not m.brake.engaged and m.brake_line() == ""
    brake.release()
    later = dataclasses.replace(brake.status())
    m.apply_status(RunStatus(run_dir="/data/runs/r", state="running", checked_at=T0 + 12, brake=later))
    assert not m.brake.engaged and m.brake.samples == 0
