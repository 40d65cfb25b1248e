"""LocalTransport: real /bin/sh subprocesses on this machine."""
from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import psutil
import pytest

from console.host.transport import TransportError, quote_argv
from console.host.connect import open_transport
from console.host.transport_local import LocalTransport
from tests.waiting import await_until, poll_until


def processes_with_arg(arg: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if arg in (p.info["cmdline"] or []):
            found.append(p)
    return found


def blocked_writing_a_pipe(arg: str) -> bool:
    """A process with `arg` on its command line sleeps in a write to a pipe nobody empties."""
    for p in processes_with_arg(arg):
        try:
            wchan = Path(f"/proc/{p.pid}/wchan").read_text().strip()
            if "pipe_write" in wchan:
                return True
            if wchan in ("", "0") and p.status() == psutil.STATUS_SLEEPING and p.io_counters().write_chars >= 65536:
                return True  # the kernel hides wchan: asleep after writing at least a pipe's worth
        except (OSError, psutil.Error):
            continue
    return False


def wait_gone(arg: str, within_s: float = 5.0) -> list[psutil.Process]:
    """Poll until no process has `arg` on its command line; returns the survivors (empty = gone)."""
    return [] if poll_until(lambda: not processes_with_arg(arg), within_s) else processes_with_arg(arg)


@pytest.fixture
async def local():
    t = await open_transport("local")
    try:
        yield t
    finally:
        await t.close()


async def test_open_transport_local_gives_local_transport(local):
    assert isinstance(local, LocalTransport)
    assert local.name == "local"


async def test_exit_status_stdout_stderr_verbatim(local):
    r = await local.run("printf 'out 1\\n  two  \\n'; printf 'err\\tline\\n' >&2", timeout=10)
    assert r.exit_status == 0
    assert r.stdout == "out 1\n  two  \n"
    assert r.stderr == "err\tline\n"
    assert r.timed_out is False and r.error is None
    assert r.command == "printf 'out 1\\n  two  \\n'; printf 'err\\tline\\n' >&2"
    assert r.duration_s > 0


async def test_non_zero_exit_keeps_stderr(local):
    r = await local.run("ls /definitely/not/here", timeout=10)
    assert r.exit_status == 2
    assert "/definitely/not/here" in r.stderr
    assert "No such file or directory" in r.stderr
    assert r.error is None


async def test_undecodable_output_is_replaced_not_dropped(local):
    r = await local.run("printf 'a\\377b'", timeout=10)
    assert r.stdout == "a\ufffdb"


async def test_stdin_is_fed(local):
    r = await local.run("wc -c", timeout=10, stdin=b"12345")
    assert r.stdout.strip() == "5"


async def test_no_stdin_means_eof_not_a_hang(local):
    r = await local.run("cat", timeout=10)
    assert r.exit_status == 0 and r.stdout == ""


async def test_killed_by_signal_has_no_exit_status(local):
    r = await local.run("kill -TERM $$", timeout=10)
    assert r.exit_status is None
    assert r.error == "killed by SIGTERM"


async def test_timeout_kills_the_whole_process_group(local):
    r = await local.run("sleep 987601 & sleep 987602; wait", timeout=0.5)
    assert r.timed_out is True
    assert r.exit_status is None
    assert "timed out after 0.5 s" in r.error and "killed process group" in r.error
    assert wait_gone("987601") == []
    assert wait_gone("987602") == []


async def test_timeout_keeps_output_written_before_it(local):
    r = await local.run("echo started; echo warn >&2; sleep 987603", timeout=0.5)
    assert r.timed_out
    assert r.stdout == "started\n"
    assert r.stderr == "warn\n"
    assert wait_gone("987603") == []


async def test_concurrent_commands(local):
    results = await asyncio.gather(*[local.run(f"echo {i}", timeout=20) for i in range(20)])
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(20)]


async def test_quoting_blocks_injection(local, tmp_path):
    victim = tmp_path / "injected"
    nasty = [f"a b", "it's", '"dq"', f"; touch {victim}", f"$(touch {victim})", f"`touch {victim}`", "$HOME"]
    r = await local.run("printf '%s\\n' " + quote_argv(nasty), timeout=10)
    assert r.exit_status == 0, r.stderr
    assert r.stdout.splitlines() == nasty
    assert not victim.exists()


async def test_put_and_get_tree_with_spaces(local, tmp_path):
    src = tmp_path / "src tree"
    (src / "sub dir").mkdir(parents=True)
    (src / "a file.txt").write_text("hello\n")
    (src / "sub dir" / "run me.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(src / "sub dir" / "run me.sh", 0o755)
    dst = tmp_path / "remote" / "copy here"
    await local.put(src, str(dst))
    assert (dst / "a file.txt").read_text() == "hello\n"
    assert stat.S_IMODE((dst / "sub dir" / "run me.sh").stat().st_mode) == 0o755
    back = tmp_path / "back"
    await local.get(str(dst), back)
    assert (back / "sub dir" / "run me.sh").read_text() == "#!/bin/sh\necho hi\n"
    await local.put(src / "a file.txt", str(tmp_path / "single" / "x.txt"))
    assert (tmp_path / "single" / "x.txt").read_text() == "hello\n"


async def test_put_missing_source_names_the_path(local, tmp_path):
    with pytest.raises(TransportError) as err:
        await local.put(tmp_path / "nope", str(tmp_path / "dst"))
    assert str(tmp_path / "nope") in str(err.value)
    assert "No such file or directory" in str(err.value)


async def test_stream_lines(local):
    lines = [line async for line in local.stream_lines("for i in 1 2 3; do echo line $i; done")]
    assert lines == ["line 1", "line 2", "line 3"]


async def test_stream_lines_failure_carries_stderr(local):
    with pytest.raises(TransportError) as err:
        async for _ in local.stream_lines("echo one; echo 'it broke' >&2; exit 4"):
            pass
    assert "exited with status 4" in str(err.value)
    assert "it broke" in str(err.value)


async def test_closing_a_stream_kills_the_command(local):
    stream = local.stream_lines("echo ready; exec sleep 987604")
    assert await stream.__anext__() == "ready"
    await stream.aclose()
    assert wait_gone("987604") == []


async def test_closing_a_stream_with_unread_output_does_not_hang(local):
    # the pipe is full and nobody reads it: closing must still kill and reap the command
    stream = local.stream_lines("seq 1 987605000")
    assert await stream.__anext__() == "1"
    await await_until(lambda: blocked_writing_a_pipe("987605000"), 10, "seq blocked on its full pipe")
    await stream.aclose()
    assert wait_gone("987605000") == []
