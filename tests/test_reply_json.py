"""A /generate reply read with its output_ids straight into int32 (engine.run.reply_json): orjson's result for every
reply, the ids exact, and orjson's own error or value wherever the short path does not apply."""
from __future__ import annotations

import json
import random
from array import array

import orjson
import pytest

from engine.run import reply_json
from engine.run.reply_json import MIN_IDS_BYTES, int32_ids

LONG = [151_643, 0, 7, 2**31 - 1, 10, 0, 99] + [random.Random(1).randrange(200_000) for _ in range(2000)]


def reply(ids, **extra) -> dict:
    return {"text": "an answer", "output_ids": ids, **extra,
            "meta_info": {"id": "r", "finish_reason": {"type": "stop", "matched": 151_643}, "completion_tokens": len(ids)}}


def same_as_orjson(payload: bytes):
    """reply_json.loads(payload) is orjson.loads(payload) with a top-level output_ids list as array("i")."""
    expected = orjson.loads(payload)
    got = reply_json.loads(payload)
    if isinstance(got, dict) and type(got.get("output_ids")) is array:
        assert got["output_ids"].typecode == "i"
        got = {**got, "output_ids": got["output_ids"].tolist()}
    assert got == expected
    return reply_json.loads(payload)


def test_long_top_level_ids_come_as_int32_arrays_equal_to_orjsons_lists():
    rng = random.Random(7)
    for n in (600, 2000, 9000):
        ids = [rng.choice((0, 1, 9, 10, 2**31 - 1, rng.randrange(300_000))) for _ in range(n)]
        for data in (reply(ids), {"output_ids": ids}, {"meta_info": {}, "text": "x", "output_ids": ids},
                     reply(ids, text='a "output_ids":[1,2] and \\"output_ids\\":[3] in the text')):
            out = same_as_orjson(orjson.dumps(data))
            assert type(out["output_ids"]) is array and out["output_ids"].tolist() == ids


def test_short_lists_and_other_layouts_take_orjsons_path():
    short = [5] * ((MIN_IDS_BYTES // 2) - 10)
    for payload in (orjson.dumps(reply(short)), orjson.dumps(reply([])),
                    json.dumps(reply(LONG)).encode(),  # spaces after the separators: not orjson's layout
                    orjson.dumps([reply(LONG)]),  # a batch: the list is not at the top level
                    orjson.dumps({"meta_info": {"output_ids": LONG}, "output_ids": None}),
                    orjson.dumps({"nested": {"output_ids": LONG}})):
        out = same_as_orjson(payload)
        assert not (isinstance(out, dict) and type(out.get("output_ids")) is array)


def test_values_outside_the_short_paths_grammar_get_orjsons_value_or_error():
    body = orjson.dumps(reply(LONG))
    ids = orjson.dumps(LONG)[1:-1]
    # negative and non-int32 ids are orjson's ints (int32_array refuses them later, as before); floats, too
    for bad in (b"-1," + ids, ids + b",2147483648", ids + b",99999999999999999999", ids + b",1.5", ids + b",1e3"):
        out = same_as_orjson(body.replace(ids, bad))
        assert type(out["output_ids"]) is list
    # not JSON: orjson's error, with its message about the reply as it came
    for bad in (ids + b",", b"," + ids, ids.replace(b",", b",,", 1), ids + b",01", b"00," + ids, ids + b",+1"):
        payload = body.replace(ids, bad)
        with pytest.raises(orjson.JSONDecodeError) as expected:
            orjson.loads(payload)
        with pytest.raises(orjson.JSONDecodeError) as got:
            reply_json.loads(payload)
        assert str(got.value) == str(expected.value)


def test_a_repeated_key_keeps_the_last_as_orjson_does():
    first, last = LONG[:700], LONG[700:]
    for payload in (b'{"output_ids":' + orjson.dumps(first) + b',"output_ids":' + orjson.dumps(last) + b"}",
                    b'{"output_ids":' + orjson.dumps(first) + b',"output\\u005fids":' + orjson.dumps(last) + b"}",
                    b'{"output\\u005fids":' + orjson.dumps(first) + b',"output_ids":' + orjson.dumps(last) + b"}"):
        assert list(same_as_orjson(payload)["output_ids"]) == last


def test_int32_ids_reads_json_integers_only():
    assert int32_ids(b"0") == array("i", [0])
    assert int32_ids(b"12,0,345,2147483647") == array("i", [12, 0, 345, 2**31 - 1])
    for bad in (b"", b",", b"1,", b",1", b"1,,2", b"01", b"1,00", b"1, 2", b"-1", b"2147483648", b"1a", b"1.0",
                b"4294967297", b"18446744073709551615", b"18446744073709551617", b"1," + b"9" * 40):
        assert int32_ids(bad) is None, bad
