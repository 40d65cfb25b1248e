"""One set of SSH options for every command that connects, hints that paste as they were printed, and a TUI
that stops at an unknown host key with the command that records it (over the real OpenSSH sshd)."""
from __future__ import annotations

import asyncio
import shlex

import pytest

from console.cli import build_parser, main
from console.host.hints import hint_from_args, regen_command, typed_again
from console.host.ssh_options import ENV_SSH_CONFIG, SshOptions
from console.host.source import HostSource, SourceError

# each command that connects, with the least it needs besides the SSH options
CONNECTING = {
    "probe": ["gpu1"],
    "plan": ["gpu1", "--config", "run.toml"],
    "start": ["gpu1", "--config", "run.toml"],
    "status": ["gpu1", "--run-dir", "/r"],
    "pause": ["gpu1", "--run-dir", "/r", "--all"],
    "resume": ["gpu1", "--run-dir", "/r", "--all"],
    "stop": ["gpu1", "--run-dir", "/r"],
    "stats": ["gpu1:/r"],
    "export": ["gpu1:/r", "--format", "hf", "--out", "/o"],
    "tui": ["gpu1", "--run-dir", "/r"],
    "drain-host": ["gpu1", "b", "--run-dir", "/r"],
}


@pytest.mark.parametrize("command", sorted(CONNECTING))
def test_every_connecting_command_takes_the_same_ssh_options(command, capsys):
    parser = build_parser()
    args = parser.parse_args([command, *CONNECTING[command], "--ssh-config", "/etc/regen/ssh_config", "--accept-new"])
    assert SshOptions.from_args(args) == SshOptions("/etc/regen/ssh_config", True)
    plain = parser.parse_args([command, *CONNECTING[command]])
    assert SshOptions.from_args(plain) == SshOptions(None, False)
    with pytest.raises(SystemExit) as done:
        parser.parse_args([command, "--help"])
    assert done.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--ssh-config FILE" in help_text and "--accept-new" in help_text
    assert f"default: ${ENV_SSH_CONFIG}, else ~/.ssh/config" in help_text
    assert "a CHANGED key is always refused" in help_text


def test_hints_are_shell_quoted_and_carry_the_ssh_config_given(tmp_path):
    nasty = "/runs/a b 'q' \"dq\"; echo INJECTED $(x) `y`"
    args = build_parser().parse_args(["status", "gpu1", "--run-dir", nasty, "--ssh-config", "cfg dir/ssh config",
                                      "--accept-new"])
    hint = hint_from_args(args, "status", "--run-dir", nasty)
    argv = shlex.split(hint)
    # --accept-new was needed once: the key is recorded now, the hint does not repeat it
    assert argv[:5] == ["regen", "status", "gpu1", "--run-dir", nasty]
    assert argv[5] == "--ssh-config" and argv[6].endswith("/cfg dir/ssh config") and argv[6].startswith("/")
    assert "--accept-new" not in argv and len(argv) == 7
    # `local` uses no SSH: no SSH option in its hints
    assert shlex.split(regen_command("status", "local", "--run-dir", nasty, ssh=SshOptions("c", True))) == [
        "regen", "status", "local", "--run-dir", nasty]
    assert shlex.split(regen_command("tui", "gpu1", ssh=SshOptions("/c"), accept_new=True))[-3:] == [
        "--ssh-config", "/c", "--accept-new"]


def test_the_command_typed_again_with_accept_new():
    argv = ["pause", "gpu 1", "s00001", "--run-dir", "/r; x", "--ssh-config", "c"]
    args = build_parser().parse_args(argv)
    args.argv = argv
    assert shlex.split(typed_again(args, accept_new=True)) == ["regen", *argv, "--accept-new"]
    args.argv = [*argv, "--accept-new"]
    assert shlex.split(typed_again(args, accept_new=True)).count("--accept-new") == 1


def _config_with_empty_known_hosts(sshd, tmp_path):
    from tests.sshd_fixtures import write_client_config

    known = tmp_path / "known_hosts"
    known.write_text("")
    cfg = tmp_path / "ssh config"
    write_client_config(cfg, alias=sshd.alias, port=sshd.port, user=sshd.user, key=sshd.client_key_path,
                        known_hosts=known)
    return cfg, known


@pytest.mark.sshd
def test_a_command_refused_by_an_unknown_host_key_prints_the_command_that_records_it(sshd, tmp_path, capsys,
                                                                                     monkeypatch):
    cfg, known = _config_with_empty_known_hosts(sshd, tmp_path)
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    argv = ["status", sshd.alias, "--run-dir", str(tmp_path / "a run"), "--ssh-config", str(cfg)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"host [127.0.0.1]:{sshd.port} is not in known_hosts" in err
    retry = err.strip().splitlines()[-1].strip()
    assert shlex.split(retry) == ["regen", *argv, "--accept-new"]
    assert known.read_text() == ""


@pytest.mark.sshd
def test_tui_source_stops_at_an_unknown_host_key_and_connects_with_accept_new(sshd, tmp_path, monkeypatch):
    cfg, known = _config_with_empty_known_hosts(sshd, tmp_path)
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    run_dir = str(tmp_path / "run 'x'")
    import console.host.source as source_module

    opened = []
    real_open = source_module.open_transport

    async def counting_open(host, **kw):
        opened.append(kw)
        return await real_open(host, **kw)

    monkeypatch.setattr(source_module, "open_transport", counting_open)

    async def go():
        src = HostSource(sshd.alias, run_dir, ssh=SshOptions(str(cfg)))
        with pytest.raises(SourceError) as first:
            await src.connect()
        # not a transient error: the telemetry and probe workers asking again get the same answer, no new attempt
        with pytest.raises(SourceError) as second:
            await src.connect()
        assert first.value.kind == second.value.kind == "refused"
        assert len(opened) == 1 and opened[0]["ssh_config"] == str(cfg)
        text = str(first.value)
        assert "is not in known_hosts" in text
        command = text.split("quit and run: ", 1)[1]
        assert shlex.split(command) == ["regen", "tui", sshd.alias, "--run-dir", run_dir, "--ssh-config", str(cfg),
                                        "--accept-new"]
        assert known.read_text() == ""
        # what that command does: the same source with --accept-new connects and records the key
        accepted = HostSource(sshd.alias, None, ssh=SshOptions(str(cfg), accept_new=True))
        await accepted.connect()
        try:
            assert (await accepted.transport.run("echo connected", timeout=20)).stdout == "connected\n"
        finally:
            await accepted.close()
        assert f"[127.0.0.1]:{sshd.port}" in known.read_text()

    asyncio.run(go())


@pytest.mark.sshd
async def test_tui_shows_the_refusal_and_the_command_and_stops_retrying(sshd, tmp_path, monkeypatch):
    from console.tui.app import RegenApp

    cfg, known = _config_with_empty_known_hosts(sshd, tmp_path)
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    app = RegenApp(HostSource(sshd.alias, str(tmp_path / "run"), ssh=SshOptions(str(cfg))))
    async with app.run_test(size=(160, 45)) as pilot:
        deadline = asyncio.get_running_loop().time() + 30
        while app.model.connection.state != "refused":
            assert asyncio.get_running_loop().time() < deadline, f"state {app.model.connection.state}"
            await pilot.pause(0.1)
        follow = [w for w in app.workers if w.group == "follow"]
        while not all(w.is_finished for w in follow):  # it returned: nothing will retry
            assert asyncio.get_running_loop().time() < deadline, [w.state for w in follow]
            await pilot.pause(0.1)
        alert = next(a for a in app.model.alerts if a.origin == "console" and a.severity == "critical")
        assert "is not in known_hosts" in alert.text and "--accept-new" in alert.text
        assert f"--ssh-config {shlex.quote(str(cfg))} --accept-new" in alert.text
        assert "[refused]" in str(app.query_one("#run-header").render())


@pytest.mark.sshd
def test_probe_refused_by_an_unknown_host_key_prints_the_command_that_records_it(sshd, tmp_path, capsys,
                                                                                 monkeypatch):
    import json

    cfg, known = _config_with_empty_known_hosts(sshd, tmp_path)
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    argv = ["probe", sshd.alias, "--only", "connection", "--json", "--ssh-config", str(cfg)]
    assert main(argv) == 2
    out = capsys.readouterr()
    conn = next(p for p in json.loads(out.out)["probes"] if p["id"] == "connection")
    assert conn["status"] == "FAIL" and "is not in known_hosts" in conn["actual"]
    retry = shlex.split(out.err.strip().splitlines()[-1])
    assert retry == ["regen", *argv, "--accept-new"] and conn["data"]["accept_new_command"] == shlex.join(retry)
    assert known.read_text() == ""
