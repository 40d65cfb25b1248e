"""`regen start`'s contract with the operator: a second start on a live run is refused with that cause first (never a
ports FAIL whose remedy would stop the live run's own servers); a start whose workers did not all launch while the
others run exits 0 with a warning line naming the one that did not; a preflight's warnings are named, not counted.
"""
from __future__ import annotations

import json

from tests.run_helpers import events, make_config, process_alive, wait_for
from tests.test_cli_run import cleanup_runs, regen  # noqa: F401  (fixture)
from tests.test_faults_fatal import write_config
from tests.test_faults_foreign_server import foreign_servers  # noqa: F401  (fixture)


def _ready_workers(run_dir) -> set[str]:
    if not (run_dir / "telemetry.jsonl").exists():
        return set()
    return {e["name"] for e in events(run_dir) if e["type"] == "worker" and e.get("state") == "ready"}


def test_a_second_start_on_a_live_run_is_refused_with_that_cause_first(tmp_path, tiny_model_dir, cleanup_runs):
    run_dir = tmp_path / "run"
    cleanup_runs.append(run_dir)
    # slow steps: the run must still be live after a second start and a probe (~10 s on a loaded box)
    cfg = make_config(run_dir, tiny_model_dir, prompts=400, gpus=2,
                      sim=("--sim-output-mean", "4000", "--sim-step-ms", "50"))
    config = write_config(tmp_path, cfg)
    first = regen("start", "local", "--config", str(config), home=tmp_path, env={"COLUMNS": "300"})
    assert first.returncode == 0, first.stdout + first.stderr
    assert "preflight passed on local" in first.stderr and "  sampling: temperature" in first.stderr
    wait_for(lambda: _ready_workers(run_dir) == {"gpu0", "gpu1"}, 90, "both servers ready")

    again = regen("start", "local", "--config", str(config), home=tmp_path, env={"COLUMNS": "300"})
    assert again.returncode == 1, again.stdout + again.stderr
    err = again.stderr
    assert "regen start: a supervisor (pid " in err and f"already runs this run dir local:{run_dir}" in err
    assert f"regen status local --run-dir {run_dir}" in err and f"regen stop local --run-dir {run_dir}" in err
    assert "stop that process" not in err and "FAIL ports" not in err

    probe = regen("probe", "local", "--config", str(config), "--json", home=tmp_path)
    report = {p["id"]: p for p in json.loads(probe.stdout)["probes"]}
    assert report["run_dir.resume"]["status"] == "FAIL" and "already runs this run dir" in \
        report["run_dir.resume"]["summary"]
    ports = report["ports"]
    assert ports["status"] == "WARN", ports
    assert "held by this run's own server gpu0" in ports["summary"] and "stop that process" not in ports["summary"]
    assert report["config"]["status"] == "PASS" and report["config"]["data"]["sampling"]["temperature"]["source"]
    stop = regen("stop", "local", "--run-dir", str(run_dir), home=tmp_path)
    assert stop.returncode == 0, stop.stdout + stop.stderr


def test_a_start_with_one_of_two_workers_refused_exits_0_with_a_warning(tmp_path, tiny_model_dir, cleanup_runs,
                                                                       foreign_servers):
    run_dir = tmp_path / "run"
    cleanup_runs.append(run_dir)
    cfg = make_config(run_dir, tiny_model_dir, prompts=400, gpus=2,
                      sim=("--sim-output-mean", "4000", "--sim-step-ms", "50"))  # still live at the stop
    foreign_servers(tiny_model_dir, cfg.workers.base_port, tmp_path / "foreign.log")  # gpu0's port is held
    config = write_config(tmp_path, cfg)
    r = regen("start", "local", "--config", str(config), "--no-preflight", "--json", home=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "regen start: warning: started with 1 of 2 workers: gpu0 refused (" in r.stderr
    data = json.loads(r.stdout)
    assert data["started"] is True and data["warning"].startswith("started with 1 of 2 workers: gpu0 refused")
    wait_for(lambda: "gpu1" in _ready_workers(run_dir), 90, "the other server ready")
    stop = regen("stop", "local", "--run-dir", str(run_dir), home=tmp_path)
    assert stop.returncode == 0, stop.stdout + stop.stderr


def test_the_resume_hint_comes_from_the_runs_start_record_and_pasted_elsewhere_resumes_that_run(
        tmp_path, tiny_model_dir, cleanup_runs):
    """Started with a relative `--config run2.toml` in one directory; `regen status` typed in another prints the
    hint from the run's record (`cd <that directory> && regen start ... --config run2.toml`), which, pasted there,
    resumes this run, not the run.toml of wherever the operator happens to be."""
    import os
    import shlex
    import signal
    import subprocess
    import sys

    from tests.test_cli_run import REPO

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    run_dir = tmp_path / "run2"
    cleanup_runs.append(run_dir)
    # ~90 s of run (answers of ~1.8 s, 4 at a time): the resumed run is still running when it is stopped
    cfg = make_config(run_dir, tiny_model_dir, prompts=200, gpus=1, sim=("--sim-step-ms", "30", "--sim-output-mean", "120",
                                                                         "--sim-tokens-per-step", "2",
                                                                         "--max-running-requests", "4"))
    write_config(project, cfg, name="run2.toml")
    decoy = make_config(tmp_path / "decoy-run", tiny_model_dir, prompts=10, gpus=1)
    write_config(elsewhere, decoy, name="run.toml")  # what a guessed `--config run.toml` would start there
    env = dict(os.environ, HOME=str(tmp_path), PYTHONPATH=str(REPO))

    def regen_in(cwd, *args):
        return subprocess.run([sys.executable, "-m", "console.cli", *args], capture_output=True, text=True,
                              timeout=240, env=env, cwd=str(cwd))

    started = regen_in(project, "start", "local", "--config", "run2.toml", "--no-preflight")
    assert started.returncode == 0, started.stderr
    pid = int((run_dir / "supervisor.pid").read_text())
    os.killpg(pid, signal.SIGKILL)
    wait_for(lambda: not process_alive(pid), 30, "the killed supervisor gone")
    status = regen_in(elsewhere, "status", "local", "--run-dir", str(run_dir))
    assert status.returncode == 4, status.stdout + status.stderr
    hint_line = next(line for line in status.stdout.splitlines() if "resume with: " in line)
    hint = hint_line.split("resume with: ", 1)[1]
    assert hint == f"cd {shlex.quote(str(project))} && regen start local --config run2.toml --no-preflight"
    assert "as it was started on " in status.stdout
    pasted = subprocess.run(["bash", "-c", hint.replace("regen start", f"{shlex.quote(sys.executable)} -m console.cli"
                                                        " start", 1)],
                            capture_output=True, text=True, timeout=240, env=env, cwd=str(elsewhere))
    assert pasted.returncode == 0, pasted.stderr
    assert f"{run_dir}" in pasted.stdout and not (tmp_path / "decoy-run").exists()
    assert regen_in(elsewhere, "stop", "local", "--run-dir", str(run_dir)).returncode == 0
