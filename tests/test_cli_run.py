"""The run commands as the operator types them: regen demo / start / status / pause / stop."""
from __future__ import annotations

import asyncio
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from console.host.deploy import start_run
from console.host.connect import open_transport
from engine.config.load import RunConfig, dump_toml, load_config
from engine.text.render import Renderer
from tests.test_engine_run import REPO, SupervisorProc, check_rows, make_config, read_rows, status, wait_for


def regen(*args: str, home: Path, timeout: float = 240, env: dict | None = None,
          wrap: list[str] | tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`regen ARGS` as the operator runs it; `wrap`: a command prefix (e.g. setpriv), `env`: extra variables."""
    full_env = dict(os.environ, HOME=str(home), PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([*wrap, sys.executable, "-m", "console.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=str(home))


@pytest.fixture
def cleanup_runs():
    run_dirs: list[Path] = []
    yield run_dirs
    for run_dir in run_dirs:
        sup = SupervisorProc(run_dir)
        pid_file = run_dir / "supervisor.pid"
        if pid_file.exists():
            try:
                os.killpg(int(pid_file.read_text()), 9)
            except (ProcessLookupError, ValueError):
                pass  # already exited: nothing to clean
        sup.cleanup()


@pytest.mark.slow
def test_demo_headless_until_done(tmp_path, cleanup_runs):
    run_dir = tmp_path / "demo run"
    cleanup_runs.append(run_dir)
    r = regen("demo", "--quick", "--headless", "--until-done", "--gpus", "2", "--prompts", "500", "--run-dir", str(run_dir),
              "--sim-arg=--sim-step-ms", "--sim-arg=3", home=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "run done" in r.stdout and f"{run_dir}/shards" in r.stdout
    cfg = load_config(run_dir / "run.toml")
    rows = read_rows(run_dir)
    assert len(rows) > 500
    renderer = Renderer(cfg.tokenizer_path, enable_thinking=cfg.enable_thinking, context_length=cfg.context_length)
    check_rows(rows, cfg, renderer)
    kinds = {json.loads(line)["kind"] for line in (run_dir / "rejects.jsonl").read_text().splitlines()}
    assert {"malformed_json", "unknown_role", "no_conversation", "context_overflow"} <= kinds


def start_local(cfg: RunConfig, tmp_path: Path) -> subprocess.CompletedProcess:
    """`regen start local` of cfg (written to tmp_path/run.toml), asserted started. The preflight of a
    single-host start is tests/test_faults_fatal.py's: here, the run's operations."""
    config_path = tmp_path / "run.toml"
    config_path.write_text(dump_toml(cfg))
    r = regen("start", "local", "--config", str(config_path), "--no-preflight", home=tmp_path)
    assert r.returncode == 0, r.stderr
    return r


def test_start_status_pause_stop_over_local(tmp_path, tiny_model_dir, cleanup_runs):
    run_dir = tmp_path / "run; with 'quotes'"
    cleanup_runs.append(run_dir)
    # a run that outlasts status, pause, resume and stop on a box loaded past its cores (200 answers of ~9 s, 8 at a
    # time: ~4 min), whose drain is one answer long (at 64 running requests and 8 tokens a step it ended first)
    cfg = make_config(run_dir, tiny_model_dir, prompts=200, sim=("--sim-output-mean", "300", "--sim-step-ms", "60",
                                                                  "--sim-tokens-per-step", "2", "--max-running-requests", "4"))
    r = start_local(cfg, tmp_path)
    assert "started: supervisor pid" in r.stdout
    assert "supervisor: tokenizer loaded" in r.stderr and "supervisor: workers launched" in r.stderr
    again = regen("start", "local", "--config", str(tmp_path / "run.toml"), "--no-preflight", home=tmp_path)
    assert again.returncode == 1 and "already runs" in again.stderr
    st = regen("status", "local", "--run-dir", str(run_dir), "--json", home=tmp_path)
    assert st.returncode == 0, st.stderr
    data = json.loads(st.stdout)
    assert data["run_dir"] == str(run_dir) and data["state"] in ("starting", "running")
    human = regen("status", "local", "--run-dir", str(run_dir), home=tmp_path)
    assert human.returncode == 0 and "workers" in human.stdout and "shards" in human.stdout
    p = regen("pause", "local", "--run-dir", str(run_dir), "s00001", home=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "paused now: s00001" in p.stdout
    bad = regen("pause", "local", "nope", "--run-dir", str(run_dir), home=tmp_path)
    assert bad.returncode == 1 and "unknown shard" in bad.stderr
    res = regen("resume", "local", "--all", "--run-dir", str(run_dir), home=tmp_path)
    assert res.returncode == 0, res.stderr
    stop = regen("stop", "local", "--run-dir", str(run_dir), "--drain", home=tmp_path)
    assert stop.returncode == 0, stop.stderr
    wait_for(lambda: not (run_dir / "supervisor.pid").exists(), 60, "the supervisor to exit")
    # the supervisor is gone: status says so and shows what the run dir last recorded
    gone = regen("status", "local", "--run-dir", str(run_dir), home=tmp_path)
    assert gone.returncode == 4, gone.stderr  # not running, no fault recorded
    assert "state drained" in gone.stdout and "supervisor not running" in gone.stdout
    said = " ".join(gone.stdout.split())
    # the resume line from the run's start record: the start as it was typed, in the directory it was typed in
    assert said.startswith("drained: drain requested over the control socket (regen stop --drain); resume with: "
                           f"cd {shlex.quote(str(tmp_path))} && regen start local --config "), said
    assert "- tok/s" in said and "ETA -" in said
    last = json.loads(regen("status", "local", "--run-dir", str(run_dir), "--json", home=tmp_path).stdout)
    assert last["offline"] and last["state"] == "drained" and last["running"] is False and last["fatal"] is None
    assert set(last) == set(data)  # one shape, live and offline
    assert sum(sh["done"] for sh in last["shards"]) == last["dispatch"]["done"] == len(read_rows(run_dir))
    nowhere = regen("status", "local", "--run-dir", str(tmp_path / "no-run"), home=tmp_path)
    assert nowhere.returncode == 2, nowhere.stdout
    assert "stopped" in (run_dir / "supervisor.log").read_text()


def test_status_follow_prints_progress_until_the_run_ends(tmp_path, tiny_model_dir, cleanup_runs):
    run_dir = tmp_path / "follow run"
    cleanup_runs.append(run_dir)
    # ~15 s of run (40 answers of ~2.4 s, 8 at a time): `--follow` attaches while it runs on a loaded box
    cfg = make_config(run_dir, tiny_model_dir, prompts=40, sim=("--sim-output-mean", "120", "--sim-step-ms", "40",
                                                                 "--sim-tokens-per-step", "2", "--max-running-requests", "4"))
    r = start_local(cfg, tmp_path)
    followed = regen("status", "local", "--run-dir", str(run_dir), "--follow", home=tmp_path, timeout=180)
    assert followed.returncode == 0, followed.stdout[-2000:] + followed.stderr[-2000:]
    lines = followed.stdout.splitlines()
    progress = [ln for ln in lines if "samples (" in ln]
    assert len(progress) >= 2, followed.stdout  # the status at attach, then one per change
    assert len(progress) == len(set(progress)), "a line repeated without a change"
    done = len(read_rows(run_dir))
    assert progress[-1].split(" ", 1)[1].startswith(f"done: {done}/"), progress[-1]
    assert "ETA -" in progress[-1] and "- tok/s" in progress[-1]
    assert not (run_dir / "supervisor.pid").exists()  # it returned because the run ended


@pytest.mark.sshd
def test_start_and_status_over_ssh(sshd, tmp_path, tiny_model_dir, cleanup_runs):
    run_dir = tmp_path / "ssh run"
    cleanup_runs.append(run_dir)
    cfg = make_config(run_dir, tiny_model_dir, prompts=20)

    async def go():
        transport = await open_transport(sshd.alias, ssh_config=str(sshd.ssh_config_path))
        try:
            started = await start_run(transport, cfg, host_python=sys.executable)
            client = started.client(transport)
            st = await client.status()
            assert st.run_dir == str(run_dir)
            events = []
            async for ev in client.follow(since=0):
                events.append(ev)
            return events
        finally:
            await transport.close()

    events = asyncio.run(go())
    dispatch = [e for e in events if e.type == "dispatch"]
    assert dispatch and dispatch[-1].state == "done"
