"""Every host's GPUs and disks: a host agent's readings travel over its link to the supervisor's telemetry,
the status reply, the console's model and the Workers/Disk tabs and `regen status`, under that host's name;
a host whose readings stop shows N/A with why, not its last figures."""
from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import time
from pathlib import Path

import aiohttp
import pytest
from rich.console import Console
from textual.app import App, ComposeResult
from textual.widgets import DataTable, Static

from console.commands.status import render_status
from console.tui.charts import TimeChart
from console.view.model import RunModel
from console.tui.panel_disk import DiskPanel
from console.tui.panel_workers import COLUMNS, WorkersPanel
from engine.placement.hosts.link import HostLink
from engine.placement.hosts.readings import READINGS_FILE, HostReadings, publish_readings, take_reading
from engine.placement.hosts.readings_feed import STALE_AFTER_S, ReadingsFeed, ReadingsUnavailable
from engine.api.status import RunStatus
from engine.telemetry import Telemetry
from engine.api.events import DiskEvent, GpuEvent, WorkerEvent, parse_event
from engine.servers.workers import WorkerState
from tests.test_multihost_units import cfg_with
from tests.waiting import await_until

GIB_MB = 1024.0


class FakeSampler:
    """GpuSampler's interface with real-looking numbers: what a host with two H200s would read."""
    init_error = None

    def __init__(self) -> None:
        self.samples = 0
        self.closed = False

    def sample(self) -> list[GpuEvent]:
        self.samples += 1
        return [GpuEvent(index=i, name="NVIDIA H200", mem_used_mb=(40 + 10 * i) * GIB_MB, mem_total_mb=140 * GIB_MB,
                         util_pct=75.0, temp_c=61.0 + i, power_w=500.0) for i in (0, 1)]

    def close(self) -> None:
        self.closed = True


async def local_ssh(command: str, stdin: bytes | None = None, timeout: float = 60.0) -> tuple[int, str, str]:
    """The link's ssh, run here: the host's work dir is a local directory in these tests."""
    proc = await asyncio.create_subprocess_exec("bash", "-c", command, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
    return proc.returncode, out.decode(), err.decode()


def _telemetry_model(run_dir: Path) -> RunModel:
    m = RunModel("dispatch", str(run_dir))
    m.apply_all(parse_event(line) for line in (run_dir / "telemetry.jsonl").read_bytes().splitlines() if line.strip())
    return m


class _Workers(App):
    def compose(self) -> ComposeResult:
        yield WorkersPanel()


async def _workers_rows(m: RunModel) -> dict[str, dict[str, str]]:
    """The Workers tab's table as the operator reads it: row key -> column -> text."""
    app = _Workers()
    async with app.run_test(size=(220, 50)):
        panel = app.query_one(WorkersPanel)
        panel.refresh_from(m)
        table = app.query_one("#workers-table", DataTable)
        return {str(key.value): dict(zip(COLUMNS, (str(c) for c in table.get_row(key))))
                for key in table.rows}


async def test_a_remote_hosts_gpu_numbers_travel_from_its_agent_to_the_workers_row(tmp_path):
    work_dir, run_dir = tmp_path / "h1-work", tmp_path / "run"
    work_dir.mkdir()
    run_dir.mkdir()
    cfg = cfg_with([{"name": "h1", "address": "gpu-a", "gpus": [0, 1], "tp_size": 2, "work_dir": str(work_dir)}])
    sampler, stop = FakeSampler(), asyncio.Event()
    agent = asyncio.create_task(publish_readings(work_dir, "h1", sampler, stop, every_s=0.05))
    telemetry = Telemetry(run_dir)
    try:
        async with aiohttp.ClientSession() as session:
            link = HostLink(cfg, cfg.hosts[0], engine_root=Path("."), session=session, emit=telemetry.emit,
                            forward_base=45000)
            link.ssh = local_ssh
            await await_until(lambda: (work_dir / READINGS_FILE).exists(), 30, "the agent's first reading")
            await link.readings.poll()
            [member] = link.members
            member.set_state(WorkerState.READY)
            telemetry.emit(member.snapshot())
    finally:
        stop.set()
        await agent
        telemetry.close()

    assert set(telemetry.gpus) == {("h1", 0), ("h1", 1)}
    assert telemetry.gpus[("h1", 1)].mem_used_mb == 50 * GIB_MB
    disks = {path for host, path in telemetry.disk if host == "h1"}
    assert disks == {str(work_dir), "/dev/shm"}
    usage = os.statvfs(work_dir)
    shown = telemetry.disk[("h1", str(work_dir))]
    assert shown.total_bytes == usage.f_frsize * usage.f_blocks  # the agent's work dir's filesystem

    # the remote worker's row: its host's two GPUs, summed (not N/A as before, not the dispatch host's)
    m = _telemetry_model(run_dir)
    m.apply(GpuEvent(ts=time.time(), index=0, mem_used_mb=1.0, mem_total_mb=2.0))  # the dispatch host's GPU 0
    rows = await _workers_rows(m)
    assert rows["h1.gpu0-1"]["VRAM used/total"] == "90.0/280.0 GiB"
    assert rows["h1.gpu0-1"]["util"] == "75%" and rows["h1.gpu0-1"]["temp"] == "62°C"

    # the same numbers through the status reply (what a console attaching later folds first)
    reply = RunStatus(run_dir=str(run_dir), state="running", workers=[member.snapshot()],
                      gpus=list(telemetry.gpus.values()), disk=list(telemetry.disk.values())).to_dict()
    again = RunModel()
    again.apply_status(RunStatus.from_dict(json.loads(json.dumps(reply))))
    assert again.worker_gpu(again.workers["h1.gpu0-1"])["mem_used_mb"] == 90 * GIB_MB
    assert {g.label for g in again.gpus.values()} == {"h1/gpu0", "h1/gpu1"}


def test_a_reading_round_trips_and_a_bad_one_says_why():
    r = HostReadings(host="h1", pid=7, seq=3, ts=1.0, gpus=[GpuEvent(index=0, host="h1", error="NVML unavailable")],
                     disks=[DiskEvent(path="/w", host="h1", free_bytes=1, total_bytes=2)])
    back = HostReadings.from_json(r.to_json())
    assert dataclasses.asdict(back) == dataclasses.asdict(r)
    with pytest.raises(ValueError, match="not a host readings record"):
        HostReadings.from_json(b'{"host": "h1"}')
    with pytest.raises(ValueError, match="not a host readings record"):
        HostReadings.from_json(b"{half")


def test_an_agent_without_nvml_sends_its_own_error_and_an_unreadable_disk_says_why(tmp_path):
    class NoNvml(FakeSampler):
        init_error = "NVML unavailable: NVMLError_LibraryNotFound: NVML Shared Library Not Found (on h2)"

        def sample(self) -> list[GpuEvent]:
            return [GpuEvent(index=0, error=self.init_error)]

    r = take_reading("h2", NoNvml(), tmp_path / "gone", seq=1)
    assert [(g.host, g.index, g.mem_used_mb, g.error) for g in r.gpus] == [("h2", 0, None, NoNvml.init_error)]
    gone = next(d for d in r.disks if d.path == str(tmp_path / "gone"))
    assert gone.error is not None and "FileNotFoundError" in gone.error


async def test_readings_that_stop_turn_to_na_with_why_and_come_back():
    answers: list[str | Exception] = []
    emitted: list = []

    async def fetch() -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def reading(seq: int, pid: int = 7) -> str:
        return HostReadings(host="h2", pid=pid, seq=seq, ts=1.0, gpus=[GpuEvent(index=3, mem_used_mb=5.0)],
                            disks=[DiskEvent(path="/w", free_bytes=1, total_bytes=2)]).to_json().decode()

    feed = ReadingsFeed("h2", fetch, emitted.append)
    feed.mark_stale("the host cannot be reached")  # before any reading: GPU 0 stands for the host
    assert [(e.index, e.error) for e in emitted] == [(0, "no reading from h2: the host cannot be reached")]
    emitted.clear()
    answers.append(reading(1))
    await feed.poll()
    assert [(type(e).__name__, e.host, e.error) for e in emitted] == [("GpuEvent", "h2", None), ("DiskEvent", "h2", None)]
    assert feed.stale is None

    emitted.clear()
    answers.append(ReadingsUnavailable("ssh gpu-b: Connection timed out"))
    await feed.poll()
    assert emitted == []  # one missed read is not yet stale
    feed._fresh_at -= STALE_AFTER_S  # the deadline passed (no sleep: the clock is the feed's own)
    answers.append(reading(1))  # the same reading again: the agent no longer samples
    await feed.poll()
    assert [(type(e).__name__, e.mem_used_mb if isinstance(e, GpuEvent) else e.free_bytes) for e in emitted] == [
        ("GpuEvent", None), ("DiskEvent", 0)]
    assert all(e.error.startswith("no reading from h2: the host agent (pid 7) wrote no new reading") for e in emitted)

    emitted.clear()
    feed.mark_stale("the host is lost: the SSH port forwards exited (255)")
    assert {e.error.split(" (last")[0] for e in emitted} == {
        "no reading from h2: the host is lost: the SSH port forwards exited (255)"}
    emitted.clear()
    feed.mark_stale("the host is lost: the SSH port forwards exited (255)")
    assert emitted == []  # once per cause

    answers.append(reading(1, pid=8))  # a new agent after the rejoin
    await feed.poll()
    assert feed.stale is None and [e.error for e in emitted] == [None, None]

    # the console: the stale GPU and disk are N/A with the reason, then figures again
    m = RunModel()
    m.apply(GpuEvent(ts=1, host="h2", index=3, mem_used_mb=5.0, mem_total_mb=10.0))
    m.apply(DiskEvent(ts=1, host="h2", path="/w", free_bytes=1, total_bytes=2))
    m.apply(GpuEvent(ts=2, host="h2", index=3, error="no reading from h2: the host is lost"))
    m.apply(DiskEvent(ts=2, host="h2", path="/w", error="no reading from h2: the host is lost"))
    w = WorkerEvent(ts=2, name="h2.gpu3", host="h2", remote=True, gpus=[3])
    m.apply(w)
    assert m.worker_gpu(m.workers["h2.gpu3"])["mem_used_mb"] is None
    assert m.disks[("h2", "/w")].error and m.disks[("h2", "/w")].time_to_full() is None
    assert len(m.disks[("h2", "/w")].history) == 1  # the N/A is not a point of 0 bytes free


def test_status_groups_gpus_and_disks_by_host_and_a_single_host_looks_as_before():
    one = RunStatus(run_dir="/r", state="running", host="box",
                    gpus=[GpuEvent(index=0, name="H200", mem_used_mb=1000, mem_total_mb=2000)],
                    disk=[DiskEvent(path="/r", free_bytes=3 * 2**30, total_bytes=4 * 2**30)])
    console = Console(width=200, record=True)
    console.print(render_status(one))
    text = console.export_text()
    assert "(by host)" not in text and "┃ gpu ┃ name ┃ mem used/total MiB ┃" in text  # no host column
    assert "disk /r: 3.0 GiB free of 4.0 GiB" in text

    multi = dataclasses.replace(one, gpus=[*one.gpus, GpuEvent(index=0, host="h2", error="NVML unavailable: on h2"),
                                           GpuEvent(index=1, host="h1", mem_used_mb=10, mem_total_mb=20)],
                                disk=[*one.disk, DiskEvent(path="/w2", host="h2", error="no reading from h2: lost")])
    console = Console(width=200, record=True)
    console.print(render_status(multi))
    text = console.export_text()
    gpu_lines = [line for line in text.splitlines() if "H200" in line or "NVML" in line or "10/20" in line]
    assert [line.strip("│┃ ").split()[0] for line in gpu_lines] == ["dispatch", "h1", "h2"], text
    assert "NVML unavailable: on h2" in gpu_lines[2]
    assert "disk dispatch:/r: 3.0 GiB free of 4.0 GiB" in text
    assert "disk h2:/w2: N/A (no reading from h2: lost)" in text
    assert [g["host"] for g in multi.to_dict()["gpus"]] == ["", "h2", "h1"]  # --json: the same fields, plus host


class _Tabs(App):
    def compose(self) -> ComposeResult:
        yield WorkersPanel()
        yield DiskPanel()


async def test_the_vram_chart_and_the_disk_tab_group_every_hosts_rows():
    m = RunModel()
    gib = 2**30
    for ts in (1.0, 2.0):
        m.apply(GpuEvent(ts=ts, index=0, mem_used_mb=1000 * ts, mem_total_mb=8000))
        m.apply(GpuEvent(ts=ts, host="h2", index=1, mem_used_mb=2000 * ts, mem_total_mb=8000))
        m.apply(GpuEvent(ts=ts, host="h1", index=0, mem_used_mb=3000 * ts, mem_total_mb=8000))
        m.apply(DiskEvent(ts=ts, path="/run", free_bytes=int(50 * gib / ts), total_bytes=100 * gib))
        m.apply(DiskEvent(ts=ts, host="h1", path="/w1", free_bytes=int(40 * gib / ts), total_bytes=100 * gib))
    m.apply(DiskEvent(ts=3.0, host="h2", path="/w2", error="no reading from h2: the host is lost"))
    app = _Tabs()
    async with app.run_test(size=(220, 60)):
        drawn: dict[str, list[str]] = {}
        for chart_id in ("#vram-chart", "#disk-chart"):
            chart = app.query_one(chart_id, TimeChart)
            chart.draw = lambda series, now=None, _id=chart_id, **_: drawn.__setitem__(_id, [s[0] for s in series])
        app.query_one(WorkersPanel).refresh_from(m)
        disk_panel = app.query_one(DiskPanel)
        disk_panel.refresh_from(m)
        table = Console(width=200, record=True, file=io.StringIO())
        table.print(disk_panel.query_one("#disk-table", Static).content)
        text = table.export_text()
    assert drawn["#vram-chart"] == ["gpu0", "h1/gpu0", "h2/gpu1"]  # by host: the dispatch host's first, as before
    assert drawn["#disk-chart"] == ["/run", "h1:/w1", "h2:/w2"]
    rows = [[c.strip() for c in line.split("│")[1:3]] for line in text.splitlines() if "/run" in line or "/w" in line]
    assert rows == [["dispatch", "/run"], ["h1", "/w1"], ["h2", "/w2"]], text
    h2 = next(line for line in text.splitlines() if "/w2" in line)
    assert "N/A" in h2 and "no reading from h2" in text


def test_a_single_hosts_disk_tab_has_no_host_column():
    m = RunModel()
    m.apply(DiskEvent(ts=1, path="/run", free_bytes=1, total_bytes=2))
    assert [d.label for d in m.disks.values()] == ["/run"] and [g.label for g in m.gpus.values()] == []
