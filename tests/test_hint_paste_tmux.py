"""The hint `regen start` prints, pasted into a real shell in tmux as an operator would: for a run dir whose
path has spaces, quotes and `; echo INJECTED...`, the pasted line shows the run's status and runs nothing else."""
from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from engine.config.load import dump_toml
from tests.run_helpers import REPO, make_config
from tests.test_cli_run import cleanup_runs, regen  # noqa: F401  (fixture)
from tests.tmux_screen import capture, tmux
from tests.tmux_screen import wait_screen as wait_for_screen

SESSION = f"regen-hint-test-{os.getpid()}"
# `$((6*7))` makes an injected echo print INJECTED42, a text that appears nowhere else
NASTY = "run dir 'sq' \"dq\"; echo INJECTED$((6*7))"

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def screen() -> str:
    return capture(SESSION, history=200)


def wait_screen(predicate, what: str, timeout: float = 60.0) -> str:
    return wait_for_screen(SESSION, predicate, what, timeout, history=200)


@pytest.fixture
def shell_in_tmux(tmp_path):
    """A plain bash in tmux with `regen` on PATH (this checkout's console.cli)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "regen"
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m console.cli \"$@\"\n")
    wrapper.chmod(0o755)
    env = (f"env -u COLUMNS -u LINES HOME={shlex.quote(str(tmp_path))} PATH={shlex.quote(str(bin_dir))}:$PATH "
           f"PYTHONPATH={shlex.quote(str(REPO))} TERM=xterm-256color PS1='$ ' bash --norc --noprofile")
    tmux("new-session", "-d", "-s", SESSION, "-x", "220", "-y", "50", env)
    yield
    tmux("kill-session", "-t", SESSION, check=False)


@pytest.mark.parametrize("over", ["local", pytest.param("sshd", marks=pytest.mark.sshd)])
def test_pasted_status_hint_shows_the_status_and_injects_nothing(over, request, tmp_path, tiny_model_dir, cleanup_runs,
                                                                 shell_in_tmux):
    if over == "sshd":  # the hint must carry the --ssh-config given, or the pasted command cannot connect
        sshd = request.getfixturevalue("sshd")
        host, ssh = sshd.alias, ["--ssh-config", str(sshd.ssh_config_path)]
    else:
        host, ssh = "local", []
    run_dir = tmp_path / NASTY
    cleanup_runs.append(run_dir)
    cfg = make_config(run_dir, tiny_model_dir, prompts=200, sim=("--sim-output-mean", "300", "--sim-step-ms", "10"))
    config = tmp_path / "run.toml"
    config.write_text(dump_toml(cfg))
    started = regen("start", host, "--config", str(config), *ssh, home=tmp_path)
    assert started.returncode == 0, started.stderr
    hint = next(line for line in started.stdout.splitlines() if "regen status" in line).strip()
    assert shlex.split(hint) == ["regen", "status", host, "--run-dir", str(run_dir), *ssh]

    tmux("set-buffer", "--", hint)
    tmux("paste-buffer", "-t", SESSION)
    tmux("send-keys", "-t", SESSION, "Enter")
    tmux("send-keys", "-t", SESSION, "-l", "echo status-exit=$?")
    tmux("send-keys", "-t", SESSION, "Enter")
    text = wait_screen(lambda s: "status-exit=" in s.replace("echo status-exit=$?", ""), "the pasted command to end")
    assert "status-exit=0" in text, text
    assert "state " in text and "workers" in text and "shards" in text, text
    assert "INJECTED42" not in text, text
