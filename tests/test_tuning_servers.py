"""regen applies SGLang's tuning guide on live simulator servers: `regen plan --pilot` on the demo's config measures
token usage under 0.9 while requests queue and prints the lowered --schedule-conservativeness with those figures; a
server that retracts more than once a minute is relaunched with a higher value and an alert saying why."""
from __future__ import annotations

import asyncio
import io
import json
import sys
import tempfile
from pathlib import Path

import aiohttp
import pytest
from rich.console import Console

from console.cli import main as cli_main
from console.commands.demo import demo_config, write_prompts
from console.commands.plan import render
from engine.api.events import AlertEvent, WorkerEvent
from engine.api.reports import Plan
from engine.api.tuning import TuningSource
from engine.api.wire import WorkerState
from engine.config.load import SIMULATOR_LAUNCH, RunConfig, Sampling, Workers, dump_toml
from engine.servers.identity_record import IDENTITY_FILE, IdentityRecord
from engine.servers.launch import worker_specs
from engine.servers.tuning import RunTuning
from engine.servers.tuning_record import RECORD_FILE
from engine.servers.workers import Worker
from tests.sshd_fixtures import free_port_base
from tests.test_tuning_config import pilot_record
from tests.waiting import await_until


@pytest.fixture(autouse=True)
def pilot_logs_in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.mark.slow
def test_a_pilot_on_the_demos_servers_prints_a_lowered_value_with_the_usage_that_led_to_it(tmp_path, tiny_model_dir,
                                                                                          capsys):
    prompts = write_prompts(tmp_path / "prompts", 200, 0)
    cfg = demo_config(tmp_path / "run", tiny_model_dir, prompts, 2, [])  # `regen demo --quick`'s servers
    path = tmp_path / "run.toml"
    path.write_text(dump_toml(cfg))
    assert cli_main(["plan", "local", "--config", str(path), "--pilot", "40", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    t = d["tuning"]
    assert (t["source"], t["verdict"], t["measured_at_value"], t["value"]) == ("pilot", "lower", 1.0, 0.3), t["reason"]
    assert [e["server"] for e in t["evidence"]] == ["gpu0", "gpu1"]
    for e in t["evidence"]:
        assert e["source"].startswith(f"pilot: {e['server']} http://127.0.0.1:") and e["source"].endswith("/metrics")
        assert e["queued_readings"] > 0 and e["usage_queued"] < 0.9 and e["retractions"] == 0  # 0.5.23 counts them
    text = io.StringIO()
    render(Plan.from_dict(d), Console(file=text, width=400))
    lines = text.getvalue().splitlines()
    head = lines.index("schedule conservativeness: 0.3 (pilot, lower; within [0.3, 1.3])")
    why = lines[head + 1]
    assert why.startswith("  why: token usage 0.") and " (< 0.9) in " in why and " readings with requests queued" in why
    assert why.endswith("admission holds requests back; lowered from 1 to 0.3")
    assert lines[head + 2].startswith("  measured on gpu0: token usage 0.") and " ago" in lines[head + 2]
    assert any(line.startswith(f"  recorded in {cfg.run_dir}/tuning.json: `regen start` launches the servers with it")
               for line in lines)
    record = json.loads((Path(cfg.run_dir) / RECORD_FILE).read_text())
    assert record["pilot"]["value"] == 0.3 and record["servers"] == []
    # the run that follows starts from it, and says so
    assert RunTuning(cfg, Path(cfg.run_dir)).start_alert().text.startswith(
        "servers start with --schedule-conservativeness 0.3 (pilot)")


def retracting_config(run_dir: Path, model: Path) -> RunConfig:
    """One simulator whose pool holds about two answers: admitted on the new-token estimate at a low value, the
    requests outgrow the pool and SGLang's scheduler retracts some."""
    return RunConfig(run_dir=str(run_dir), model=str(model), prompts=("/unused.jsonl",), context_length=4096,
                     sampling=Sampling(max_new_tokens=3000),
                     workers=Workers(gpus=(0,), base_port=free_port_base(1),
                                     launch=SIMULATOR_LAUNCH.replace("{python}", sys.executable), ready_timeout_s=60.0,
                                     extra_args=("--max-total-tokens", "4000", "--context-length", "4096",
                                                 "--sim-step-ms", "1", "--sim-step-ms-per-req", "0",
                                                 "--sim-output-mean", "1500", "--sim-output-sigma", "0.3")))


@pytest.mark.slow
async def test_a_server_retracting_more_than_once_a_minute_restarts_more_conservative_with_an_alert(
        tmp_path, tiny_model_dir):
    cfg = retracting_config(tmp_path / "run", tiny_model_dir)
    pilot_record(cfg, 0.3)  # the pilot chose 0.3; this workload retracts at it
    events: list[object] = []
    async with aiohttp.ClientSession() as session:
        worker = Worker(spec=worker_specs(cfg)[0], cfg=cfg, run_dir=Path(cfg.run_dir), session=session,
                        emit=events.append, tuner=RunTuning(cfg, Path(cfg.run_dir)).for_server("gpu0"))
        worker.start()
        try:
            await await_until(lambda: worker.state == WorkerState.READY, 60, "gpu0 ready")
            sent = [asyncio.ensure_future(session.post(worker.url + "/generate", json={
                "rid": f"r{i}", "input_ids": [11, 12, 13, 14] * 5, "sampling_params": {"max_new_tokens": 3000}}))
                for i in range(20)]
            await await_until(lambda: (worker.metrics.retracted or 0) >= 3, 60, "3 retractions on gpu0's /metrics",
                              describe=lambda: f"{worker.metrics}")
            worker.restart()
            await await_until(lambda: [e for e in events if isinstance(e, AlertEvent)
                                       and e.key == "worker:gpu0:tuning"], 30, "the tuning alert")
            await await_until(lambda: worker.state == WorkerState.READY and worker.restarts == 1, 60, "gpu0 relaunched")
            for fut in sent:
                fut.cancel()
            await asyncio.gather(*sent, return_exceptions=True)
        finally:
            await worker.stop()
    [alert] = [e for e in events if isinstance(e, AlertEvent) and e.key == "worker:gpu0:tuning"]
    assert alert.severity == "warning"
    assert alert.text.startswith("worker gpu0 restarts with --schedule-conservativeness 0.6 (was 0.3): ")
    assert " requests retracted in 1m00s of serving (" in alert.text
    assert alert.text.endswith(" a minute, more than 1): the KV pool runs out")
    assert "gpu0: token usage" in alert.evidence and "bounds [0.3, 1.3]" in alert.evidence
    log = (Path(cfg.run_dir) / "workers" / "gpu0" / "server.log").read_text()
    launches = [line for line in log.splitlines() if "launching:" in line]
    assert "--schedule-conservativeness 0.3" in launches[0] and "--schedule-conservativeness 0.6" in launches[1]
    last = [e for e in events if isinstance(e, WorkerEvent)][-1]
    assert (last.conservativeness, last.conservativeness_source) == (0.6, TuningSource.RESTART)
    saved = json.loads((Path(cfg.run_dir) / RECORD_FILE).read_text())["servers"]
    assert [(s["value"], s["floor"]) for s in saved] == [(0.6, 0.3)]
    # as a host agent's worker, its identity record says so: the dispatch host shows it and records it as the run's
    # (tests/test_tuning_hosts.py)
    told = IdentityRecord.from_json((Path(cfg.run_dir) / "workers" / "gpu0" / IDENTITY_FILE).read_text()).tuning
    assert told is not None and (told.value, told.source, told.floor) == (0.6, TuningSource.RESTART, 0.3)
    assert told.reason.endswith("raised from 0.3 to 0.6")
