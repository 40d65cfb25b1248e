"""The console refuses what `regen status` refuses, before it opens and with the same words and exit code: a run dir
that is not there, a directory that is not a run's, a host alias that does not resolve. Locally and over the suite's
real OpenSSH sshd."""
from __future__ import annotations

import pytest

from tests.sshd_fixtures import sshd  # noqa: F401  (fixture)
from tests.test_cli_run import regen


def both(home, host: str, *args: str) -> tuple:
    tui = regen("tui", host, *args, home=home, timeout=60)
    status = regen("status", host, *args, home=home, timeout=60)
    return tui, status


def test_a_missing_run_dir_is_refused_as_status_refuses_it(tmp_path):
    tui, status = both(tmp_path, "local", "--run-dir", str(tmp_path / "no-such-run"))
    assert tui.returncode == status.returncode == 2
    assert "no such run dir (FileNotFoundError)" in tui.stderr and tui.stderr == status.stderr
    assert "\x1b[?1049h" not in tui.stdout  # the console never took the screen


def test_a_directory_that_is_not_a_run_dir_is_refused_as_status_refuses_it(tmp_path):
    (tmp_path / "photos").mkdir()
    tui, status = both(tmp_path, "local", "--run-dir", str(tmp_path / "photos"))
    assert tui.returncode == status.returncode == 2 and tui.stderr == status.stderr and tui.stderr.strip()


def test_a_host_alias_that_does_not_resolve_is_refused_at_once(tmp_path):
    host = "no-such-gpu-box.invalid"  # RFC 6761: never resolves
    tui, status = both(tmp_path, host, "--run-dir", "/data/run")
    assert tui.returncode == status.returncode == 2
    assert tui.stderr.startswith(f"cannot reach {host}: cannot resolve host name") and tui.stderr == status.stderr
    bare = regen("tui", host, home=tmp_path, timeout=60)  # without a run dir: Preflight only, the same refusal
    assert bare.returncode == 2 and bare.stderr == tui.stderr


@pytest.mark.sshd
def test_over_ssh_a_wrong_run_dir_is_refused_with_the_hosts_path(tmp_path, sshd):  # noqa: F811
    opts = ("--ssh-config", str(sshd.ssh_config_path))
    tui, status = both(tmp_path, sshd.alias, "--run-dir", "runs/nope", *opts)
    assert tui.returncode == status.returncode == 2 and tui.stderr == status.stderr
    assert f"{sshd.alias}:runs/nope: no such run dir (FileNotFoundError); looked for runs/nope under" in tui.stderr
