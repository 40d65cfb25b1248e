"""The control ops (engine.api.ops): the wire format through the one codec (engine.api.op_codec), the parse errors,
the requests engine.ctl sends for each command line (engine.api.op_cli), and each op's declared reply type."""
from __future__ import annotations

import asyncio
import json

import pytest

from console.host.run_client import RunClient
from probes.model import CommandResult

from engine.api.ops import ControlError
from engine.supervisor.control import ControlServer
from engine.ctl import build_parser, op_of
from engine.api.ops import (CHANNEL_OPS, OPS, ControlOp, Drain, DrainHost, Follow, Hello, LastStatus, LogTail, Pause,
                            RestartWorker, Resume, RunEnding, Status, Stop, UndrainHost)
from engine.api.op_cli import arguments, ctl_argv
from engine.api.op_codec import decode_op as parse_op, encode_op as to_request, reply_type

WIRE = [
    ({"op": "status"}, Status()),
    ({"op": "status", "shards": False}, Status(shards=False)),
    ({"op": "pause", "shards": "all"}, Pause(shards=None)),
    ({"op": "pause", "shards": ["s00001", "s00003"]}, Pause(shards=("s00001", "s00003"))),
    ({"op": "resume", "shards": "all"}, Resume(shards=None)),
    ({"op": "resume", "shards": []}, Resume(shards=())),
    ({"op": "restart_worker", "worker": "w0"}, RestartWorker(worker="w0")),
    ({"op": "drain_host", "host": "h2"}, DrainHost(host="h2")),
    ({"op": "undrain_host", "host": "h2"}, UndrainHost(host="h2")),
    ({"op": "log_tail", "worker": "h1.gpu0", "lines": 50}, LogTail(worker="h1.gpu0", lines=50)),
    ({"op": "drain"}, Drain()),
    ({"op": "stop"}, Stop()),
]


@pytest.mark.parametrize("request_, op", WIRE, ids=[str(w[0]) for w in WIRE])
def test_each_op_reads_and_writes_the_same_json(request_, op):
    assert parse_op(request_) == op
    assert to_request(op) == request_


def test_every_op_has_a_wire_case_and_pause_without_shards_means_all():
    assert {w[0]["op"] for w in WIRE} == set(OPS)
    assert parse_op({"op": "pause"}) == Pause(shards=None)


@pytest.mark.parametrize("request_, error", [
    ({"op": "explode"}, "unknown op 'explode'; known: status, pause, resume, restart_worker, drain_host, "
                        "undrain_host, log_tail, drain, stop"),
    ({}, "unknown op None; known: "),
    ([1, 2], "unknown op None; known: "),
    ({"op": "pause", "shards": "s00001"}, '"shards" must be a list of shard ids or "all"'),
    ({"op": "resume", "shards": [1]}, '"shards" must be a list of shard ids or "all"'),
    ({"op": "restart_worker"}, '"worker" must be a worker\'s name, e.g. w0 (a string); got None'),
    ({"op": "drain_host", "host": 3}, '"host" must be a [[hosts]] name of the run config (a string); got 3'),
    ({"op": "status", "shards": "no"}, '"shards" must be true or false; got \'no\''),
    ({"op": "log_tail", "worker": "gpu0", "lines": 0}, '"lines" must be an integer from 1 to 10000; got 0'),
    ({"op": "log_tail", "lines": 5}, '"worker" must be a worker\'s name, e.g. gpu0 (a string); got None'),
])
def test_a_bad_request_is_refused_with_the_text_the_reply_carries(request_, error):
    with pytest.raises(ControlError) as exc:
        parse_op(request_)
    assert str(exc.value).startswith(error)


@pytest.mark.parametrize("argv, sent", [
    (["status"], {"op": "status"}),
    (["status", "--no-shards"], {"op": "status", "shards": False}),
    (["pause", "s00001", "s00002"], {"op": "pause", "shards": ["s00001", "s00002"]}),
    (["pause", "--all"], {"op": "pause", "shards": "all"}),
    (["resume", "--all"], {"op": "resume", "shards": "all"}),
    (["restart-worker", "w1"], {"op": "restart_worker", "worker": "w1"}),
    (["drain-host", "h2"], {"op": "drain_host", "host": "h2"}),
    (["undrain-host", "h2"], {"op": "undrain_host", "host": "h2"}),
    (["log-tail", "gpu1"], {"op": "log_tail", "worker": "gpu1", "lines": 200}),
    (["log-tail", "gpu1", "--lines", "20"], {"op": "log_tail", "worker": "gpu1", "lines": 20}),
    (["drain"], {"op": "drain"}),
    (["stop"], {"op": "stop"}),
])
def test_engine_ctl_sends_the_wire_request_of_each_command(argv, sent):
    assert to_request(op_of(build_parser().parse_args(["--run-dir", "/r", *argv]))) == sent


class OldEngineTransport:
    """A host whose deployed engine.ctl predates `status --no-shards` (argparse refuses it, exit 2)."""
    name = "old-host"

    def __init__(self):
        self.commands: list[str] = []

    async def run(self, command: str, *, timeout: float, stdin: bytes | None = None) -> CommandResult:
        self.commands.append(command)
        if "--no-shards" in command:
            return CommandResult(command, 2, "", "usage: python -m engine.ctl [-h] ...\npython -m engine.ctl: error: "
                                 "unrecognized arguments: --no-shards\n", 0.01)
        reply = {"ok": True, "result": {"run_dir": "/r", "state": "running", "shards": [{"id": "s00000"}]}}
        return CommandResult(command, 0, json.dumps(reply) + "\n", "", 0.01)


def test_a_status_without_shards_falls_back_to_the_full_one_on_an_engine_that_predates_it():
    transport = OldEngineTransport()
    client = RunClient(transport, "/r")
    first = asyncio.run(client.status(shards=False))
    again = asyncio.run(client.status(shards=False))
    assert [s.id for s in first.shards] == [s.id for s in again.shards] == ["s00000"]
    assert ["--no-shards" in c for c in transport.commands] == [True, False, False]  # asked once, then not again


# -- one declaration per op: its reply type, its JSON, its command line ------------------------------------------------
EVERY_OP = [Status(), Status(shards=False), Pause(), Pause(shards=("s1", "s2")), Resume(), Resume(shards=("s3",)),
            RestartWorker(worker="w0"), DrainHost(host="h1"), UndrainHost(host="h1"), LogTail(worker="gpu0"),
            LogTail(worker="gpu0", lines=7), Drain(), Stop(), Hello(), LastStatus(), Follow(), Follow(since=17.5)]


def test_every_op_is_in_the_cases_and_declares_a_reply_type_that_writes_its_json():
    assert {type(op) for op in EVERY_OP} == set(CHANNEL_OPS)
    for cls in CHANNEL_OPS:
        assert hasattr(reply_type(cls), "to_dict"), cls  # RunStatus and HostStatus resolved from above engine.api


@pytest.mark.parametrize("op", EVERY_OP, ids=[repr(op) for op in EVERY_OP])
def test_each_op_round_trips_through_the_one_codec_and_its_derived_command_line(op):
    assert parse_op(json.loads(json.dumps(to_request(op)))) == op
    assert op_of(build_parser().parse_args(["--run-dir", "/r", *ctl_argv(op)])) == op


def test_a_bad_command_line_value_is_refused_by_engine_ctl_with_the_field_before_anything_is_sent(tmp_path, capsys):
    from engine.ctl import EXIT_ERROR_REPLY, main

    assert main(["--run-dir", str(tmp_path), "log-tail", "gpu0", "--lines", "0"]) == EXIT_ERROR_REPLY
    assert capsys.readouterr().err.strip() == '"lines" must be an integer from 1 to 10000; got 0'
    assert main(["--run-dir", str(tmp_path), "pause", "s1", "--all"]) == EXIT_ERROR_REPLY
    assert capsys.readouterr().err.strip() == "pause: give shard ids or --all (not both)"


def test_a_field_with_no_command_line_form_is_named_when_the_parser_is_built():
    class Weigh(ControlOp):
        op = "weigh"
        Reply = RunEnding
        weights: list[int] = []

    with pytest.raises(TypeError, match=r"Weigh\.weights: no command-line form for list\[int\]"):
        arguments(Weigh)


async def test_the_control_socket_refuses_engine_ctls_own_ops_and_a_reply_of_the_wrong_type(tmp_path):
    async def handler(op):
        return RunEnding(state="stopping")  # right for stop, wrong for pause

    server = ControlServer(tmp_path / "control.sock", handler)
    assert json.loads(await server._handle_line(b'{"op": "stop"}\n')) == {"ok": True,
                                                                          "result": {"state": "stopping"}}
    wrong = json.loads(await server._handle_line(b'{"op": "pause", "shards": "all"}\n'))
    assert wrong == {"ok": False, "error": "pause failed: TypeError: pause's handler replied a RunEnding, "
                                           "not its ShardsChanged"}
    hello = json.loads(await server._handle_line(b'{"op": "hello"}\n'))
    assert hello == {"ok": False, "error": "hello is answered by engine.ctl, not the supervisor's control socket"}


def test_every_supervisor_op_has_its_handler():
    from engine.supervisor.ops import unhandled

    assert unhandled() == []
