"""Charts that read (issue 18): time axes labelled with their unit, every worker's sparkline on one printed scale,
an empty chart that says why in its body, a rehearsal's simulated VRAM, and the Workers tab at 80 columns.
SVG snapshots with frozen data and clock (regenerate with `--snapshot-update`), and the same facts asserted as text."""
from __future__ import annotations

import io
import math
import re
from pathlib import Path

from rich.console import Console

from console.tui.app import RegenApp
from console.tui.charts import TimeChart, time_unit
from console.host.source import ReplaySource
from engine.simulator.gpu import SIM_GPU_NAME
from engine.api.events import DispatchEvent, GpuEvent, WorkerEvent
from tests.test_tui_snapshots import frozen_app, frozen_telemetry, shows  # noqa: F401 (fixture)

T0 = 1796200000.0
TICK_S = 10.0
NO_NVML = "NVML unavailable: NVMLError_LibraryNotFound: NVML Shared Library Not Found"


def synthetic_run(path: Path, *, minutes: int, simulated_gpus: bool) -> float:
    """A run of two workers (gpu0 near 690 tok/s, gpu1 near 1,400) over `minutes`; the GPUs read by the simulator,
    or NVML missing. Returns the last event's ts."""
    events = []
    ticks = int(minutes * 60 / TICK_S)
    for i in range(ticks):
        ts = T0 + i * TICK_S
        wave = math.sin(i / 9.0)
        rates = {"gpu0": 690.0 + 40 * wave, "gpu1": 1360.0 + 40 * wave}
        for g, (name, rate) in enumerate(rates.items()):
            events.append(WorkerEvent(ts=ts, name=name, state="ready", gpus=[g], pid=2061234 + g, gen_throughput=rate,
                                      running_reqs=31, queued_reqs=0, in_flight=31, capacity=48))
            if simulated_gpus:
                events.append(GpuEvent(ts=ts, index=g, name=SIM_GPU_NAME, mem_used_mb=122_000.0 + 500 * g,
                                       mem_total_mb=139.8 * 1024, util_pct=93.0))
        if not simulated_gpus and i % 6 == 0:
            events.append(GpuEvent(ts=ts, index=0, error=NO_NVML))
        events.append(DispatchEvent(ts=ts, state="running", done=40 * i, total=40 * ticks + 4000, in_flight=62,
                                    tokens_per_s=sum(rates.values()), eta_s=3600.0))
    path.write_bytes(b"\n".join(e.to_json() for e in events) + b"\n")
    return events[-1].ts


def synthetic_app(tmp_path: Path, *, minutes: int = 50, simulated_gpus: bool = True) -> RegenApp:
    telemetry = tmp_path / "telemetry.jsonl"
    last = synthetic_run(telemetry, minutes=minutes, simulated_gpus=simulated_gpus)
    logs = {f"gpu{g}": "[2026-12-05 08:00:01] The server is fired up and ready to roll!\n" for g in (0, 1)}
    source = ReplaySource(telemetry, host="gpu-host", run_dir="/data/runs/rehearsal", logs=logs)
    return RegenApp(source, clock=lambda: last + 30.0, monotonic=lambda: 1000.0, live=False, export_dir=tmp_path,
                    run_probes_on_start=False)


def screen_text(app: RegenApp) -> str:
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, record=True,
                      legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True))
    return console.export_text()


async def settled(pilot) -> None:
    """The replay is folded and the Workers tab drawn (polled with a deadline: a loaded machine is slow)."""
    app = pilot.app
    for _ in range(300):
        if app.model.connection.state == "ended" and app.events_applied and app.active_tab == "workers":
            break
        await pilot.pause(0.1)
    await pilot.pause(0.5)


def test_the_unit_follows_the_span():
    assert [time_unit(s).name for s in (30, 119, 121, 3 * 3600, 3 * 3600 + 1, 86400 * 4)] == [
        "seconds", "seconds", "minutes", "minutes", "hours", "days"]


async def test_axes_say_minutes_ago_and_sparklines_share_one_printed_scale(tmp_path):
    app = synthetic_app(tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settled(pilot)
        text = screen_text(app)
        assert app.query_one("#throughput-chart", TimeChart).unit.name == "minutes"
        assert text.count("minutes ago") == 2  # throughput and VRAM
        assert "tok/s per worker (scale 0–1,400)" in text
        bars = {m[1]: set(m[2]) for m in re.finditer(r"│\s+(gpu\d)\s+([▁▂▃▄▅▆▇█]+)", text)}
        # one scale: gpu0 at about half of gpu1's rate reads about half as high, not full height
        assert bars["gpu0"] <= set("▃▄▅") and bars["gpu1"] <= set("▆▇█")
        assert "simulated (sglang-sim)" in text  # the VRAM chart says whose memory it shows


async def test_a_vram_chart_without_readings_says_why_in_its_body(tmp_path):
    app = synthetic_app(tmp_path, simulated_gpus=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await settled(pilot)
        vram_column = [line.split("││")[1] for line in screen_text(app).splitlines() if "││" in line]
        body = " ".join(" ".join(cell.strip(" │").split()) for cell in vram_column)
        assert f"no GPU readings: {NO_NVML}" in body
        assert app.query_one("#vram-chart", TimeChart).unit is None


def snapshot(app: RegenApp, snap_compare, size) -> bool:
    async def run_before(pilot) -> None:
        await settled(pilot)
    return snap_compare(app, terminal_size=size, run_before=run_before)


def test_snapshot_rehearsal_minutes_axes_shared_scale_simulated_vram(tmp_path, snap_compare):
    assert snapshot(synthetic_app(tmp_path), snap_compare, (120, 40))


def test_snapshot_no_nvml_says_why_in_the_chart(tmp_path, snap_compare):
    assert snapshot(synthetic_app(tmp_path, simulated_gpus=False), snap_compare, (120, 40))


def test_snapshot_workers_tab_at_80_columns(frozen_telemetry, tmp_path, snap_compare):  # noqa: F811
    assert snap_compare(frozen_app(frozen_telemetry, tmp_path), terminal_size=(80, 30), run_before=shows("2"))


async def test_workers_tab_at_80_columns_shows_pid_and_state_whole(frozen_telemetry, tmp_path):  # noqa: F811
    app = frozen_app(frozen_telemetry, tmp_path)
    async with app.run_test(size=(80, 30)) as pilot:
        await shows("2")(pilot)
        lines = screen_text(app).splitlines()
        header = next(line for line in lines if line.startswith(" worker"))
        assert header.split()[:9] == ["worker", "state", "pid", "gpus", "tok/s", "running", "queued", "in", "flight"]
        rows = [line.split() for line in lines if line.startswith(" gpu")]
        assert [r[:3] for r in rows] == [["gpu0", "stopped", "30477"], ["gpu1", "stopped", "30479"]]


async def test_the_histogram_without_statistics_says_why_in_its_body(tmp_path):
    app = synthetic_app(tmp_path)  # its run dir has no shards: the statistics cannot be computed
    async with app.run_test(size=(120, 40)) as pilot:
        await settled(pilot)
        await pilot.press("4")
        for _ in range(300):
            if app.model.stats_error:
                break
            await pilot.pause(0.1)
        await pilot.pause(0.3)
        hist_column = [line.split("│")[1] for line in screen_text(app).splitlines() if line.startswith("│")]
        body = " ".join(" ".join(cell.split()) for cell in hist_column)
        assert app.model.stats_error and "no statistics:" in body


async def test_all_zero_series_draw_on_a_range_of_their_own_not_minus_zero(tmp_path):
    """A finishing or finished run: every worker at 0 tok/s and every simulated GPU released. The charts keep a 0-1
    range (textual-plot's own scale for a flat zero series labelled its ticks -0.0000 to 0.00000)."""
    events = []
    for i in range(30):
        ts = T0 + i * TICK_S
        for g in (0, 1):
            events.append(WorkerEvent(ts=ts, name=f"gpu{g}", state="stopped", gpus=[g], gen_throughput=0.0))
            events.append(GpuEvent(ts=ts, index=g, name=SIM_GPU_NAME, mem_used_mb=0.0, mem_total_mb=139.8 * 1024,
                                   util_pct=0.0))
        events.append(DispatchEvent(ts=ts, state="finishing", done=100, total=100, in_flight=0, tokens_per_s=0.0))
    telemetry = tmp_path / "telemetry.jsonl"
    telemetry.write_bytes(b"\n".join(e.to_json() for e in events) + b"\n")
    source = ReplaySource(telemetry, host="gpu-host", run_dir="/data/runs/finished", logs={})
    app = RegenApp(source, clock=lambda: events[-1].ts + 5.0, monotonic=lambda: 1000.0, live=False,
                   export_dir=tmp_path, run_probes_on_start=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await settled(pilot)
        text = screen_text(app)
        assert "-0.0000" not in text and "0.00000" not in text, text
        assert "finishing" in text.splitlines()[0]
