"""SshTransport against a real OpenSSH sshd on loopback (and an asyncssh server for faults)."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat

import asyncssh
import psutil
import pytest

from console.host.transport import TransportError, quote_argv
from console.host.connect import open_transport
from console.host.transport_ssh import SshTransport
from tests.sshd_fixtures import free_port, kill_sshd_connection, known_hosts_line, write_keypair
from tests.waiting import apoll_until

pytestmark = pytest.mark.sshd


def processes_with_arg(arg: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if arg in (p.info["cmdline"] or [])]


async def wait_gone(arg: str, within_s: float = 5.0) -> list[psutil.Process]:
    """Poll until no process has `arg` on its command line; returns the survivors (empty = gone)."""
    return [] if await apoll_until(lambda: not processes_with_arg(arg), within_s) else processes_with_arg(arg)


def fingerprint(pub_line: str) -> str:
    return asyncssh.import_public_key(pub_line).get_fingerprint("sha256")


@pytest.fixture(autouse=True)
def no_agent(monkeypatch):
    # an operator's ssh-agent must not decide whether auth tests pass
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.delenv("REGEN_SSH_CONFIG", raising=False)


@pytest.fixture
async def ssh(sshd):
    t = await open_transport(sshd.alias, ssh_config=str(sshd.ssh_config_path))
    try:
        yield t
    finally:
        await t.close()


# --- commands --------------------------------------------------------------------------


async def test_alias_from_ssh_config_connects_with_verified_key(ssh, sshd):
    assert isinstance(ssh, SshTransport)
    assert ssh.name == sshd.alias
    assert ssh.target == f"{sshd.user}@127.0.0.1:{sshd.port}"
    assert ssh.connection.get_server_host_key().get_fingerprint() == fingerprint(sshd.host_key_pub)


async def test_exit_status_stdout_stderr_verbatim(ssh):
    r = await ssh.run("printf 'out 1\\n  two  \\n'; printf 'err\\tline\\n' >&2", timeout=10)
    assert r.exit_status == 0
    assert r.stdout == "out 1\n  two  \n"
    assert r.stderr == "err\tline\n"  # the pid marker of the wrapper is not in what the caller sees
    assert r.timed_out is False and r.error is None
    assert r.command == "printf 'out 1\\n  two  \\n'; printf 'err\\tline\\n' >&2"


async def test_non_zero_exit_keeps_stderr(ssh):
    r = await ssh.run("ls /definitely/not/here", timeout=10)
    assert r.exit_status == 2
    assert "/definitely/not/here" in r.stderr and "No such file or directory" in r.stderr
    assert r.error is None


async def test_killed_by_signal_has_no_exit_status(ssh):
    r = await ssh.run("kill -TERM $$", timeout=10)
    assert r.exit_status is None
    assert r.error == "killed by signal TERM"


async def test_stdin_is_fed_and_absent_stdin_is_eof(ssh):
    r = await ssh.run("wc -c", timeout=10, stdin=b"x" * 100_000)
    assert r.stdout.strip() == "100000"
    r = await ssh.run("cat", timeout=10)
    assert r.exit_status == 0 and r.stdout == ""


async def test_timeout_kills_the_remote_process_group(ssh):
    r = await ssh.run("echo started; sleep 987701 & sleep 987702; wait", timeout=1)
    assert r.timed_out is True
    assert r.exit_status is None
    assert r.stdout == "started\n"
    assert "timed out after 1 s" in r.error and "killed remote process group" in r.error
    assert await wait_gone("987701") == []
    assert await wait_gone("987702") == []
    after = await ssh.run("echo still usable", timeout=10)
    assert after.stdout == "still usable\n"


async def test_twenty_parallel_commands_share_one_connection(ssh):
    # more than OpenSSH's default MaxSessions (10): the transport queues channels instead of failing
    results = await asyncio.gather(
        *[ssh.run(f"sleep 0.2; echo {i} $SSH_CONNECTION", timeout=60) for i in range(20)]
    )
    assert [r.error for r in results] == [None] * 20
    assert [r.stdout.split()[0] for r in results] == [str(i) for i in range(20)]
    client_port = ssh.connection.get_extra_info("sockname")[1]
    assert {r.stdout.split()[2] for r in results} == {str(client_port)}


async def test_quoting_blocks_injection(ssh, tmp_path):
    victim = tmp_path / "injected"
    nasty = ["a b", "it's", '"dq"', f"; touch {victim}", f"$(touch {victim})", f"`touch {victim}`",
             "$HOME", "back\\slash", "*"]
    r = await ssh.run("printf '%s\\n' " + quote_argv(nasty), timeout=10)
    assert r.exit_status == 0, r.stderr
    assert r.stdout.splitlines() == nasty
    assert not victim.exists()


async def test_put_and_get_tree_with_spaces_preserving_modes(ssh, tmp_path):
    src = tmp_path / "src tree"
    (src / "sub dir").mkdir(parents=True)
    (src / "a file.txt").write_text("hello\n")
    (src / "sub dir" / "run me.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(src / "sub dir" / "run me.sh", 0o750)
    (src / "empty dir").mkdir()
    remote = tmp_path / "on host" / "deploy"
    await ssh.put(src, str(remote))
    assert (remote / "a file.txt").read_text() == "hello\n"
    assert stat.S_IMODE((remote / "sub dir" / "run me.sh").stat().st_mode) == 0o750
    assert (remote / "empty dir").is_dir()
    r = await ssh.run(quote_argv([str(remote / "sub dir" / "run me.sh")]), timeout=10)
    assert r.stdout == "hi\n"

    back = tmp_path / "back here"
    await ssh.get(str(remote), back)
    assert sorted(p.relative_to(back).as_posix() for p in back.rglob("*")) == [
        "a file.txt", "empty dir", "sub dir", "sub dir/run me.sh"]
    assert stat.S_IMODE((back / "sub dir" / "run me.sh").stat().st_mode) == 0o750

    await ssh.put(src / "a file.txt", str(tmp_path / "new parent" / "one.txt"))
    assert (tmp_path / "new parent" / "one.txt").read_text() == "hello\n"


async def test_get_missing_remote_names_it(ssh, tmp_path):
    with pytest.raises(TransportError) as err:
        await ssh.get(str(tmp_path / "not there"), tmp_path / "x")
    assert str(tmp_path / "not there") in str(err.value)
    assert "No such file" in str(err.value)


async def test_stream_lines(ssh):
    lines = [line async for line in ssh.stream_lines("for i in 1 2 3; do echo line $i; sleep 0.05; done")]
    assert lines == ["line 1", "line 2", "line 3"]


async def test_stream_lines_failure_carries_stderr(ssh):
    seen = []
    with pytest.raises(TransportError) as err:
        async for line in ssh.stream_lines("echo one; echo 'it broke' >&2; exit 4"):
            seen.append(line)
    assert seen == ["one"]
    assert err.value.kind == "error"
    assert "exited with status 4" in str(err.value) and "it broke" in str(err.value)


async def test_closing_a_stream_kills_the_remote_command(ssh):
    stream = ssh.stream_lines("echo ready; exec sleep 987703")
    assert await stream.__anext__() == "ready"
    await stream.aclose()
    assert await wait_gone("987703") == []


async def test_closing_the_connection_while_a_stream_ends_kills_it_and_says_nothing(sshd, caplog):
    """A console's quit: its follow stream is cancelled and the connection closed at once. The stream's command is
    killed before the connection goes, and nothing alarming is logged (it once said `kill ... failed ()`)."""
    t = await open_transport(sshd.alias, ssh_config=str(sshd.ssh_config_path))
    started = asyncio.Event()

    async def follow():
        async for _ in t.stream_lines("echo ready; exec sleep 987706"):
            started.set()

    reader = asyncio.ensure_future(follow())
    await asyncio.wait_for(started.wait(), 30)
    reader.cancel()
    await asyncio.sleep(0)  # the cancellation reaches the stream, whose kill starts; the close comes meanwhile
    await t.close()
    await asyncio.gather(reader, return_exceptions=True)
    assert await wait_gone("987706") == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_closing_the_connection_with_a_stream_open_kills_its_command(sshd, caplog):
    t = await open_transport(sshd.alias, ssh_config=str(sshd.ssh_config_path))
    stream = t.stream_lines("echo ready; exec sleep 987707")
    assert await stream.__anext__() == "ready"
    await t.close()
    assert await wait_gone("987707") == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_config_from_env_and_user_at_host_port(sshd, tmp_path, monkeypatch):
    monkeypatch.setenv("REGEN_SSH_CONFIG", str(sshd.ssh_config_path))
    t = await open_transport(sshd.alias)
    assert (await t.run("echo via env", timeout=10)).stdout == "via env\n"
    await t.close()

    cfg = tmp_path / "cfg"
    cfg.write_text(f"Host *\n  IdentityFile {sshd.client_key_path}\n  IdentitiesOnly yes\n")
    t = await open_transport(f"{sshd.user}@127.0.0.1:{sshd.port}", ssh_config=str(cfg),
                             known_hosts=str(sshd.known_hosts_path))
    assert (await t.run("whoami", timeout=10)).stdout.strip() == sshd.user
    await t.close()


# --- host keys ---------------------------------------------------------------------------


async def test_unknown_host_key_is_refused_with_fingerprint(sshd, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(TransportError) as err:
        await open_transport(sshd.alias, ssh_config=str(sshd.ssh_config_path), known_hosts=str(empty))
    msg = str(err.value)
    assert err.value.kind == "host_key"
    assert f"[127.0.0.1]:{sshd.port}" in msg
    assert f"ssh-ed25519 {fingerprint(sshd.host_key_pub)}" in msg
    assert "--accept-new" in msg
    assert empty.read_text() == ""


async def test_accept_new_records_the_key_and_connects(sshd, tmp_path):
    kh = tmp_path / "dir" / "known_hosts"  # neither file nor directory exists yet
    t = await open_transport(sshd.alias, ssh_config=str(sshd.ssh_config_path), known_hosts=str(kh), accept_new=True)
    assert (await t.run("echo in", timeout=10)).stdout == "in\n"
    await t.close()
    assert kh.read_text() == known_hosts_line("127.0.0.1", sshd.port, sshd.host_key_pub)
    assert stat.S_IMODE(kh.stat().st_mode) == 0o600
    # recorded: the next connection needs no opt-in
    t = await open_transport(sshd.alias, ssh_config=str(sshd.ssh_config_path), known_hosts=str(kh))
    assert (await t.run("echo again", timeout=10)).stdout == "again\n"
    await t.close()


async def test_changed_host_key_is_refused_even_with_accept_new(sshd, tmp_path):
    impostor_pub = write_keypair(tmp_path / "other_host_key", "old-host")
    kh = tmp_path / "known_hosts"
    kh.write_text(known_hosts_line("127.0.0.1", sshd.port, impostor_pub))
    before = kh.read_text()
    for accept_new in (False, True):
        with pytest.raises(TransportError) as err:
            await open_transport(sshd.alias, ssh_config=str(sshd.ssh_config_path), known_hosts=str(kh),
                                 accept_new=accept_new)
        msg = str(err.value)
        assert err.value.kind == "host_key"
        assert f"host key for [127.0.0.1]:{sshd.port} has CHANGED" in msg
        assert fingerprint(sshd.host_key_pub) in msg and fingerprint(impostor_pub) in msg
    assert kh.read_text() == before


async def test_known_hosts_from_ssh_config_is_used(sshd, tmp_path):
    # the fixture's config names UserKnownHostsFile; pointing it at an empty file makes the host unknown
    empty = tmp_path / "kh"
    empty.write_text("")
    cfg = tmp_path / "cfg"
    cfg.write_text(sshd.ssh_config_path.read_text().replace(str(sshd.known_hosts_path), str(empty)))
    with pytest.raises(TransportError) as err:
        await open_transport(sshd.alias, ssh_config=str(cfg))
    assert err.value.kind == "host_key"
    assert str(empty) in str(err.value)


# --- connection failures -------------------------------------------------------------------


async def test_closed_port_is_unreachable_with_os_text(tmp_path):
    port = free_port()  # bound then released: nothing listens there
    cfg = tmp_path / "cfg"
    cfg.write_text("")
    with pytest.raises(TransportError) as err:
        await open_transport(f"root@127.0.0.1:{port}", ssh_config=str(cfg), known_hosts=str(tmp_path / "kh"))
    assert err.value.kind == "unreachable"
    assert "Connection refused" in str(err.value)
    assert f"127.0.0.1:{port}" in str(err.value)


async def test_unknown_host_name_is_unreachable(tmp_path):
    cfg = tmp_path / "cfg"
    cfg.write_text("")
    with pytest.raises(TransportError) as err:
        await open_transport("nobody@no-such-host.invalid", ssh_config=str(cfg), known_hosts=str(tmp_path / "kh"))
    assert err.value.kind == "unreachable"
    assert "no-such-host.invalid" in str(err.value)


async def test_wrong_key_is_an_auth_error(sshd, tmp_path):
    wrong = tmp_path / "wrong_key"
    wrong_pub = write_keypair(wrong, "not-authorized")
    cfg = tmp_path / "cfg"
    cfg.write_text(sshd.ssh_config_path.read_text().replace(str(sshd.client_key_path), str(wrong)))
    with pytest.raises(TransportError) as err:
        await open_transport(sshd.alias, ssh_config=str(cfg))
    msg = str(err.value)
    assert err.value.kind == "auth"
    assert "permission denied" in msg.lower()
    assert "publickey" in msg
    assert fingerprint(wrong_pub) in msg


async def test_missing_identity_file_is_an_auth_error(sshd, tmp_path):
    cfg = tmp_path / "cfg"
    cfg.write_text(sshd.ssh_config_path.read_text().replace(str(sshd.client_key_path), str(tmp_path / "gone")))
    with pytest.raises(TransportError) as err:
        await open_transport(sshd.alias, ssh_config=str(cfg))
    assert err.value.kind == "auth"
    assert str(tmp_path / "gone") in str(err.value)


async def test_silent_server_is_a_connect_timeout(asyncssh_server):
    with pytest.raises(TransportError) as err:
        await open_transport(asyncssh_server.silent_alias, ssh_config=str(asyncssh_server.ssh_config_path),
                             connect_timeout=1)
    assert err.value.kind == "timeout"
    assert "timed out after 1 s" in str(err.value)


async def test_connection_killed_mid_stream_raises_closed(ssh, sshd):
    stream = ssh.stream_lines("i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.1; done")
    assert await stream.__anext__() == "tick 1"
    kill_sshd_connection(sshd, ssh.connection.get_extra_info("sockname")[1])
    with pytest.raises(TransportError) as err:
        async for _ in stream:
            pass
    assert err.value.kind == "closed"
    assert sshd.alias in str(err.value)
    # and a later command on the dead connection reports it instead of hanging or raising
    r = await ssh.run("echo never", timeout=5)
    assert r.exit_status is None
    assert "lost" in r.error


async def test_asyncssh_server_runs_commands(asyncssh_server):
    t = await open_transport(asyncssh_server.alias, ssh_config=str(asyncssh_server.ssh_config_path))
    r = await t.run("echo out; echo err >&2; exit 5", timeout=10)
    assert (r.exit_status, r.stdout, r.stderr) == (5, "out\n", "err\n")
    r = await t.run("sleep 987704", timeout=0.5)
    assert r.timed_out
    assert await wait_gone("987704") == []
    await t.close()


async def test_connection_dropped_after_bytes_raises_closed(asyncssh_server):
    asyncssh_server.drop_after_bytes = 5000
    t = await open_transport(asyncssh_server.alias, ssh_config=str(asyncssh_server.ssh_config_path))
    received = []
    with pytest.raises(TransportError) as err:
        async for line in t.stream_lines("seq 1 1000000"):
            received.append(line)
    assert err.value.kind == "closed"
    assert 0 < len(received) < 1000000
    assert received[:3] == ["1", "2", "3"]
    await t.close()


async def test_known_key_of_another_type_is_refused(sshd, tmp_path):
    # known_hosts has an ECDSA key; the host only offers ed25519: no silent switch to the new key type
    other = asyncssh.generate_private_key("ecdsa-sha2-nistp256").export_public_key("openssh").decode()
    kh = tmp_path / "known_hosts"
    kh.write_text(known_hosts_line("127.0.0.1", sshd.port, other))
    with pytest.raises(TransportError) as err:
        await open_transport(sshd.alias, ssh_config=str(sshd.ssh_config_path), known_hosts=str(kh), accept_new=True)
    assert err.value.kind == "host_key"
    assert "CHANGED" in str(err.value)
