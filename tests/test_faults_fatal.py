"""A run that cannot start or cannot go on says why, where the operator looks: `regen start` (exit 1 with the
cause and the remedy, not a log dump), `regen status` (the cause first, exit 3 failed / 4 not running, --json
`fatal` and `running`), and the TUI header (`failed: <cause>`, no tok/s, no ETA).

Cases: missing prompts, unreadable prompts, wrong model path, disk full at start and mid-run (a small tmpfs),
a stopped run, a killed supervisor; preflight refusal of a single-host start; one case over the real OpenSSH
sshd of the suite. The supervisor cases start with --no-preflight, which is how an input can go bad between
the preflight and the start (or an operator skip it): the supervisor itself must then say why it stopped.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from console.host.transport_local import LocalTransport
from console.tui.app import RegenApp
from console.host.source import HostSource
from engine.config.load import RunConfig, dump_toml
from tests.run_helpers import events, make_config, process_alive, quick_state, wait_for
from tests.test_cli_run import cleanup_runs, regen  # noqa: F401  (fixture)
from tests.test_faults_disk import _fill, _status, small_disk  # noqa: F401  (fixture)
from tests.test_tui_app import header, text_of, wait_until
from tests.waiting import await_until

FROZEN_NOW = 1_800_000_000.0


def frozen_console(run_dir: Path, tmp_path: Path) -> tuple[HostSource, RegenApp]:
    """The TUI attached to a local run dir, its clock frozen (what a gone run's screen says)."""
    source = HostSource("local", str(run_dir), host_python=sys.executable, transport=LocalTransport())
    return source, RegenApp(source, clock=lambda: FROZEN_NOW, monotonic=lambda: 1000.0, run_probes_on_start=False,
                            live=False, export_dir=tmp_path)


def write_config(tmp_path: Path, cfg: RunConfig, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(dump_toml(cfg))
    return path


def start_fails(config: Path, home: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    r = regen("start", "local", "--config", str(config), "--no-preflight", *extra, home=home, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "--no-preflight: the host is not probed before the start" in r.stderr
    assert "Traceback" not in r.stderr  # the cause, not a dump
    return r


def status_of(run_dir: Path, home: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    human = regen("status", "local", "--run-dir", str(run_dir), *extra, home=home)
    js = regen("status", "local", "--run-dir", str(run_dir), "--json", *extra, home=home)
    assert js.returncode == human.returncode, (human.stderr, js.stderr)
    return human, json.loads(js.stdout)


def assert_failed_status(run_dir: Path, home: Path, exc_type: str, message_part: str, path: str | None):
    human, data = status_of(run_dir, home)
    assert human.returncode == 3, human.stdout + human.stderr
    first = human.stdout.splitlines()[0]
    assert first.startswith(f"failed: {exc_type}: "), human.stdout
    assert message_part in " ".join(human.stdout.split())
    assert "remedy: " in human.stdout and "after the fix, start again: cd " in human.stdout
    assert " && regen start local --config" in human.stdout  # from the run's start record, as typed
    assert not re.search(r"\d tok/s", human.stdout)  # no rate (the workers table's header is no figure)
    assert data["running"] is False and data["state"] == "failed"
    assert data["fatal"]["exc_type"] == exc_type and message_part in data["fatal"]["message"]
    if path is not None:
        assert data["fatal"]["path"] == path and f"path:   {path}" in human.stdout
    assert data["fatal"]["remedy"]
    return human, data


# -- preflight ------------------------------------------------------------------------------------------
def test_single_host_start_is_preflighted_and_refused_for_missing_prompts(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=10, gpus=1)
    missing = tmp_path / "data" / "chat.jsonl"
    cfg = cfg.model_copy(update=dict(prompts=(str(missing),)))
    config = write_config(tmp_path, cfg)
    wide = {"COLUMNS": "400"}  # the report's panels unwrapped: a path is one piece of text
    r = regen("start", "local", "--config", str(config), home=tmp_path, env=wide)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL prompts.paths" in r.stderr and str(missing) in r.stderr
    assert "regen start: preflight on local failed: " in r.stderr and "prompts.paths" in r.stderr
    assert "nothing was started" in r.stderr and "started: supervisor" not in r.stdout
    assert not run_dir.exists(), "a refused preflight created the run dir"
    js = regen("start", "local", "--config", str(config), "--json", home=tmp_path)
    assert js.returncode == 1
    report = json.loads(js.stdout)
    assert report["schema"] == "regen.probe/1"
    assert {p["id"]: p["status"] for p in report["probes"]}["prompts.paths"] == "FAIL"
    assert not run_dir.exists()


def test_start_preflights_a_rehearsal_and_starts(tmp_path, tiny_model_dir, cleanup_runs):
    """The simulator launch: GPU / sglang / weights probes are SKIP (a rehearsal), which passes the preflight."""
    run_dir = tmp_path / "run"
    cleanup_runs.append(run_dir)
    config = write_config(tmp_path, make_config(run_dir, tiny_model_dir, prompts=10, gpus=1))
    probe = regen("probe", "local", "--config", str(config), "--json", "--only", "packages,gpu", home=tmp_path)
    failing = [p["id"] for p in json.loads(probe.stdout)["probes"] if p["status"] in ("FAIL", "ERROR")]
    if failing:
        pytest.skip(f"the probes are not rehearsal-aware on this branch (FAIL {', '.join(failing)} with the simulator"
                    " launch; issue 13's rehearsal probes make them SKIP)")
    r = regen("start", "local", "--config", str(config), home=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "preflight passed on local" in r.stderr and "started: supervisor pid" in r.stdout
    assert "supervisor: tokenizer loaded" in r.stderr and "supervisor: workers launched" in r.stderr
    regen("stop", "local", "--run-dir", str(run_dir), home=tmp_path)


# -- the supervisor says why ------------------------------------------------------------------------------
async def test_missing_prompts_start_exits_with_the_cause_status_and_tui_show_it(tmp_path, tiny_model_dir,
                                                                                 cleanup_runs):
    run_dir = tmp_path / "run"
    cleanup_runs.append(run_dir)
    missing = tmp_path / "data" / "chat.jsonl"
    cfg = make_config(run_dir, tiny_model_dir, prompts=10, gpus=1).model_copy(update=dict(prompts=(str(missing),)))
    config = write_config(tmp_path, cfg)
    t0 = time.monotonic()
    r = start_fails(config, tmp_path)
    assert "exited during its start:\nfailed: PromptFileError: prompt file " in r.stderr
    assert f"No such file or directory: '{missing}'" in r.stderr
    assert f"  path:   {missing}" in r.stderr and "  remedy: fix `prompts` in run.toml" in r.stderr
    assert f"  log:    {run_dir}/supervisor.log" in r.stderr
    assert "started: supervisor" not in r.stdout and time.monotonic() - t0 < 120
    js = regen("start", "local", "--config", str(config), "--no-preflight", "--json", home=tmp_path)
    assert js.returncode == 1 and json.loads(js.stdout)["fatal"]["exc_type"] == "PromptFileError"
    assert_failed_status(run_dir, tmp_path, "PromptFileError", "No such file or directory", str(missing))
    # nothing outlives it: the server launched before the count was stopped
    log = (run_dir / "supervisor.log").read_text()
    assert "worker gpu0: starting -> stopped" in log or "-> stopped" in log
    assert "Logging error" not in log

    children_before = {c.pid for c in psutil.Process().children()}
    source, app = frozen_console(run_dir, tmp_path)
    try:
        async with app.run_test(size=(160, 40)) as pilot:
            await wait_until(pilot, lambda: "failed: PromptFileError" in header(app), "the cause in the header")
            shown = header(app)
            await pilot.press("6")
            await wait_until(pilot, lambda: "remedy: fix `prompts`" in text_of(app.query_one("#alert-detail")),
                             "the fatal alert's evidence on the Alerts tab")
            shown += "\n" + text_of(app.query_one("#alert-detail"))
    finally:
        await source.close()
        # the killed commands' transports see their exit while the loop runs: every child the TUI started is reaped
        await await_until(lambda: not [c for c in psutil.Process().children() if c.pid not in children_before], 10,
                          "the TUI's commands reaped",
                          describe=lambda: f"children left: {psutil.Process().children()}")
    assert "[ended]" in shown and "failed: PromptFileError: prompt file" in shown
    assert "- tok/s" in shown and "ETA -" in shown
    assert "supervisor failed: PromptFileError" in shown and f"path: {missing}" in shown


def test_unreadable_prompts_name_the_file_and_the_permission(tmp_path, tiny_model_dir, cleanup_runs):
    """Root reads any file, so the whole `regen start` runs with CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH
    dropped from its bounding set (setpriv): the supervisor it starts is then a root that file modes apply to,
    and a mode-000 prompts file fails with EACCES as it would for an unprivileged operator."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed: cannot drop the capabilities that let root read anything")
    probe = subprocess.run([setpriv, "--bounding-set", "-dac_override,-dac_read_search", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"setpriv cannot drop capabilities here: {probe.stderr.strip()}")
    run_dir = tmp_path / "run"
    cleanup_runs.append(run_dir)
    cfg = make_config(run_dir, tiny_model_dir, prompts=10, gpus=1)
    unreadable = Path(cfg.prompts[0])
    unreadable.chmod(0)
    config = write_config(tmp_path, cfg)
    r = regen("start", "local", "--config", str(config), "--no-preflight", home=tmp_path,
              wrap=[setpriv, "--bounding-set", "-dac_override,-dac_read_search"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "failed: PromptFileError: prompt file " in r.stderr
    assert f"[Errno 13] Permission denied: '{unreadable}'" in r.stderr
    assert "readable by user root" in r.stderr
    assert_failed_status(run_dir, tmp_path, "PromptFileError", "Permission denied", str(unreadable))


def test_wrong_model_path_start_and_status_name_it(tmp_path, tiny_model_dir, cleanup_runs):
    run_dir = tmp_path / "run"
    cleanup_runs.append(run_dir)
    wrong = tmp_path / "models" / "Qwen3-typo"
    cfg = make_config(run_dir, tiny_model_dir, prompts=10, gpus=1).model_copy(update=dict(model=str(wrong)))
    config = write_config(tmp_path, cfg)
    r = start_fails(config, tmp_path)
    assert "failed: RenderError: tokenizer path " in r.stderr and str(wrong) in r.stderr
    assert "remedy: set `model` (or `tokenizer`) in run.toml" in r.stderr
    assert_failed_status(run_dir, tmp_path, "RenderError", "No such file or directory", str(wrong))
    refused = regen("start", "local", "--config", str(config), home=tmp_path, env={"COLUMNS": "400"})  # preflight too
    assert refused.returncode == 1 and "FAIL model.dir" in refused.stderr and str(wrong) in refused.stderr


@pytest.mark.timeout(240)
def test_disk_full_at_start_is_the_cause_start_and_status_show(small_disk, tiny_model_dir, tmp_path, cleanup_runs):
    """The disk filled while the run was stopped; `regen start` again. The deploy fits (it replaces the same
    files), the supervisor's first write fails with ENOSPC: its record goes to the fallback file when even the
    run dir cannot take it, and start and status read it from there."""
    run_dir = small_disk / "run"
    cleanup_runs.append(run_dir)
    # a run that outlasts the stop below on a loaded box (at 20 ms steps its 20 prompts were done first)
    cfg = make_config(run_dir, tiny_model_dir, prompts=20, gpus=1, sim=("--sim-step-ms", "200"))
    cfg = cfg.model_copy(update=dict(alerts=cfg.alerts.model_copy(update=dict(disk_free_min_gb=1 / 1024))))
    config = write_config(tmp_path, cfg)
    env = {"PYTHONDONTWRITEBYTECODE": "1"}  # no .pyc in the deployed engine: the second deploy takes what the first did
    first = regen("start", "local", "--config", str(config), "--no-preflight", home=tmp_path, env=env)
    assert first.returncode == 0, first.stderr
    stop = regen("stop", "local", "--run-dir", str(run_dir), home=tmp_path, env=env)
    assert stop.returncode == 0, stop.stderr
    wait_for(lambda: not (run_dir / "supervisor.pid").exists(), 60, "the first supervisor to exit")
    _fill(small_disk / "filler.bin", leave_bytes=0)
    from engine.fatal import fallback_path

    try:
        r = regen("start", "local", "--config", str(config), "--no-preflight", home=tmp_path, env=env)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "failed: OSError: [Errno 28] No space left on device" in r.stderr, r.stderr
        assert "remedy: free space on the filesystem of" in r.stderr
        human, data = assert_failed_status(run_dir, tmp_path, "OSError", "No space left on device", None)
        assert str(run_dir) in data["fatal"]["path"]
        assert fallback_path(run_dir).exists() and not (run_dir / "fatal.json").exists()
    finally:
        fallback_path(run_dir).unlink(missing_ok=True)


@pytest.mark.timeout(300)
def test_disk_full_mid_run_kills_nothing_silently(small_disk, tiny_model_dir, tmp_path, cleanup_runs):
    """Mid-run, the disk fills and then the worker dies: its relaunch cannot write its log, every worker has
    failed, the run ends. No `--- Logging error ---` storm; the cause is in fatal.json (the reserve made room),
    in the telemetry (fatal, run_end), in `regen status` (exit 3, no tok/s, no ETA) and in its --json.

    The worker's log dir is moved aside first so that the relaunch must create a new log file: on a full tmpfs
    that fails at its first write, while appending to the old log may still fit in its last page."""
    run_dir = small_disk / "run"
    cleanup_runs.append(run_dir)
    cfg = make_config(run_dir, tiny_model_dir, prompts=300, gpus=1,
                      sim=("--sim-output-mean", "200", "--sim-step-ms", "20", "--max-running-requests", "4"))
    cfg = cfg.model_copy(update=dict(alerts=cfg.alerts.model_copy(update=dict(disk_free_min_gb=1 / 1024)),
                                     workers=cfg.workers.model_copy(update=dict(max_restarts=1))))
    config = write_config(tmp_path, cfg)
    started = regen("start", "local", "--config", str(config), "--no-preflight", home=tmp_path)
    assert started.returncode == 0, started.stderr
    wait_for(lambda: quick_state(run_dir) == "running" and (_status(run_dir).get("dispatch") or {}).get("done", 0) > 3,
             90, "a running supervisor with commits")
    sup_pid = int((run_dir / "supervisor.pid").read_text())
    server_pid = int((run_dir / "workers" / "gpu0" / "server.pid").read_text())
    (run_dir / "workers" / "gpu0").rename(run_dir / "workers" / "gpu0.old")
    _fill(small_disk / "filler.bin", leave_bytes=0)
    os.killpg(server_pid, signal.SIGKILL)
    wait_for(lambda: not process_alive(sup_pid), 120, "the supervisor to end the failed run")

    log = (run_dir / "supervisor.log").read_text(errors="replace")
    assert "Logging error" not in log
    fatal = json.loads((run_dir / "fatal.json").read_text())
    assert fatal["exc_type"] == "WorkersFailed" and "No space left on device" in fatal["message"]
    assert fatal["remedy"].startswith("free space on the filesystem of")
    kinds = [e["type"] for e in events(run_dir)]
    assert kinds[-1] == "run_end" and "fatal" in kinds
    human, data = assert_failed_status(run_dir, tmp_path, "WorkersFailed", "No space left on device",
                                       str(run_dir / "workers"))
    assert "- in flight, - tok/s" in human.stdout and "ETA -" in human.stdout
    assert data["dispatch"]["in_flight"] == 0 and data["dispatch"]["tokens_per_s"] is None


# -- not running without a fault -------------------------------------------------------------------------
def test_killed_supervisor_says_no_cause_was_recorded(tmp_path, tiny_model_dir, cleanup_runs):
    run_dir = tmp_path / "run"
    cleanup_runs.append(run_dir)
    cfg = make_config(run_dir, tiny_model_dir, prompts=200, gpus=1, sim=("--sim-step-ms", "30"))
    config = write_config(tmp_path, cfg)
    r = regen("start", "local", "--config", str(config), "--no-preflight", home=tmp_path)
    assert r.returncode == 0, r.stderr
    pid = int((run_dir / "supervisor.pid").read_text())
    os.killpg(pid, signal.SIGKILL)
    wait_for(lambda: not process_alive(pid), 30, "the killed supervisor to be gone")
    human, data = status_of(run_dir, tmp_path)
    assert human.returncode == 4, human.stdout + human.stderr
    text = " ".join(human.stdout.split())
    assert text.startswith("supervisor not running (killed? no cause recorded; last log lines of "
                           f"{run_dir}/supervisor.log:)"), text
    assert f"resume with: cd {tmp_path} && regen start local --config {config} --no-preflight" in text
    assert "- tok/s" in text and "ETA -" in text
    assert data["state"] == "dead" and data["running"] is False and data["fatal"] is None
    assert 0 < len(data["log_tail"]) <= 3


# -- over the real OpenSSH sshd ----------------------------------------------------------------------------
@pytest.mark.sshd
def test_missing_prompts_over_ssh(sshd, tmp_path, tiny_model_dir, cleanup_runs):
    run_dir = tmp_path / "ssh run"
    cleanup_runs.append(run_dir)
    missing = tmp_path / "nowhere" / "chat.jsonl"
    cfg = make_config(run_dir, tiny_model_dir, prompts=10, gpus=1).model_copy(update=dict(prompts=(str(missing),)))
    config = write_config(tmp_path, cfg)
    ssh = ("--ssh-config", str(sshd.ssh_config_path))
    r = regen("start", sshd.alias, "--config", str(config), "--no-preflight", *ssh, home=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "failed: PromptFileError: prompt file " in r.stderr and str(missing) in r.stderr
    assert "remedy: fix `prompts` in run.toml" in r.stderr
    st = regen("status", sshd.alias, "--run-dir", str(run_dir), *ssh, home=tmp_path)
    assert st.returncode == 3, st.stdout + st.stderr
    assert st.stdout.startswith("failed: PromptFileError: ")
    assert "--ssh-config" in " ".join(st.stdout.split())  # the hint carries the options given
    js = json.loads(regen("status", sshd.alias, "--run-dir", str(run_dir), "--json", *ssh, home=tmp_path).stdout)
    assert js["fatal"]["path"] == str(missing) and js["running"] is False
