"""End to end as a person would: `regen demo` (a small simulated run) in tmux, keys sent, the screen read back."""
from __future__ import annotations

import json
import os
import re
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


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory) -> Path:
    """HOME of the demos here: `regen demo` builds its tiny model under ~/.cache/regen, one per test process (xdist
    workers side by side would build it into the same dir at once)."""
    return tmp_path_factory.mktemp("demo-home")


def demo_session(run_dir: Path, home: Path, args: list[str]):
    """`regen demo ARGS --run-dir RUN_DIR` (HOME=home) in a 160x45 tmux pane; yields the run dir, then kills both."""
    command = " ".join([shlex.quote(sys.executable), "-m", "console.cli", "demo", *args,
                        "--run-dir", shlex.quote(str(run_dir))])
    # COLUMNS/LINES from the test runner's environment would override the pane's real size
    env = (f"cd {shlex.quote(str(REPO))} && env -u COLUMNS -u LINES HOME={shlex.quote(str(home))} "
           f"PYTHONPATH={shlex.quote(str(REPO))} TERM=xterm-256color ")
    tmux("new-session", "-d", "-s", SESSION, "-x", "160", "-y", "45", env + command + " ; sleep 600")
    yield run_dir
    tmux("kill-session", "-t", SESSION, check=False)
    pid_file = run_dir / "supervisor.pid"
    if pid_file.exists():
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            return  # the run had already ended


@pytest.fixture
def demo_in_tmux(tmp_path, demo_home):
    yield from demo_session(tmp_path / "demo", demo_home, ["--gpus", "2", "--prompts", "300", "--sim-arg=--sim-step-ms",
                                                           "--sim-arg=60", "--sim-arg=--sim-tokens-per-step",
                                                           "--sim-arg=1"])


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
    text = wait_screen(lambda s: "stop it now? [Y/n]" in s, "the demo asking whether to stop its run")
    assert "Workers" not in text and "the demo run is still going (supervisor pid " in text
    tmux("send-keys", "-t", SESSION, "n", "Enter")
    wait_screen(lambda s: "left running; stop it with:" in s, "the demo leaving its run, with the stop command")
    assert ctl_status(run_dir)["state"] in ("starting", "running", "paused")  # answered no: the run goes on


@pytest.fixture
def big_demo_in_tmux(tmp_path, demo_home):
    """`regen demo` at ~1,000 shards (one prompt row a shard); answers of ~90 s, so that nothing a test pauses
    completes under it (a complete shard is done, not paused), and no empty answer finishes early."""
    sim = ["--sim-step-ms", "100", "--sim-tokens-per-step", "1", "--sim-output-mean", "900",
           "--sim-output-sigma", "0.05", "--sim-empty-share", "0"]
    yield from demo_session(tmp_path / "demo", demo_home, ["--gpus", "2", "--prompts", "1000", "--shard-size", "1",
                                                           *[f"--sim-arg={a}" for a in sim]])


def marked_ids(text: str) -> list[str]:
    """The shard ids of the rows marked selected (●) on the screen."""
    return [ln.split()[1] for ln in text.splitlines() if ln.lstrip().startswith("●")]


def test_operator_filters_1000_shards_to_running_pauses_a_selection_and_resumes_it(big_demo_in_tmux):
    run_dir = big_demo_in_tmux
    wait_screen(lambda s: "connected" in s and "Workers" in s, "the console attached to the demo run", timeout=120)
    tmux("send-keys", "-t", SESSION, "3")
    text = wait_screen(lambda s: re.search(r"1,0\d\d shards: .*[1-9]\d* running", s), "~1,000 shards, some running")
    tmux("send-keys", "-t", SESSION, "f")
    text = wait_screen(lambda s: re.search(r"showing running \([1-9]", s), "the running shards listed")
    rows = [ln for ln in text.splitlines() if re.match(r"^\s*[!●]?\s*s\d{5}\s", ln)]
    assert rows and all(" running " in ln for ln in rows), text
    tmux("send-keys", "-t", SESSION, "Space")  # space selects the shard under the cursor and leaves it there
    tmux("send-keys", "-t", SESSION, "Down")
    tmux("send-keys", "-t", SESSION, "Space")
    text = wait_screen(lambda s: "2 selected" in s and len(marked_ids(s)) == 2, "two shards selected")
    picked = marked_ids(text)
    tmux("send-keys", "-t", SESSION, "p")
    wait_screen(lambda s: "pause " + ", ".join(picked) in s or all(i not in s for i in picked),
                "the pause sent (the toast, or the shards gone from the running list)")
    tmux("send-keys", "-t", SESSION, "f")  # paused
    text = wait_screen(lambda s: "showing paused (2)" in s and all("⏸ paused" in line_of(s, i) for i in picked),
                       "the two shards shown paused")
    states = {s["id"]: s["state"] for s in ctl_status(run_dir)["shards"]}
    assert [states[i] for i in picked] == ["paused", "paused"]
    tmux("send-keys", "-t", SESSION, "r")  # the selection is kept: resume the same two
    wait_screen(lambda s: "showing paused (0)" in s, "no shard paused any more")
    states = {s["id"]: s["state"] for s in ctl_status(run_dir)["shards"]}
    assert [states[i] for i in picked] == ["running", "running"]
    tmux("send-keys", "-t", SESSION, "f")
    tmux("send-keys", "-t", SESSION, "f")
    tmux("send-keys", "-t", SESSION, "f")
    tmux("send-keys", "-t", SESSION, "f")  # pending, done, problems, all
    text = wait_screen(lambda s: re.search(r"showing all \(1,0\d\d\)", s), "every shard listed again")
    tmux("send-keys", "-t", SESSION, "q")
    wait_screen(lambda s: "Workers" not in s, "the console closed")
