"""Ingest: every format and shape from real files, every reject reason with file/line/row."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.text.ingest import Conversation, iter_prompts, resolve_prompt_files
from engine.text.row_errors import PromptFileError, Reject


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "wb") as f:
        for r in rows:
            f.write((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n")
    return path


def run(patterns, fmt="auto"):
    items = list(iter_prompts([str(p) for p in patterns], fmt))
    return [i for i in items if isinstance(i, Conversation)], [i for i in items if isinstance(i, Reject)]


def one_reject(path: Path, row) -> Reject:
    convs, rejects = run([write_jsonl(path, [{"prompt": "a good row first"}, row])])
    assert len(convs) == 1 and len(rejects) == 1, rejects
    assert (rejects[0].file, rejects[0].line, rejects[0].row) == (str(path), 2, None)
    return rejects[0]


# --- shapes ----------------------------------------------------------------------------------


def test_openai_messages_shape(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"id": "a1", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
    ]}])
    (conv,), rejects = run([f])
    assert rejects == []
    assert conv.conversation_id == "a1"
    assert conv.origin == "p.jsonl:1" and conv.line == 1 and conv.row is None
    assert conv.source == str(f) and conv.index == 0
    assert conv.messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "part one\npart two"},
    )


def test_openai_conversations_key_and_sharegpt_roles(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"conversation_id": 7, "conversations": [{"role": "user", "content": "q"}]},
        {"uuid": "u-1", "conversations": [
            {"from": "system", "value": "sys"}, {"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
            {"from": "user", "value": "q2"}, {"from": "bot", "value": "a2"}, {"from": "human", "value": "q3"},
            {"from": "model", "value": "a3"}, {"from": "assistant", "value": "a4"}]},
    ])
    convs, rejects = run([f])
    assert rejects == []
    assert [c.conversation_id for c in convs] == ["7", "u-1"]
    assert [m["role"] for m in convs[1].messages] == [
        "system", "user", "assistant", "user", "assistant", "user", "assistant", "assistant"]
    assert convs[1].messages[1] == {"role": "user", "content": "q1"}


def test_plain_prompt_and_instruction_rows(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "What is 2+2?"},
        {"sample_id": 42, "prompt": "Hi", "system": "You are terse."},
        {"instruction": "Translate", "input": "bonjour", "output": "old answer, ignored"},
        {"instruction": "Just this", "input": ""},
        {"prompt": "from elsewhere", "source": "gsm8k"},
    ])
    convs, rejects = run([f])
    assert rejects == []
    assert [c.conversation_id for c in convs] == ["p.jsonl:1", "42", "p.jsonl:3", "p.jsonl:4", "p.jsonl:5"]
    assert convs[0].messages == ({"role": "user", "content": "What is 2+2?"},)
    assert convs[1].messages == ({"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"})
    assert convs[2].messages == ({"role": "user", "content": "Translate\n\nbonjour"},)
    assert convs[3].messages == ({"role": "user", "content": "Just this"},)
    assert convs[4].source == "gsm8k"
    assert [c.index for c in convs] == [0, 1, 2, 3, 4]


# --- formats ---------------------------------------------------------------------------------

ROWS = [
    {"id": "r0", "messages": [{"role": "user", "content": 'tricky "quotes", [brackets] and {braces}'}]},
    {"conversations": [{"from": "human", "value": "back\\slash \\\" and unicode é ✓"}]},
    {"prompt": "third"},
]


def test_json_array_streamed_with_rows(tmp_path):
    f = tmp_path / "data.json"
    f.write_text(json.dumps(ROWS, indent=2, ensure_ascii=False))
    convs, rejects = run([f])
    assert rejects == []
    assert [c.origin for c in convs] == ["data.json:row0", "data.json:row1", "data.json:row2"]
    assert [c.row for c in convs] == [0, 1, 2]
    assert convs[0].messages[0]["content"] == 'tricky "quotes", [brackets] and {braces}'
    assert convs[1].messages[0]["content"] == "back\\slash \\\" and unicode é ✓"
    assert convs[1].conversation_id == "data.json:row1"


def test_json_array_elements_split_across_read_chunks(tmp_path):
    """The structural scan must find element boundaries that fall across buffer refills."""
    from engine.text import prompt_readers

    rows = [{"id": f"x{i}", "prompt": "p" * (i % 7) + ' "q" [a] {b}, \\' + "é" * i} for i in range(200)]
    f = tmp_path / "big.json"
    f.write_text(json.dumps(rows, ensure_ascii=False))
    items = list(prompt_readers.json_array_rows(f, chunk_size=7))
    assert [i[2]["id"] for i in items] == [r["id"] for r in rows]
    assert [i[2] for i in items] == rows


def test_json_array_malformed_element_is_one_reject_and_scan_resyncs(tmp_path):
    f = tmp_path / "a.json"
    f.write_text('[{"prompt": "ok0"},\n {"prompt": "bad" "x"},\n {"prompt": "ok2"}, 5, [1, 2]\n]\n')
    convs, rejects = run([f])
    assert [c.origin for c in convs] == ["a.json:row0", "a.json:row2"]
    assert [(r.row, r.kind) for r in rejects] == [(1, "malformed_json"), (3, "not_object"), (4, "not_object")]
    assert rejects[0].file == str(f) and rejects[0].line is None
    assert rejects[0].reason.startswith("malformed JSON: Expecting ',' delimiter")
    assert rejects[0].excerpt == '{"prompt": "bad" "x"}'


def test_json_array_truncated_file_and_not_an_array(tmp_path):
    f = tmp_path / "t.json"
    f.write_text('[{"prompt": "ok"}, {"prompt": "cut')
    convs, rejects = run([f])
    assert len(convs) == 1
    assert [(r.row, r.kind) for r in rejects] == [(1, "malformed_json")]
    g = tmp_path / "o.json"
    g.write_text('"just a string"')
    convs, rejects = run([g])
    assert convs == [] and rejects[0].reason.startswith("not a JSON array")


def test_json_file_with_one_object_per_line_is_read_as_jsonl(tmp_path):
    f = write_jsonl(tmp_path / "lines.json", [{"prompt": "a"}, {"prompt": "b"}])
    convs, _ = run([f])
    assert [c.origin for c in convs] == ["lines.json:1", "lines.json:2"]


def test_parquet_rows(tmp_path):
    f = tmp_path / "p.parquet"
    table = pa.table({
        "id": ["a", "b", None],
        "messages": [
            [{"role": "user", "content": "one"}],
            [{"role": "user", "content": "two"}, {"role": "assistant", "content": "2"}],
            [{"role": "tool", "content": "x"}],
        ],
    })
    pq.write_table(table, f, row_group_size=2)
    convs, rejects = run([f])
    assert [(c.conversation_id, c.origin) for c in convs] == [("a", "p.parquet:row0"), ("b", "p.parquet:row1")]
    assert convs[1].messages[1] == {"role": "assistant", "content": "2"}
    assert [(r.file, r.row, r.kind) for r in rejects] == [(str(f), 2, "unknown_role")]


def test_parquet_sharegpt_and_prompt_columns(tmp_path):
    f = tmp_path / "s.parquet"
    pq.write_table(pa.table({"conversations": [[{"from": "human", "value": "hey"}]], "prompt": [None]}), f)
    (conv,), rejects = run([f])
    assert rejects == [] and conv.messages == ({"role": "user", "content": "hey"},)


def test_gzip_jsonl(tmp_path):
    f = tmp_path / "p.jsonl.gz"
    with gzip.open(f, "wb") as g:
        g.write(b'{"prompt": "zipped"}\n')
    (conv,), _ = run([f])
    assert conv.messages[0]["content"] == "zipped" and conv.origin == "p.jsonl.gz:1"


# --- files and globs -------------------------------------------------------------------------


def test_globs_and_several_files_sorted_with_stable_index(tmp_path):
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "b.jsonl", [{"prompt": "b1"}, {"prompt": "b2"}])
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"prompt": "a1"}])
    (tmp_path / "d" / "c.json").write_text(json.dumps([{"prompt": "c1"}]))
    pq.write_table(pa.table({"prompt": ["z1"]}), tmp_path / "z.parquet")
    patterns = [str(tmp_path / "z.parquet"), str(tmp_path / "d" / "*.json*"), str(tmp_path / "d" / "a.jsonl")]
    files = resolve_prompt_files(patterns)
    assert [p.name for p in files] == ["a.jsonl", "b.jsonl", "c.json", "z.parquet"]  # sorted, de-duplicated
    convs, _ = run(patterns)
    assert [(c.index, c.messages[0]["content"]) for c in convs] == [(0, "a1"), (1, "b1"), (2, "b2"), (3, "c1"), (4, "z1")]
    again, _ = run(patterns)
    assert again == convs


def test_recursive_glob(tmp_path):
    (tmp_path / "x" / "y").mkdir(parents=True)
    write_jsonl(tmp_path / "x" / "y" / "deep.jsonl", [{"prompt": "d"}])
    assert [p.name for p in resolve_prompt_files([str(tmp_path / "**" / "*.jsonl")])] == ["deep.jsonl"]


def test_same_file_name_in_two_dirs_keeps_fallback_ids_distinct(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        write_jsonl(tmp_path / d / "train.jsonl", [{"prompt": d}])
    convs, rejects = run([tmp_path / "*" / "train.jsonl"])
    assert rejects == []
    assert [c.conversation_id for c in convs] == ["a/train.jsonl:1", "b/train.jsonl:1"]


def test_missing_file_names_path_and_os_error(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(PromptFileError) as exc:
        resolve_prompt_files([str(missing)])
    assert exc.value.path == str(missing)
    assert exc.value.os_error == f"[Errno 2] No such file or directory: '{missing}'"
    first, *search = str(exc.value).splitlines()
    assert first == f"prompt file {missing}: [Errno 2] No such file or directory: '{missing}'"
    assert search[0].startswith(f"  looked for nope.jsonl and similar names under {tmp_path}, ")  # where it looked
    assert exc.value.candidates is not None and exc.value.candidates.configured == str(missing)
    with pytest.raises(PromptFileError):  # iter_prompts raises at the first next()
        next(iter_prompts([str(missing)]))


def test_glob_matching_nothing(tmp_path):
    pattern = str(tmp_path / "*.jsonl")
    with pytest.raises(PromptFileError) as exc:
        resolve_prompt_files([pattern])
    assert exc.value.path == pattern
    assert "glob matched no files" in str(exc.value)
    assert "No such file or directory" in str(exc.value) and f"looked in {tmp_path}/" in str(exc.value)
    gone = str(tmp_path / "absent-dir" / "*.jsonl")
    with pytest.raises(PromptFileError) as exc:
        resolve_prompt_files([gone])
    assert exc.value.os_error == f"[Errno 2] No such file or directory: '{tmp_path / 'absent-dir'}'"


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(PromptFileError) as exc:
        resolve_prompt_files([str(tmp_path)])
    assert "Is a directory" in str(exc.value) and "use a glob" in str(exc.value)


# --- rejects ---------------------------------------------------------------------------------


def test_malformed_json_line_with_json_error_text(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, b'{"prompt": "oops",}', b"not json at all"])
    convs, rejects = run([f])
    assert len(convs) == 1
    assert [(r.file, r.line, r.row, r.kind) for r in rejects] == [
        (str(f), 2, None, "malformed_json"), (str(f), 3, None, "malformed_json")]
    assert rejects[0].reason == "malformed JSON: Expecting property name enclosed in double quotes: line 1 column 19 (char 18)"
    assert rejects[0].excerpt == '{"prompt": "oops",}'


def test_blank_lines_are_skipped_and_line_numbers_stay_exact(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, b"", b"   ", b"{"])
    convs, rejects = run([f])
    assert convs[0].line == 1 and rejects[0].line == 4


def test_not_an_object(tmp_path):
    r = one_reject(tmp_path / "p.jsonl", [1, 2])
    assert (r.line, r.kind, r.reason) == (2, "not_object", "not an object (a JSON array)")


def test_unknown_role_is_named(tmp_path):
    r = one_reject(tmp_path / "p.jsonl", {"id": "t", "messages": [
        {"role": "user", "content": "q"}, {"role": "tool", "content": "x"}]})
    assert r.kind == "unknown_role" and "'tool'" in r.reason and "messages[1]" in r.reason
    assert r.conversation_id == "t"


def test_missing_role(tmp_path):
    r = one_reject(tmp_path / "p.jsonl", {"messages": [{"content": "q"}]})
    assert r.kind == "unknown_role" and "has no role" in r.reason


def test_empty_conversation(tmp_path):
    assert one_reject(tmp_path / "a.jsonl", {"messages": []}).kind == "empty_conversation"
    assert one_reject(tmp_path / "b.jsonl", {"prompt": "  "}).kind == "empty_conversation"


def test_no_user_turn(tmp_path):
    r = one_reject(tmp_path / "p.jsonl", {"messages": [{"role": "system", "content": "s"},
                                                       {"role": "assistant", "content": "a"}]})
    assert r.kind == "no_user_turn" and r.reason == "no user turn (roles: system, assistant)"


def test_non_string_content(tmp_path):
    r = one_reject(tmp_path / "a.jsonl", {"messages": [{"role": "user", "content": 5}]})
    assert r.kind == "non_string_content" and "messages[0]" in r.reason and "number" in r.reason
    r = one_reject(tmp_path / "b.jsonl", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.kind == "non_string_content" and "'image_url'" in r.reason
    r = one_reject(tmp_path / "c.jsonl", {"messages": [{"role": "user", "content": None}]})
    assert r.kind == "non_string_content" and "null" in r.reason
    r = one_reject(tmp_path / "d.jsonl", {"prompt": {"text": "x"}})
    assert r.kind == "non_string_content"


def test_no_conversation_fields(tmp_path):
    r = one_reject(tmp_path / "p.jsonl", {"question": "q", "answer": "a"})
    assert r.kind == "no_conversation" and "keys: answer, question" in r.reason


def test_invalid_utf8_is_a_per_line_reject_with_byte_offset(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"}, b'{"prompt": "caf\xe9"}', {"prompt": "after"}])
    convs, rejects = run([f])
    assert [c.line for c in convs] == [1, 3]
    (r,) = rejects
    assert (r.line, r.kind) == (2, "invalid_utf8")
    first_line_len = len(json.dumps({"prompt": "fine"})) + 1
    assert r.reason == (f"invalid UTF-8 at byte 15 of the line (file offset {first_line_len + 15}): "
                        "invalid continuation byte (byte 0xe9)")
    assert r.excerpt == '{"prompt": "caf\ufffd"}'


def test_invalid_utf8_in_json_array_row(tmp_path):
    f = tmp_path / "a.json"
    f.write_bytes(b'[{"prompt": "ok"}, {"prompt": "bad \xff"}, {"prompt": "ok2"}]')
    convs, rejects = run([f])
    assert [c.row for c in convs] == [0, 2]
    assert [(r.row, r.kind) for r in rejects] == [(1, "invalid_utf8")]
    assert rejects[0].reason == "invalid UTF-8 at byte 16 of the row (byte 0xff)"


def test_duplicate_id_names_first_origin(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"id": "dup", "prompt": "first"}, {"id": "other", "prompt": "x"}])
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "y"}, {"id": "dup", "prompt": "second"}])
    convs, rejects = run([tmp_path / "*.jsonl"])
    assert [c.conversation_id for c in convs] == ["dup", "other", "b.jsonl:1"]
    (r,) = rejects
    assert (r.file, r.line, r.kind, r.conversation_id) == (str(tmp_path / "b.jsonl"), 2, "duplicate_id", "dup")
    assert r.reason == "duplicate id 'dup' (first seen at a.jsonl:1)"
    # the index skips rejects: good conversations are numbered densely
    assert [c.index for c in convs] == [0, 1, 2]


def test_duplicate_id_first_seen_in_a_parquet_row(tmp_path):
    pq.write_table(pa.table({"id": ["k"], "prompt": ["p"]}), tmp_path / "a.parquet")
    write_jsonl(tmp_path / "b.jsonl", [{"id": "k", "prompt": "p"}])
    _, (r,) = run([tmp_path / "a.parquet", tmp_path / "b.jsonl"])
    assert r.reason == "duplicate id 'k' (first seen at a.parquet:row0)"


def test_index_is_stable_when_rejects_are_present_across_restarts(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, b"{bad", {"prompt": "b"}, [1], {"prompt": "c"}])
    first = run([f])
    second = run([f])
    assert first == second
    assert [(c.index, c.line) for c in first[0]] == [(0, 1), (1, 3), (2, 5)]


def test_reject_to_dict_and_conversation_reject(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"id": "c", "prompt": "x"}])
    (conv,), _ = run([f])
    r = conv.reject("The input (9 tokens) is longer than the model's context length (8 tokens).", "prompt_too_long")
    assert r.to_dict() == {"file": str(f), "line": 1, "row": None, "reason": r.reason, "kind": "prompt_too_long",
                           "excerpt": '[{"role": "user", "content": "x"}]', "conversation_id": "c"}


def test_excerpt_is_short(tmp_path):
    r = one_reject(tmp_path / "p.jsonl", {"messages": [{"role": "alien", "content": "x" * 5000}]})
    assert len(r.excerpt) <= 201 and r.excerpt.endswith("…")


def test_lone_surrogate_escape_is_rejected_in_both_formats(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [b'{"prompt": "half \\ud800 pair"}', b'{"prompt": "ok \\ud83d\\ude00"}'])
    g = tmp_path / "a.json"
    g.write_text('[{"prompt": "half \\ud800 pair"}, {"prompt": "ok \\ud83d\\ude00"}]')
    for path, where in ((f, "line"), (g, "row")):
        convs, rejects = run([path])
        assert [c.messages[0]["content"] for c in convs] == ["ok \U0001F600"]
        assert [r.kind for r in rejects] == ["invalid_utf8"]
        assert rejects[0].reason.startswith("lone surrogate escape in JSON string")


def test_parquet_string_with_invalid_utf8_is_a_row_reject(tmp_path):
    f = tmp_path / "bad.parquet"
    bad = pa.Array.from_buffers(pa.string(), 3, [None, pa.py_buffer(b"\x00\x00\x00\x00\x02\x00\x00\x00\x05\x00\x00\x00"
                                                                    b"\x07\x00\x00\x00"), pa.py_buffer(b"okno\xffgo")])
    pq.write_table(pa.table({"prompt": bad}), f)
    convs, rejects = run([f])
    assert [c.messages[0]["content"] for c in convs] == ["ok", "go"]
    assert [(r.row, r.kind) for r in rejects] == [(1, "invalid_utf8")]


def test_parquet_reads_only_usable_columns(tmp_path):
    f = tmp_path / "wide.parquet"
    pq.write_table(pa.table({"prompt": ["p"], "old_answer": ["x" * 1000], "uuid": ["u9"]}), f)
    (conv,), _ = run([f])
    assert conv.conversation_id == "u9" and conv.messages == ({"role": "user", "content": "p"},)
    g = tmp_path / "unknown.parquet"
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), g)
    _, (r,) = run([g])
    assert r.kind == "no_conversation" and "keys: answer, question" in r.reason and r.row == 0
