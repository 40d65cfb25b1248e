"""The CLI at the edges of a run, as the operator sees it (issue 35): --version and --help, the config check of a
missing file, `start` on a finished run, `status --follow`'s resume line, one reject count, a rate in the first
seconds, whole columns when piped, and a directory that is not a run dir (locally and over the real OpenSSH sshd)."""
from __future__ import annotations

import pytest

import engine
from console.cli import main


def test_version_prints_regen_and_the_engine_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"regen {engine.__version__}\n"


def test_help_describes_the_tool_and_its_flow_not_the_code(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "console/commands" not in out and "module" not in out
    assert "drafter training data" in out
    steps = [out.index(f"regen {cmd} HOST") for cmd in ("probe", "plan", "start", "status")]
    assert steps == sorted(steps), out  # probe -> plan -> start -> watch -> export, in that order
    assert steps[-1] < out.index("regen export HOST:DIR --format F --out PATH")
    assert "regen demo" in out


def test_config_check_of_a_missing_file_names_the_command_it_was_given_to(tmp_path, capsys):
    missing = tmp_path / "nonexistent.toml"
    assert main(["config", "check", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"regen config check: {missing}: (file): cannot be read: [Errno 2] No such file or directory")
    assert err.rstrip().endswith("fix: check the path given to `regen config check`"), err
    assert "--config" not in err
