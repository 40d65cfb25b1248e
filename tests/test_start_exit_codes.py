"""`regen start`'s exit 1 when the supervisor lives on (docs/operating.md, "Exit codes"): none of its workers
launched because another process holds the only worker's port. The start says so and how to end it; the run is
alive for `regen status` (exit 0) until `regen stop` ends it."""
from __future__ import annotations

import socket

import pytest

from engine.config.load import dump_toml
from tests.run_helpers import make_config, wait_for
from tests.test_cli_run import cleanup_runs, regen  # noqa: F401  (fixture)


@pytest.mark.slow  # ~20 s: the start waits out its 10 s grace for the workers
@pytest.mark.timeout(180)
def test_start_exits_1_and_says_the_supervisor_still_runs_when_no_worker_launched(tmp_path, tiny_model_dir,
                                                                                    cleanup_runs):
    run_dir = tmp_path / "run"
    cleanup_runs.append(run_dir)
    cfg = make_config(run_dir, tiny_model_dir, prompts=10, gpus=1)
    config = tmp_path / "run.toml"
    config.write_text(dump_toml(cfg))
    with socket.socket() as holder:  # another job's server on the worker's port
        holder.bind(("127.0.0.1", cfg.workers.base_port))
        holder.listen(8)
        started = regen("start", "local", "--config", str(config), "--no-preflight", home=tmp_path)
        assert started.returncode == 1, started.stdout + started.stderr
        assert "could not launch its workers" in started.stderr, started.stderr
        assert f"still running on local:{run_dir}" in started.stderr and "`regen stop` ends it" in started.stderr
        status = regen("status", "local", "--run-dir", str(run_dir), home=tmp_path)
        assert status.returncode == 0, status.stdout + status.stderr  # a supervisor runs this run dir
        stopped = regen("stop", "local", "--run-dir", str(run_dir), home=tmp_path)
        assert stopped.returncode == 0, stopped.stderr
    wait_for(lambda: not (run_dir / "supervisor.pid").exists(), 60, "the stopped supervisor to exit")
    after = regen("status", "local", "--run-dir", str(run_dir), home=tmp_path)
    assert after.returncode == 4, after.stdout + after.stderr  # not running, no fault recorded
