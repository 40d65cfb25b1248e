"""End to end as a person would: `regen demo` (a small simulated run) in tmux, keys sent, the screen read back."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tmux_screen import capture, tmux
from tests.tmux_screen import wait_screen as wait_for_screen

REPO = Path(__file__).resolve().parents[1]
SESSION = f"regen-tui-test-{os.getpid()}"

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def screen() -> str:
    return capture(SESSION)


def wait_screen(predicate, what: str, timeout: float = 60.0) -> str:
    return wait_for_screen(SESSION, predicate, what, timeout)


def ctl_status(run_dir: Path) -> dict:
    r = subprocess.run([sys.executable, "-m", "engine.ctl", "--run-dir", str(run_dir), "status"], capture_output=True,
                       text=True, timeout=30, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["result"]


def line_of(text: str, word: str) -> str:
    return next((ln for ln in text.splitlines() if word in ln), "")


@pytest.fixture
def demo_in_tmux(tmp_path):
    run_dir = tmp_path / "demo"
    command = " ".join([
        shlex.quote(sys.executable), "-m", "console.cli", "demo", "--gpus", "2", "--prompts", "300",
        "--run-dir", shlex.quote(str(run_dir)),
        "--sim-arg=--sim-step-ms", "--sim-arg=60", "--sim-arg=--sim-tokens-per-step", "--sim-arg=1",
    ])
    # COLUMNS/LINES from the test runner's environment would override the pane's real size
    env = f"cd {shlex.quote(str(REPO))} && env -u COLUMNS -u LINES PYTHONPATH={shlex.quote(str(REPO))} TERM=xterm-256color "
    tmux("new-session", "-d", "-s", SESSION, "-x", "160", "-y", "45", env + command + " ; sleep 600")
    yield run_dir
    tmux("kill-session", "-t", SESSION, check=False)
    pid_file = run_dir / "supervisor.pid"
    if pid_file.exists():
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            return  # the run had already ended


def test_operator_switches_tabs_pauses_and_resumes_a_shard(demo_in_tmux):
    run_dir = demo_in_tmux
    wait_screen(lambda s: "connected" in s and "Workers" in s, "the console attached to the demo run", timeout=120)
    wait_screen(lambda s: "gpu0" in s and "gpu1" in s, "the worker rows")
    tmux("send-keys", "-t", SESSION, "3")
    text = wait_screen(lambda s: "s00000" in s and "shards:" in s, "the Shards tab")
    tmux("send-keys", "-t", SESSION, "p")
    text = wait_screen(lambda s: "paused" in line_of(s, "s00000"), "s00000 shown paused")
    assert "⏸" in line_of(text, "s00000")
    assert next(s for s in ctl_status(run_dir)["shards"] if s["id"] == "s00000")["state"] == "paused"
    tmux("send-keys", "-t", SESSION, "r")
    wait_screen(lambda s: "paused" not in line_of(s, "s00000") and "s00000" in s, "s00000 shown resumed")
    assert next(s for s in ctl_status(run_dir)["shards"] if s["id"] == "s00000")["state"] != "paused"
    tmux("send-keys", "-t", SESSION, "5")
    wait_screen(lambda s: "/dev/shm" in s and "full in" in s, "the Disk tab")
    tmux("send-keys", "-t", SESSION, "q")
    wait_screen(lambda s: "Workers" not in s, "the console closed")
    assert ctl_status(run_dir)["state"] in ("starting", "running", "paused", "done")  # quitting the console left the run alone
