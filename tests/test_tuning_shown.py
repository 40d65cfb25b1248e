"""A server's retractions and --schedule-conservativeness where the operator reads them: `regen status` (text and
--json), the TUI workers table and regen's own Prometheus metrics; a server that exports no retraction counter (SGLang
0.5.5) shows N/A, never 0."""
from __future__ import annotations

import json
import time

from rich.console import Console

from console.commands.status import render_status
from console.tui.panel_workers import COLUMNS, worker_cells
from console.view.model import RunModel
from engine.api.events import WorkerEvent
from engine.api.status import RunStatus
from engine.observe.metrics_server import families
from engine.servers.metrics_client import parse_metrics
from engine.simulator.metrics import SimMetrics


def workers() -> list[WorkerEvent]:
    now = time.time()
    return [WorkerEvent(ts=now, name="gpu0", state="ready", gpus=[0], pid=101, retracted=12.0, conservativeness=0.6,
                        conservativeness_source="restart", running_reqs=40.0, queued_reqs=8.0, token_usage=0.93),
            WorkerEvent(ts=now, name="gpu1", state="ready", gpus=[1], pid=102, retracted=None, conservativeness=0.3,
                        conservativeness_source="pilot", running_reqs=60.0, queued_reqs=4.0, token_usage=0.71)]


def status() -> RunStatus:
    return RunStatus.from_dict({"run_dir": "/r", "state": "running", "running": True, "pid": 7, "started_at": 1.0,
                                "host": "gpubox", "workers": [w.to_dict() for w in workers()]})


def test_the_counter_is_read_from_real_sglang_names_and_missing_is_none():
    # 0.5.23 exports sglang:num_retracted_requests_total (a Counter: prometheus_client adds _total); 0.5.5 only the
    # gauge of the last logging interval
    new = SimMetrics("m", retraction_counters=True)
    new.count_retracted(requests=5, input_tokens=500, output_tokens=300)
    new.set_retracted(2)
    assert parse_metrics(new.exposition().decode()).retracted == 5.0
    old = SimMetrics("m")
    old.set_retracted(2)
    assert parse_metrics(old.exposition().decode()).retracted is None


def test_status_shows_retractions_per_server_and_each_servers_value_with_its_source():
    console = Console(width=200, record=True)
    console.print(render_status(status(), console))
    text = console.export_text()
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.strip("│").split("│")]
            for line in text.splitlines() if line.startswith("│ gpu")}
    header = next(line for line in text.splitlines() if "retracted" in line)
    at = [c.strip() for c in header.strip("┃").split("┃")].index("retracted")
    assert rows["gpu0"][at] == "12" and rows["gpu1"][at] == "N/A"
    assert "--schedule-conservativeness: 0.6 (restart) on gpu0; 0.3 (pilot) on gpu1" in text
    data = json.loads(json.dumps(status().to_dict()))
    assert [(w["retracted"], w["conservativeness"], w["conservativeness_source"]) for w in data["workers"]] == [
        (12.0, 0.6, "restart"), (None, 0.3, "pilot")]


def test_the_tui_workers_table_has_a_retracted_and_a_conserv_column():
    m = RunModel("gpubox", "/r")
    m.apply_all(workers())
    cells = {name: dict(zip(COLUMNS, worker_cells(m, w))) for name, w in m.workers.items()}
    assert (cells["gpu0"]["retracted"], cells["gpu0"]["conserv."]) == ("12", "0.6 (restart)")
    assert (cells["gpu1"]["retracted"], cells["gpu1"]["conserv."]) == ("N/A", "0.3 (pilot)")


def test_regens_metrics_carry_each_servers_retractions_and_value():
    fams = {f.name: f for f in families(status())}
    retracted = {s.labels["worker"]: s.value for s in fams["regen_worker_retracted_requests"].samples}
    assert retracted == {"gpu0": 12.0}  # gpu1 exports no counter: absent, not 0
    value = {(s.labels["worker"], s.labels["source"]): s.value
             for s in fams["regen_worker_schedule_conservativeness"].samples}
    assert value == {("gpu0", "restart"): 0.6, ("gpu1", "pilot"): 0.3}
