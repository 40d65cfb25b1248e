"""Every recorded reply and telemetry event decodes through the wire types the console uses, and round-trips: decode ->
encode gives back the JSON the engine wrote. tests/data/wire/ is this engine's (tests/record_wire_fixtures.py records
it); tests/data/tui_telemetry.jsonl an older engine's, whose missing fields take their defaults. A malformed field is
an error that names it; a field the console does not know is dropped."""
from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from engine.api.op_codec import REPLY_TYPES, decode_result
from engine.ctl import build_parser, op_of
from engine.api.ops import Hello
from engine.api.ops import ShardsChanged
from engine.api.status import RunStatus
from engine.api.events import EVENT_TYPES, ShardEvent, parse_event
from engine.api.wire import ShardFigures, WireError

DATA = Path(__file__).parent / "data"
REPLIES = [json.loads(line) for line in (DATA / "wire" / "replies.jsonl").read_text().splitlines()]
EVENTS = (DATA / "wire" / "telemetry.jsonl").read_bytes().splitlines()
OLDER_EVENTS = (DATA / "tui_telemetry.jsonl").read_bytes().splitlines()


def decoded(recorded: dict):
    op = op_of(build_parser().parse_args(["--run-dir", "/r", *recorded["argv"]]))
    return decode_result(op, recorded["result"], recorded["name"])


def test_the_recording_has_every_reply_type_and_event_type_the_console_reads():
    ops = {type(op_of(build_parser().parse_args(["--run-dir", "/r", *r["argv"]]))) for r in REPLIES}
    assert {REPLY_TYPES[op] for op in ops} == set(REPLY_TYPES.values()) - {REPLY_TYPES[op] for op in REPLY_TYPES
                                                                          if op.op in ("drain_host", "undrain_host")}
    assert Hello in ops
    assert {orjson.loads(line)["type"] for line in EVENTS} == set(EVENT_TYPES)
    states = {r["result"]["state"] for r in REPLIES if isinstance(decoded(r), RunStatus)}
    assert {"running", "drained", "dead", "failed"} <= states  # live, and each way a run dir records its end


@pytest.mark.parametrize("recorded", REPLIES, ids=[r["name"] for r in REPLIES])
def test_each_recorded_reply_decodes_into_its_wire_type_and_encodes_back_to_the_same_json(recorded):
    reply = decoded(recorded)
    assert type(reply) is REPLY_TYPES[type(op_of(build_parser().parse_args(["--run-dir", "/r", *recorded["argv"]])))]
    assert reply.to_dict() == recorded["result"]
    if isinstance(reply, RunStatus):
        assert all(type(sh) is ShardFigures for sh in reply.shards)  # the one shard-figures class


@pytest.mark.parametrize("line", EVENTS, ids=[f"{orjson.loads(x)['type']}-{i}" for i, x in enumerate(EVENTS)])
def test_each_recorded_event_decodes_and_encodes_back_to_the_same_json(line):
    assert parse_event(line).to_dict() == orjson.loads(line)


def test_an_older_engines_events_decode_with_the_fields_it_lacks_at_their_defaults():
    for line in OLDER_EVENTS:
        written = orjson.loads(line)
        ev = parse_event(line)
        again = ev.to_dict()
        assert {k: again[k] for k in written} == written  # what it wrote, unchanged
        assert parse_event(orjson.dumps(again)) == ev


def test_a_shard_event_carries_the_status_shards_figures():
    status = decoded(next(r for r in REPLIES if r["name"] == "status"))
    sh = status.shards[0]
    ev = ShardEvent.of(sh, ts=5.0)
    assert {k: v for k, v in ev.to_dict().items() if k not in ("ts", "type")} == sh.to_dict()


def test_a_malformed_field_is_named_and_a_missing_one_takes_its_default():
    recorded = next(r for r in REPLIES if r["name"] == "status")
    data = json.loads(json.dumps(recorded["result"]))
    data["shards"][3]["done"] = "many"
    with pytest.raises(WireError, match=r"^status reply: shards\.3\.done: Input should be a valid integer"):
        RunStatus.from_dict(data)
    with pytest.raises(WireError, match=r"pause: paused: Input should be a valid list"):
        decode_result(op_of(build_parser().parse_args(["--run-dir", "/r", "pause", "s1"])),
                      {"op": "pause", "shards": ["s1"], "paused": "s1", "state": "running"}, "pause")
    with pytest.raises(WireError, match=r"^dispatch event: done: Input should be a valid integer"):
        parse_event(b'{"type": "dispatch", "ts": 1.0, "done": null}')
    older = {k: v for k, v in recorded["result"].items() if k not in ("levels", "brake", "metrics", "shards_omitted")}
    older["shards"] = [{k: v for k, v in sh.items() if k not in ("dispatched", "unclosed_reasoning")}
                       for sh in older["shards"]]
    older["a_field_from_a_newer_engine"] = {"x": 1}
    status = RunStatus.from_dict(older)
    assert status.brake is None and status.levels.empty_share == 0.05 and status.shards[0].dispatched == 0
    assert ShardsChanged() == decode_result(op_of(build_parser().parse_args(["--run-dir", "/r", "resume", "--all"])),
                                            {}, "resume")


async def test_a_malformed_telemetry_line_is_skipped_and_said_a_newer_engines_event_type_skipped_quietly(tmp_path):
    from console.host.source import ReplaySource

    path = tmp_path / "telemetry.jsonl"
    path.write_bytes(b"\n".join([EVENTS[0], b'{"type": "dispatch", "ts": 2.0, "done": "lots"}',
                                 b'{"type": "from_the_future", "ts": 3.0}', EVENTS[1]]) + b"\n")
    source = ReplaySource(path)
    got = [ev async for ev in source.follow(None)]
    assert [ev.to_dict() for ev in got] == [orjson.loads(EVENTS[0]), orjson.loads(EVENTS[1])]
    [note] = source.take_notes()
    assert note.severity == "warning" and "dispatch event: done: Input should be a valid integer" in note.text
    assert note.text.endswith("(line skipped)")
