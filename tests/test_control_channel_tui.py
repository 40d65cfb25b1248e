"""The TUI's control channel against real runs: over the real sshd a pause of 10 shards is one request on the open
channel (no process started for it), a channel whose process dies is reopened before the next op, a cut SSH
connection reconnects with a new channel; a run whose deployed engine predates the channel (a copy of the engine
before it) shows the note and is still paused and resumed, one process per op."""
from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

import console.host.deploy
from console.host.control_channel import ControlChannel
from console.host.deploy import start_run
from console.host.run_client import RunClient
from console.host.ssh_options import SshOptions
from console.host.connect import open_transport
from console.host.transport_local import LocalTransport
from console.host.transport_ssh import SshTransport
from console.tui.app import RegenApp
from console.tui.shard_table import ShardTable
from console.host.source import HostSource
from engine.api.ops import Hello
from engine.api.ops import Pause, Resume
from tests.run_helpers import make_config
from tests.sshd_fixtures import kill_sshd_connection
from tests.test_cli_run import cleanup_runs  # noqa: F401  (fixture)
from tests.test_control_channel import old_engine_copy
from tests.test_tui_app import header, wait_until

# slow enough that the run still has pending shards while the test acts on it
SLOW_SIM = ("--sim-step-ms", "60", "--sim-tokens-per-step", "1", "--sim-output-mean", "200",
            "--max-running-requests", "4")


class Execs:
    """Every command the console starts on a host, by kind (run / stream / process), and every op on a channel."""

    def __init__(self, monkeypatch, transport_cls):
        self.commands: list[tuple[str, str]] = []
        self.channel_ops: list = []
        run, stream, process = transport_cls.run, transport_cls.stream_lines, transport_cls.open_process
        call = ControlChannel.call

        async def counted_run(t, command, **kw):
            self.commands.append(("run", command))
            return await run(t, command, **kw)

        def counted_stream(t, command):
            self.commands.append(("stream", command))
            return stream(t, command)

        async def counted_process(t, command):
            self.commands.append(("process", command))
            return await process(t, command)

        async def counted_call(channel, op, timeout):
            self.channel_ops.append(op)
            return await call(channel, op, timeout)

        monkeypatch.setattr(transport_cls, "run", counted_run)
        monkeypatch.setattr(transport_cls, "stream_lines", counted_stream)
        monkeypatch.setattr(transport_cls, "open_process", counted_process)
        monkeypatch.setattr(ControlChannel, "call", counted_call)

    def ctl(self, kind: str | None = None) -> list[str]:
        """The engine.ctl commands started (of one kind)."""
        return [c for k, c in self.commands if " engine.ctl " in c and (kind is None or k == kind)]


def shard_states(app, ids: list[str]) -> list[str]:
    table = app.query_one("#shards-table", ShardTable)
    return [table.cells(sid)["state"] for sid in ids]


def pick_pending(app, n: int) -> list[str]:
    """Select the last n shards of the list (pending ones: pausing them matters) the way the operator does."""
    panel = app.panel("shards")
    ids = panel.shards.ids()[-n:]
    for sid in ids:
        panel.shards.toggle(sid)
    return ids


@pytest.mark.sshd
@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_over_sshd_a_pause_of_ten_shards_is_one_request_on_the_open_channel(sshd, tmp_path, tiny_model_dir,
                                                                                  cleanup_runs, monkeypatch):
    run_dir = tmp_path / "channel run"
    cleanup_runs.append(run_dir)
    cfg = make_config(run_dir, tiny_model_dir, prompts=150, gpus=1, sim=SLOW_SIM, shard_size=10)
    ssh = SshOptions(ssh_config=str(sshd.ssh_config_path))
    transport = await open_transport(sshd.alias, ssh_config=str(sshd.ssh_config_path))
    try:
        await start_run(transport, cfg, host_python=sys.executable)
    finally:
        await transport.close()

    execs = Execs(monkeypatch, SshTransport)
    source = HostSource(sshd.alias, str(run_dir), ssh=ssh)
    app = RegenApp(source, export_dir=tmp_path, run_probes_on_start=False)
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.press("3")
        table = app.query_one("#shards-table", ShardTable)
        await wait_until(pilot, lambda: table.row_count >= 10 and "connected" in header(app), "ten shard rows", 60)
        assert len(execs.ctl("process")) == 1 and execs.ctl("process")[0].endswith(" serve")  # the channel
        assert source.client.channel.hello is not None and "older" not in header(app)
        ids = pick_pending(app, 10)
        ctl_before, ops_before = len(execs.ctl()), len(execs.channel_ops)
        await pilot.press("p")
        await wait_until(pilot, lambda: all("paused" in s for s in shard_states(app, ids)), "the ten shown paused", 30)
        # one request carried the ten; the status that follows it went over the channel too; no process started
        sent = execs.channel_ops[ops_before:]
        assert [op for op in sent if isinstance(op, Pause)] == [Pause(shards=tuple(ids))]
        assert len(execs.ctl()) == ctl_before, execs.ctl()[ctl_before:]

        # the channel's process dies: the next op opens a new channel first (and the operator is told)
        channel = source.client.channel
        os.killpg(channel.process.pid, signal.SIGKILL)
        await wait_until(pilot, lambda: channel.closed is not None, "the channel to see its process die", 10)
        await pilot.press("R")  # resume all
        await wait_until(pilot, lambda: not any("paused" in s for s in shard_states(app, ids)), "the ten resumed", 30)
        assert len(execs.ctl("process")) == 2
        assert [op for op in execs.channel_ops if isinstance(op, Resume)] == [Resume(shards=None)]
        alerts = [a.text for a in app.model.alerts]
        assert any("closed: `engine.ctl serve` was killed by signal" in a and "opening a new one" in a
                   for a in alerts), alerts

        # the SSH connection is cut: the follow loop reconnects, and the new connection gets its own channel
        port = source.transport.connection.get_extra_info("sockname")[1]
        kill_sshd_connection(sshd, port)
        await wait_until(pilot, lambda: app.model.connection.state in ("reconnecting", "lost"), "the cut seen", 30)
        await wait_until(pilot, lambda: app.model.connection.state == "connected", "reconnected", 60)
        assert len(execs.ctl("process")) == 3
        ops_before = len(execs.channel_ops)
        status = await source.status()
        assert status.run_dir == str(run_dir) and len(execs.channel_ops) == ops_before + 1
        assert not execs.ctl("run")  # not one op went one process each
    await source.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_an_engine_before_the_channel_shows_the_note_and_still_pauses(tmp_path, tiny_model_dir, cleanup_runs,
                                                                            monkeypatch):
    """The run is started with a copy of the engine before the channel deployed (supervisor and engine.ctl)."""
    monkeypatch.chdir(tmp_path)  # `python -m` puts the working directory first on sys.path: not this checkout's engine
    old = old_engine_copy(tmp_path / "old-engine")

    def old_tree(dst: Path) -> Path:
        for pkg in ("engine", "probes"):
            shutil.copytree(old / pkg, dst / pkg)
        return dst

    monkeypatch.setattr(console.host.deploy, "package_tree", old_tree)
    dump = console.host.deploy.dump_toml
    # the old engine's config refuses keys added since (at their defaults here): the frozen config leaves them out
    added = ("refused_share =", "turns_after_cut =", "schedule_conservativeness =", "conservativeness_min =",
             "conservativeness_max =", "mixed_chunk =")

    def old_toml(cfg) -> str:
        kept, in_metrics = [], False  # and the [metrics] table (added since)
        for line in dump(cfg).splitlines():
            if line.startswith("["):
                in_metrics = line == "[metrics]"
            if not in_metrics and not line.startswith(added):
                kept.append(line)
        return "\n".join(kept) + "\n"
    monkeypatch.setattr(console.host.deploy, "dump_toml", old_toml)
    run_dir = tmp_path / "old run"
    cleanup_runs.append(run_dir)
    cfg = make_config(run_dir, tiny_model_dir, prompts=150, gpus=1, sim=SLOW_SIM, shard_size=10)
    transport = LocalTransport()
    try:
        started = await start_run(transport, cfg, host_python=sys.executable)
    finally:
        await transport.close()
    assert not (Path(started.engine_path) / "engine" / "protocol.py").exists()

    execs = Execs(monkeypatch, LocalTransport)
    source = HostSource("local", str(run_dir), host_python=sys.executable, transport=LocalTransport())
    app = RegenApp(source, export_dir=tmp_path, run_probes_on_start=False)
    async with app.run_test(size=(200, 40)) as pilot:
        await pilot.press("3")
        table = app.query_one("#shards-table", ShardTable)
        await wait_until(pilot, lambda: table.row_count >= 10 and "connected" in header(app), "ten shard rows", 60)
        assert "older engine: one process per op" in " ".join(header(app).split())  # a long tmp path wraps it
        await pilot.press("6")
        notes = [a for a in app.model.alerts if "speaks an older protocol" in a.text]
        assert len(notes) == 1 and notes[0].severity == "warning", [a.text for a in app.model.alerts]
        assert "invalid choice: 'serve'" in notes[0].text and notes[0].text.endswith("one process per op")
        await pilot.press("3")
        ids = pick_pending(app, 10)
        before = len(execs.ctl("run"))
        await pilot.press("p")
        await wait_until(pilot, lambda: all("paused" in s for s in shard_states(app, ids)), "the ten shown paused", 30)
        assert any(c.endswith("pause " + " ".join(ids)) for c in execs.ctl("run")[before:])
        assert execs.channel_ops == [Hello()]  # the one the old engine did not answer
        status = await RunClient(LocalTransport(), started.run_dir, sys.executable, started.engine_path).status()
        assert {s.id for s in status.shards if s.state == "paused"} >= set(ids)
    await source.close()
    await source.transport.close()
