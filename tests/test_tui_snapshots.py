"""SVG snapshots of every panel at 120x40 with frozen data (a recorded engine run plus a few built
events) and a frozen clock. Regenerate with `pytest tests/test_tui_snapshots.py --snapshot-update`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from console.tui.app import RegenApp
from console.host.source import ReplaySource
from engine.api.events import AlertEvent, DispatchEvent, GpuEvent, WorkerEvent, parse_event
from probes.model import ProbeReport, ProbeResult, Status

DATA = Path(__file__).parent / "data"
SIZE = (120, 40)


def frozen_report() -> ProbeReport:
    return ProbeReport(host="gpu-host", started_at=1796219900.0, duration_s=2.4, results=[
        ProbeResult("connection", "connection to the host", Status.PASS, "root@gpu-host (Linux 6.1 x86_64)",
                    command="id -un && uname -n && uname -srm", exit_status=0, stdout="root\ngpu-host\nLinux 6.1 x86_64\n",
                    duration_s=0.1),
        ProbeResult("host.python", "host Python interpreter", Status.PASS, "Python 3.11.7 at /opt/venv/bin/python",
                    command="python3 -c <probes/host/pyinfo.py>", exit_status=0, stdout='{"version": "3.11.7"}',
                    duration_s=0.3),
        ProbeResult("packages", "Python packages of the host env", Status.FAIL, "sglang is not installed",
                    expected="sglang >= 0.4 importable", actual="ModuleNotFoundError: No module named 'sglang'",
                    command="python3 -c <probes/host/packages.py>", exit_status=0,
                    stdout='{"sglang": {"error": "ModuleNotFoundError"}}', stderr="", duration_s=1.9,
                    remedy="pip install 'sglang[all]' in the host env (run config host_python)"),
        ProbeResult("gpu.nvidia_smi", "GPUs (nvidia-smi)", Status.ERROR, "nvidia-smi: command not found (exit 127)",
                    expected="nvidia-smi lists the GPUs", actual="exit status 127",
                    command="nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader", exit_status=127,
                    stderr="sh: 1: nvidia-smi: not found\n", duration_s=0.05,
                    remedy="install the NVIDIA driver (nvidia-smi comes with it)"),
        ProbeResult("disk.shm", "shared memory (/dev/shm)", Status.WARN, "/dev/shm: 2.0 GiB free, under 8 GiB",
                    command="df -P -B1 /dev/shm", exit_status=0, duration_s=0.02),
        ProbeResult("gpu.nvml", "GPUs through NVML", Status.SKIP, "needs gpu.nvidia_smi, which is ERROR"),
    ])


@pytest.fixture(scope="module")
def frozen_telemetry(tmp_path_factory) -> tuple[Path, float]:
    """The recorded demo run plus GPU samples (the demo host has no NVML) and a few alerts."""
    lines = (DATA / "tui_telemetry.jsonl").read_bytes().splitlines()
    events = [parse_event(line) for line in lines if line.strip()]
    ticks = sorted({round(e.ts, 1) for e in events if isinstance(e, DispatchEvent)})
    # the batch sizes (recorded before the field): gpu0 reported its own; gpu1's was corrected by its queue
    batches = {"gpu0": (32, "internal_states", 32, "internal_states"), "gpu1": (40, "feedback", 32, "log")}
    extra = []
    for i, ts in enumerate(ticks):
        for g in (0, 1):
            extra.append(GpuEvent(ts=ts + 0.01, index=g, name="NVIDIA H100 80GB HBM3", mem_used_mb=60000 + 900 * i + 3000 * g,
                                  mem_total_mb=81559, util_pct=80 + 7 * g, temp_c=None if g else 61.0, power_w=420.0))
    last = max(e.ts for e in events)
    extra += [
        WorkerEvent(ts=last - 8, name="gpu1", state="crashed", gpus=[1], restarts=0, error="exit -9 (SIGKILL): out of memory"),
        WorkerEvent(ts=last - 6, name="gpu1", state="ready", gpus=[1], restarts=1, gen_throughput=610.0, running_reqs=18,
                    queued_reqs=0),
        AlertEvent(ts=last - 5, severity="error", text="shard s00001: 12% empty answers (threshold alerts.empty_share 5%)",
                   evidence="8 of 65 samples", key="empty:s00001"),
        AlertEvent(ts=last - 4, severity="warning", text="throughput dropped: 410 tok/s vs 1300 median", key="throughput-drop"),
    ]
    # and the prefix-cache figures (also recorded before the fields): gpu1's cache started cold after its crash
    served = {"gpu0": (1_240_000, 1_016_800), "gpu1": (1_180_000, 436_600)}
    for e in events + extra:
        if isinstance(e, WorkerEvent):
            e.batch_size, e.batch_source, e.discovered_batch, e.discovered_source = batches[e.name]
            e.prompt_tokens, e.cached_tokens = served[e.name]
    out = tmp_path_factory.mktemp("frozen") / "telemetry.jsonl"
    merged = sorted(events + extra, key=lambda e: e.ts)
    out.write_bytes(b"\n".join(e.to_json() for e in merged) + b"\n")
    return out, last


def frozen_app(frozen_telemetry, tmp_path) -> RegenApp:
    path, last = frozen_telemetry
    logs = {"gpu0": "[2026-12-02 13:59:25] Load weight end. type=Qwen3ForCausalLM\n"
                    "[2026-12-02 13:59:26] The server is fired up and ready to roll!\n"
                    "[2026-12-02 13:59:30] Decode batch. #running-req: 31, #token: 5120, gen throughput (token/s): 642.10\n"}
    source = ReplaySource(path, host="gpu-host", run_dir="/data/runs/demo",
                          stats=json.loads((DATA / "tui_stats.json").read_text()), logs=logs,
                          probe_report=frozen_report())
    return RegenApp(source, clock=lambda: last + 600.0, monotonic=lambda: 1000.0, live=False, export_dir=tmp_path)


def shows(*keys: str):
    async def run_before(pilot) -> None:
        await pilot.pause(0.5)
        app = pilot.app
        for _ in range(50):  # the replay is read and folded
            if app.model.connection.state == "ended" and app.model.state == "done":
                break
            await pilot.pause(0.1)
        for key in keys:
            await pilot.press(key)
            await pilot.pause(0.3)
        for _ in range(30):
            if not app.workers._workers or all(w.is_finished for w in app.workers._workers):
                break
            await pilot.pause(0.1)
        await pilot.pause(0.5)
    return run_before


@pytest.mark.parametrize("tab,keys", [
    ("preflight", ("1", "down", "down")),
    ("workers", ("2",)),
    ("shards", ("3", "down")),
    ("quality", ("4",)),
    ("disk", ("5",)),
    ("alerts", ("6",)),
    ("help", ("question_mark",)),
])
def test_panel_snapshot(tab, keys, frozen_telemetry, tmp_path, snap_compare):
    assert snap_compare(frozen_app(frozen_telemetry, tmp_path), terminal_size=SIZE, run_before=shows(*keys))


def test_shards_at_10000_snapshot(snap_compare):
    """10,000 shards (tests/shard_fixtures.py), sorted by empty share, the cursor on the first problem, selected
    (space leaves the cursor where it is): the summary by state, the filter and sort line, the visible rows only."""
    from tests.shard_fixtures import SHARDS, T0, ShardsSource

    app = RegenApp(ShardsSource(), clock=lambda: T0 + 5, monotonic=lambda: 1000.0, live=False,
                   run_probes_on_start=False)

    async def run_before(pilot) -> None:
        await pilot.press("3")
        for _ in range(300):
            if pilot.app.panel("shards").table.row_count == SHARDS:
                break
            await pilot.pause(0.1)
        for key in ("s", "s", "n", "space"):
            await pilot.press(key)
        await pilot.pause(0.5)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
