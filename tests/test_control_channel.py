"""The control channel (engine.api.protocol, `engine.ctl serve`, console/host/control_channel.py): many ops with ids over one
process, replies in order, errors said, an older engine (a copy of the engine before the channel) noted and still
served one process per op, a dropped channel reopened."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import orjson
import pytest

import engine
from console.host.run_client import NoSupervisor, RunClient, RunClientError
from console.host.transport_local import LocalTransport
from engine.supervisor.control import ControlServer
from engine.api.protocol import (PROTOCOL_VERSION, ErrorKind, Reply, Request,
                             decode_reply, decode_request, encode_event_line, encode_reply, encode_request)
from engine.api.ops import Follow, Hello, LastStatus
from engine.api.op_cli import ctl_argv
from engine.api.ops import (Drain, DrainHost, Pause, RestartWorker, Resume, RunEnding, ShardsChanged, Status,
                                    Stop, UndrainHost)
from engine.api.status import HostStatus, RunStatus
from tests.waiting import await_until

REPO = Path(__file__).resolve().parents[1]
BEFORE_CHANNEL = "0760363"
BIG_REPLY_BYTES = 3_000_000  # a full status of 10,000 shards is ~2 MB: one line  # main before the channel: its engine.ctl has no serve, no hello


def old_engine_copy(dst: Path) -> Path:
    """engine/ and probes/ as they were before the channel (git archive of BEFORE_CHANNEL), under dst."""
    dst.mkdir(parents=True, exist_ok=True)
    archive = dst / "old.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(REPO), "archive", BEFORE_CHANNEL, "engine", "probes"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dst, filter="data")
    archive.unlink()
    return dst


class FakeSupervisor:
    """The supervisor's control socket (engine.supervisor.control.ControlServer) with a handler that records the ops."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.ops: list = []
        self.server = ControlServer(run_dir / "control.sock", self.handle)

    async def handle(self, op) -> dict:
        self.ops.append(op)
        if isinstance(op, RestartWorker) and op.worker == "nope":
            from engine.api.ops import ControlError
            raise ControlError("unknown worker 'nope'; workers: w0")
        if isinstance(op, (Pause, Resume)):
            return ShardsChanged(op=op.op, shards=list(op.shards or []), state="running").to_dict()
        if isinstance(op, DrainHost):
            return HostStatus(name=op.host, address="gpu1.example", state="drained").to_dict()
        if isinstance(op, Status):  # the full status: one line of over 3 MB
            return RunStatus(run_dir=str(self.run_dir), state="running", shards_omitted=not op.shards,
                             log_tail=["x" * BIG_REPLY_BYTES] if op.shards else []).to_dict()
        return RunEnding(state="stopping").to_dict()


def test_codec_round_trips_every_op_and_reply():
    ops = [Hello(), LastStatus(), Status(), Status(shards=False), Pause(), Pause(shards=("a", "b")), Resume(),
           Resume(shards=("c",)), RestartWorker(worker="w0"), DrainHost(host="h1"), UndrainHost(host="h1"), Drain(),
           Stop(), Follow(), Follow(since=1796220000.5)]
    for i, op in enumerate(ops):
        assert decode_request(encode_request(Request(i, op))) == Request(i, op)
        assert ctl_argv(op)  # every op has a one-shot form
    for reply in (Reply(3, True, {"x": 1}), Reply(None, True, {}), Reply(4, False, error="gone",
                                                                         kind=ErrorKind.NO_SUPERVISOR)):
        assert decode_reply(encode_reply(reply)) == reply
    # a follow's event line carries the telemetry line as written
    assert decode_reply(encode_event_line(7, b'{"type":"dispatch","ts":1.5}\n')) == Reply(
        7, True, event={"type": "dispatch", "ts": 1.5})
    # an engine before the channel prints {"ok", "result"} / {"ok", "error"}: the same codec reads it
    assert decode_reply(b'{"ok": false, "error": "unknown worker"}') == Reply(None, False, error="unknown worker")


def _serve(run_dir: Path, engine_path: Path = REPO) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "engine.ctl", "--run-dir", str(run_dir), "serve"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=str(engine_path)))


def test_serve_answers_many_ops_in_order_with_their_ids_and_says_each_error(tmp_path):
    """One process: hello, ops forwarded to the control socket, a refused op, a bad line; replies in request order."""

    async def go():
        sup = FakeSupervisor(tmp_path)
        await sup.server.start()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "engine.ctl", "--run-dir", str(tmp_path), "serve", stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO)))
        lines = [encode_request(Request(10, Hello())), encode_request(Request(11, Pause(shards=tuple(f"s{i}" for i in range(10))))),
                 encode_request(Request(12, Status(shards=False))), b'{"id": 13, "op": {"op": "explode"}}\n',
                 b"not json\n", encode_request(Request(14, RestartWorker(worker="nope"))),
                 encode_request(Request(15, Resume()))]
        proc.stdin.write(b"".join(lines))  # all at once: the replies still come one per request, in order
        await proc.stdin.drain()
        replies = [decode_reply(await asyncio.wait_for(proc.stdout.readline(), 30)) for _ in lines]
        proc.stdin.close()
        rc = await asyncio.wait_for(proc.wait(), 30)
        await sup.server.close()
        return replies, rc, sup.ops

    replies, rc, ops = asyncio.run(go())
    assert rc == 0  # stdin closed: serve ends
    assert [r.id for r in replies] == [10, 11, 12, 13, None, 14, 15]
    assert replies[0].result == {"engine": engine.__version__, "protocol": PROTOCOL_VERSION}
    assert replies[1].ok and replies[1].result["shards"] == [f"s{i}" for i in range(10)]
    assert replies[2].ok and replies[2].result["shards_omitted"] is True
    assert not replies[3].ok and replies[3].kind is ErrorKind.BAD_REQUEST and "unknown op 'explode'" in replies[3].error
    assert not replies[4].ok and "not JSON" in replies[4].error
    assert not replies[5].ok and replies[5].kind is ErrorKind.REFUSED and "unknown worker 'nope'" in replies[5].error
    assert replies[6].ok
    assert ops == [Pause(shards=tuple(f"s{i}" for i in range(10))), Status(shards=False),
                   RestartWorker(worker="nope"), Resume()]


def test_serve_with_no_supervisor_replies_with_an_error_that_names_the_socket(tmp_path):
    proc = _serve(tmp_path)
    out, err = proc.communicate(encode_request(Request(1, Stop())) + encode_request(Request(2, Hello())), timeout=60)
    first, second = (decode_reply(line) for line in out.splitlines())
    assert not first.ok and first.kind is ErrorKind.NO_SUPERVISOR
    assert f"{tmp_path / 'control.sock'} does not exist (no supervisor has this run dir open)" in first.error
    assert second.ok and second.id == 2  # the channel goes on after an error reply
    assert proc.returncode == 0, err


async def open_client(run_dir) -> tuple[FakeSupervisor, CountingLocalTransport, RunClient]:
    """A fake supervisor at run_dir and a RunClient whose channel is open to it (the engine of this checkout)."""
    sup = FakeSupervisor(run_dir)
    await sup.server.start()
    transport = CountingLocalTransport()
    client = RunClient(transport, str(run_dir), host_python=sys.executable, engine_path=str(REPO))
    await client.open_channel()
    return sup, transport, client


def test_the_client_carries_concurrent_ops_over_one_process_and_matches_replies_by_id(tmp_path):
    async def go():
        sup, transport, client = await open_client(tmp_path)
        results = await asyncio.gather(client.pause([f"s{i:05d}" for i in range(10)]), client.status(shards=False),
                                       client.resume(["s00001"]), client.drain_host("h1"), client.status())
        with pytest.raises(RunClientError, match="unknown worker 'nope'") as refused:
            await client.restart_worker("nope")
        hello = client.channel.hello
        await client.close_channel()
        await sup.server.close()
        with pytest.raises(NoSupervisor, match="control.sock does not exist"):
            await client.status()  # one process per op again once the channel is closed: the same errors
        await transport.close()
        return results, refused.value, hello, transport.opened, transport.ran, sup.ops

    results, refused, hello, opened, ran, ops = asyncio.run(go())
    assert [type(r) for r in results] == [ShardsChanged, RunStatus, ShardsChanged, HostStatus, RunStatus]
    assert len(results[4].log_tail[0]) == BIG_REPLY_BYTES and results[1].shards_omitted and not results[1].log_tail
    assert results[0].shards == [f"s{i:05d}" for i in range(10)] and results[2].op == "resume"
    assert results[3].state == "drained"
    assert refused.kind == "error"
    assert hello.protocol == PROTOCOL_VERSION and hello.engine_version == engine.__version__
    assert len(opened) == 1 and opened[0].endswith("serve")  # six ops, one process
    assert len(ran) == 1 and "status" in ran[0]  # the one after close_channel
    assert len(ops) == 6


class CountingLocalTransport(LocalTransport):
    """LocalTransport that lists each command it starts: `opened` (open_process), `ran` (run), `streamed`
    (stream_lines)."""

    def __init__(self):
        super().__init__()
        self.opened: list[str] = []
        self.ran: list[str] = []
        self.streamed: list[str] = []

    def stream_lines(self, command: str):
        self.streamed.append(command)
        return super().stream_lines(command)

    async def open_process(self, command: str):
        self.opened.append(command)
        return await super().open_process(command)

    async def run(self, command: str, *, timeout: float, stdin: bytes | None = None):
        self.ran.append(command)
        return await super().run(command, timeout=timeout, stdin=stdin)


def test_an_engine_before_the_channel_gets_the_note_and_is_served_one_process_per_op(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # `python -m` puts the working directory first on sys.path: not this checkout's engine
    old = old_engine_copy(tmp_path / "old-engine")
    assert not (old / "engine" / "protocol.py").exists()
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    async def go():
        sup = FakeSupervisor(run_dir)
        await sup.server.start()
        transport = CountingLocalTransport()
        client = RunClient(transport, str(run_dir), host_python=sys.executable, engine_path=str(old))
        await client.open_channel()
        paused = await client.pause(["s00001", "s00002"])
        status = await client.status(shards=False)
        events = [ev async for ev in client.follow(since=None)]  # no supervisor.pid: ends once the file is sent
        await sup.server.close()
        await transport.close()
        return client, paused, status, transport, events

    (run_dir / "telemetry.jsonl").write_bytes(b"\n".join(RECORDED_EVENTS) + b"\n")
    client, paused, status, transport, events = asyncio.run(go())
    assert client.channel is None
    assert client.protocol_note.startswith(f"engine at local:{run_dir} speaks an older protocol")
    assert "invalid choice: 'serve'" in client.protocol_note  # the old engine's own words
    assert client.protocol_note.endswith("one process per op")
    assert paused.shards == ["s00001", "s00002"] and status.run_dir == str(run_dir) and status.shards_omitted
    assert len(transport.ran) == 2 and all(" engine.ctl " in c for c in transport.ran)
    assert [ev.to_dict() for ev in events] == [orjson.loads(line) for line in RECORDED_EVENTS]
    assert len(transport.streamed) == 1 and transport.streamed[0].endswith(" follow")  # its own process


def test_a_channel_whose_process_dies_fails_the_op_in_flight_and_a_new_one_carries_the_next(tmp_path):
    async def go():
        sup, transport, client = await open_client(tmp_path)
        first = client.channel
        os.killpg(first.process.pid, signal.SIGKILL)
        await await_until(lambda: first.closed is not None, 10, "the channel to see its process die")
        with pytest.raises(RunClientError, match="killed by SIGKILL") as lost:
            await client.status()
        await client.open_channel()
        again = await client.status()
        await client.close_channel()
        await sup.server.close()
        await transport.close()
        return lost.value, again, transport.opened

    lost, again, opened = asyncio.run(go())
    assert lost.kind == "unreachable" and "not sent again" in str(lost)
    assert again.state == "running"
    assert len(opened) == 2


class NewerEngineProcess:
    """An engine.ctl serve that answers hello with another protocol version (console.host.transport.Process)."""

    command = "engine.ctl serve"
    pid = None

    def __init__(self, protocol: int = PROTOCOL_VERSION + 1):
        self.lines: asyncio.Queue[bytes] = asyncio.Queue()
        self.closed = False
        self.protocol = protocol
        self.requests: list = []

    async def write(self, data: bytes) -> None:
        request = decode_request(data)
        self.requests.append(request.op)
        await self.lines.put(encode_reply(Reply(request.id, True, {"engine": "9.0.0", "protocol": self.protocol})))

    async def readline(self) -> bytes:
        return await self.lines.get()

    async def ended(self):
        raise AssertionError("not asked: the process did not end by itself")

    async def close(self) -> None:
        self.closed = True
        await self.lines.put(b"")


def test_an_engine_of_another_protocol_version_gets_the_note_and_its_channel_is_closed():
    process = NewerEngineProcess()

    class Transport:
        name = "gpu1"

        async def open_process(self, command: str):
            return process

    async def go():
        client = RunClient(Transport(), "/r")
        await client.open_channel()
        return client

    client = asyncio.run(go())
    assert client.channel is None and process.closed
    assert client.protocol_note == (f"engine 9.0.0 at gpu1:/r speaks protocol {PROTOCOL_VERSION + 1}, this console "
                                    f"{PROTOCOL_VERSION}: one process per op")


RECORDED_EVENTS = (REPO / "tests" / "data" / "wire" / "telemetry.jsonl").read_bytes().splitlines()


def fake_supervisor_pid(run_dir: Path) -> subprocess.Popen:
    """A process engine.ctl takes for the run's supervisor (its command line names engine.supervisor): while it lives,
    a follow waits for more lines."""
    proc = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()", "engine.supervisor"])
    (run_dir / "supervisor.pid").write_text(str(proc.pid))
    return proc


def test_the_follow_goes_over_the_open_channel_beside_the_ops_tails_the_file_and_ends_with_the_supervisor(tmp_path):
    telemetry = tmp_path / "telemetry.jsonl"
    telemetry.write_bytes(b"\n".join(RECORDED_EVENTS[:4]) + b"\n")
    holder = fake_supervisor_pid(tmp_path)

    async def go():
        sup, transport, client = await open_client(tmp_path)
        try:
            first = client.follow(since=None)
            got = [await anext(first) for _ in range(2)]
            await first.aclose()  # left early: its lines are dropped, the next follow ends it on the host
            since = orjson.loads(RECORDED_EVENTS[2])["ts"]
            stream = client.follow(since=since)
            again = [await anext(stream) for _ in range(2)]
            status = await client.status()  # an op while the follow streams
            with open(telemetry, "ab") as f:  # the supervisor writes on: the follow tails it
                f.write(RECORDED_EVENTS[4] + b"\n")
            appended = await asyncio.wait_for(anext(stream), 30)
            holder.kill()
            holder.wait()
            rest = [ev async for ev in stream]  # the supervisor is gone and the file sent: the follow ends
            return got, again, status, appended, rest, client.channel.closed, transport
        finally:
            await client.close_channel()
            await sup.server.close()
            await transport.close()

    try:
        got, again, status, appended, rest, closed, transport = asyncio.run(go())
    finally:
        holder.kill()
        holder.wait()
    recorded = [orjson.loads(line) for line in RECORDED_EVENTS]
    assert [ev.to_dict() for ev in got] == recorded[:2]
    assert [ev.to_dict() for ev in again] == [x for x in recorded[:4] if x["ts"] >= recorded[2]["ts"]][:2]
    assert status.run_dir == str(tmp_path)
    assert appended.to_dict() == recorded[4] and rest == []
    assert closed is None  # the channel outlived both follows
    assert len(transport.opened) == 1 and transport.streamed == [] and transport.ran == []  # one process for all


def test_a_follow_with_nothing_to_follow_is_said_and_the_channel_goes_on(tmp_path):
    async def go():
        transport = CountingLocalTransport()
        client = RunClient(transport, str(tmp_path / "no-such-run"), host_python=sys.executable,
                           engine_path=str(REPO))
        await client.open_channel()
        try:
            with pytest.raises(RunClientError, match="no run dir .*no-such-run") as refused:
                async for _ in client.follow(since=None):
                    pass
            with pytest.raises(NoSupervisor):
                await client.status()
            return refused.value, client.channel.closed, transport.opened
        finally:
            await client.close_channel()
            await transport.close()

    refused, closed, opened = asyncio.run(go())
    assert refused.kind == "unreachable" and closed is None and len(opened) == 1


def test_an_engine_of_protocol_1_keeps_the_channel_for_the_ops_and_follows_one_process():
    process = NewerEngineProcess(protocol=1)

    class Transport:
        name = "gpu1"
        streamed: list[str] = []

        async def open_process(self, command: str):
            return process

        async def stream_lines(self, command: str):
            self.streamed.append(command)
            for line in RECORDED_EVENTS[:3]:
                yield line.decode()

    async def go():
        transport = Transport()
        client = RunClient(transport, "/r")
        await client.open_channel()
        events = [ev async for ev in client.follow(since=None)]
        return client, events, transport.streamed

    client, events, streamed = asyncio.run(go())
    assert client.channel is not None and not client.channel.can_follow and client.protocol_note == ""
    assert process.requests == [Hello()]  # the follow did not go over the channel
    assert len(streamed) == 1 and streamed[0].endswith(" follow")
    assert [ev.to_dict() for ev in events] == [orjson.loads(line) for line in RECORDED_EVENTS[:3]]
