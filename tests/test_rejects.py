"""Reject log: one fsync'd JSON line per bad row, de-duplicated across restarts."""
from __future__ import annotations

import json

import pytest

from engine.text.row_errors import Reject
from engine.store.rejects import RejectLog, RejectLogError


def rej(line, reason="malformed JSON: Expecting value: line 1 column 1 (char 0)", kind="malformed_json"):
    return Reject("/data/p.jsonl", line, None, reason, "{bad", None, kind)


def test_rejects_are_appended_once_across_restarts(tmp_path):
    with RejectLog(tmp_path) as log:
        assert log.add(rej(3)) is True
        assert log.add(rej(3)) is False
        assert log.add(rej(4, "unknown role 'tool' in messages[1]", "unknown_role")) is True
        assert log.count == 2
    with RejectLog(tmp_path) as log:  # a restart re-ingests the same rows
        assert log.add(rej(3)) is False
        assert log.add_many([rej(4, "unknown role 'tool' in messages[1]", "unknown_role"), rej(9)]) == 1
        assert log.count == 3
        assert log.counts_by_reason() == {"malformed_json": 2, "unknown_role": 1}
    lines = [json.loads(x) for x in (tmp_path / "rejects.jsonl").read_text().splitlines()]
    assert [(d["file"], d["line"], d["row"], d["kind"]) for d in lines] == [
        ("/data/p.jsonl", 3, None, "malformed_json"), ("/data/p.jsonl", 4, None, "unknown_role"),
        ("/data/p.jsonl", 9, None, "malformed_json")]
    assert set(lines[0]) == {"file", "line", "row", "reason", "kind", "excerpt", "conversation_id", "ts"}


def test_torn_last_line_is_cut_and_the_reject_logged_again(tmp_path):
    with RejectLog(tmp_path) as log:
        log.add(rej(1))
    with open(tmp_path / "rejects.jsonl", "ab") as f:
        f.write(b'{"file": "/data/p.jsonl", "line": 2, "ro')  # crash mid-write
    with RejectLog(tmp_path) as log:
        assert log.count == 1
        assert log.add(rej(2)) is True
    assert len((tmp_path / "rejects.jsonl").read_text().splitlines()) == 2


def test_corrupted_middle_line_is_an_error_naming_the_line(tmp_path):
    (tmp_path / "rejects.jsonl").write_text('garbage\n{"file": "f", "line": 1, "row": null, "reason": "r"}\n')
    with pytest.raises(RejectLogError, match="line 1 is not a reject record"):
        RejectLog(tmp_path)
