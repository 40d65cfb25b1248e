"""Shard store: real Parquet parts read back with pyarrow, real sqlite, real crashes (SIGKILL, os._exit)."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from engine.store.shard_schema import SHARD_SCHEMA
from engine.store.names import shard_id_for
from engine.store.part_writer import DuplicateSample, PartWriter
from engine.store.shard_store import ShardStore
from engine.store.state_db import StoreBusy, StoreError

REPO = Path(__file__).resolve().parents[1]
EMPTY_TEXT = "<think>\n\n</think>\n\nOK.<|im_end|>"


def make_row(conv: str, turn: int = 0, prompt_len: int = 5, output_len: int = 4, *, text: str | None = None,
             finish_reason: str = "stop") -> dict:
    return {
        "sample_id": f"{conv}#turn{turn}", "conversation_id": conv, "turn": turn, "source": "p.jsonl",
        "origin": f"p.jsonl:{turn + 1}",
        "input_ids": list(range(100, 100 + prompt_len + output_len)),
        "loss_mask": [0] * prompt_len + [1] * output_len,
        "prompt_len": prompt_len, "output_len": output_len, "reasoning_tokens": 1, "prompt_opened": False,
        "finish_reason": finish_reason,
        "completion_tokens": output_len, "cached_tokens": 2, "latency_s": 0.5, "worker": "gpu0",
        "text": text if text is not None else "<think>\nhmm, let me see\n</think>\n\nThe answer is four, clearly.",
    }


@pytest.fixture
def store(tmp_path):
    s = ShardStore(tmp_path)
    s.ensure_shards({"s00000": 10, "s00001": 10})
    yield s
    s.close()


def part_files(run_dir: Path) -> list[str]:
    return sorted(p.relative_to(run_dir).as_posix() for p in (run_dir / "shards").rglob("*") if p.is_file())


def test_shard_id_for():
    assert shard_id_for(0, 1000) == "s00000"
    assert shard_id_for(999, 1000) == "s00000"
    assert shard_id_for(1000, 1000) == "s00001"
    assert shard_id_for(123456, 100) == "s01234"


def test_commit_writes_a_zstd_part_with_the_shard_schema(store, tmp_path):
    rows = [make_row("a"), make_row("b", prompt_len=3, output_len=7)]
    info = store.commit("s00000", rows, {"a#turn0": "answer a"})
    assert (info.shard_id, info.path, info.rows, info.seq) == ("s00000", "shards/s00000/part-000000.parquet", 2, 0)
    assert part_files(tmp_path) == ["shards/s00000/part-000000.parquet"]
    table = pq.read_table(tmp_path / info.path)
    assert table.schema.equals(SHARD_SCHEMA)
    assert table.to_pylist() == rows
    meta = pq.ParquetFile(tmp_path / info.path).metadata
    assert meta.row_group(0).column(0).compression == "ZSTD"
    # token ids and masks are written PLAIN (no dictionary: hashing every value was ~40% of the write)
    columns = {meta.row_group(0).column(i).path_in_schema: meta.row_group(0).column(i) for i in range(meta.num_columns)}
    assert not columns["input_ids.list.element"].has_dictionary_page
    assert not columns["loss_mask.list.element"].has_dictionary_page
    assert columns["sample_id"].has_dictionary_page and columns["text"].has_dictionary_page
    # min/max statistics for the scalar and id columns, none over the token ids, masks and text
    assert not any(columns[c].is_stats_set for c in ("input_ids.list.element", "loss_mask.list.element", "text"))
    assert columns["sample_id"].statistics.min == "a#turn0" and columns["output_len"].statistics.max == 7
    assert info.bytes == (tmp_path / info.path).stat().st_size
    assert store.is_committed("a#turn0") and store.is_committed("b#turn0") and not store.is_committed("c#turn0")
    assert committed_count(store) == 2
    assert store.history("a") == {0: "answer a"}
    assert store.history("b") == {}
    assert store.parts() == [info]
    assert committed_sample_ids(store) == {"a#turn0", "b#turn0"}


def test_sqlite_is_wal_and_tables_are_readable_by_others(store, tmp_path):
    store.commit("s00000", [make_row("a")])
    db = sqlite3.connect(f"file:{tmp_path / 'state.sqlite'}?mode=ro", uri=True)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("SELECT sample_id, shard_id, part_path, conversation_id, turn, output_len, finish_reason,"
                      " empty, answer FROM samples").fetchall() == [
        ("a#turn0", "s00000", "shards/s00000/part-000000.parquet", "a", 0, 4, "stop", 0, None)]
    assert db.execute("SELECT path, shard_id, rows FROM parts").fetchall() == [
        ("shards/s00000/part-000000.parquet", "s00000", 1)]
    assert db.execute("SELECT shard_id, total, paused FROM shards ORDER BY shard_id").fetchall() == [
        ("s00000", 10, 0), ("s00001", 10, 0)]
    db.close()


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(loss_mask=r["loss_mask"][:-1]), "len(input_ids)=9 != len(loss_mask)=8"),
    (lambda r: r.update(output_len=3), "prompt_len 5 + output_len 3 != len(input_ids) 9"),
    (lambda r: r.update(loss_mask=[0] * 6 + [1] * 3), "sum(loss_mask)=3 != output_len=4"),
    (lambda r: r.update(loss_mask=[0, 0, 0, 0, 1, 0, 1, 1, 1]), "loss_mask[4]=1: must be 0 on the prompt (first 5 tokens)"),
    (lambda r: r.pop("worker"), "missing field(s) worker"),
    (lambda r: r.update(turn="one"), "field turn is not int32"),
    (lambda r: r.update(finish_reason=None), "field finish_reason is null"),
])
def test_invalid_rows_are_refused_naming_the_sample(store, tmp_path, change, message):
    bad = make_row("bad")
    change(bad)
    with pytest.raises(ValueError) as exc:
        store.commit("s00000", [make_row("good"), bad])
    assert "'bad#turn0'" in str(exc.value) and message in str(exc.value)
    assert part_files(tmp_path) == [] and committed_count(store) == 0


def test_duplicate_sample_is_refused_before_writing(store, tmp_path):
    store.commit("s00000", [make_row("a"), make_row("b")])
    with pytest.raises(DuplicateSample) as exc:
        store.commit("s00001", [make_row("c"), make_row("b")])
    assert str(exc.value) == "sample(s) already committed: b#turn0 (in shards/s00000/part-000000.parquet)"
    assert exc.value.sample_ids == ["b#turn0"]
    with pytest.raises(DuplicateSample) as exc:
        store.commit("s00001", [make_row("d"), make_row("d")])
    assert "repeated in one commit: d#turn0" in str(exc.value)
    assert part_files(tmp_path) == ["shards/s00000/part-000000.parquet"]
    assert not store.is_committed("c#turn0") and committed_count(store) == 2


def test_unknown_shard_and_empty_commit_are_refused(store):
    with pytest.raises(ValueError, match="unknown shard s00099"):
        store.commit("s00099", [make_row("a")])
    with pytest.raises(ValueError, match="no rows"):
        store.commit("s00000", [])


def test_failed_sqlite_step_leaves_nothing_and_seq_is_not_reused(store, tmp_path, monkeypatch):
    def disk_full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    with monkeypatch.context() as m:
        m.setattr(PartWriter, "_record", disk_full)
        with pytest.raises(StoreError) as exc:
            store.commit("s00000", [make_row("a")])
    assert isinstance(exc.value, OSError)  # callers that keep rows and retry on I/O errors catch it
    assert str(exc.value) == (f"commit of shards/s00000/part-000000.parquet (1 samples) failed in "
                              f"{tmp_path / 'state.sqlite'}: database or disk is full; nothing was committed")
    assert part_files(tmp_path) == [] and not store.is_committed("a#turn0") and store.parts() == []
    info = store.commit("s00000", [make_row("a")])
    assert info.path == "shards/s00000/part-000001.parquet"


CRASH_SCRIPT = """
import os, sys
sys.path.insert(0, {repo!r})
from engine.store.part_writer import PartWriter
from engine.store.shard_store import ShardStore
from tests.test_shard_store import make_row
step = sys.argv[1]
store = ShardStore({run_dir!r})
store.ensure_shards({{"s00000": 10}})
store.commit("s00000", [make_row("kept")])
setattr(PartWriter, step, lambda *a, **k: os._exit(17))   # a hard crash at exactly that step
store.commit("s00000", [make_row("lost")])
"""


@pytest.mark.parametrize("step, left_behind", [
    ("_record", "shards/s00000/part-000001.parquet"),      # renamed, never committed in sqlite
    ("_publish", "shards/s00000/part-000001.parquet.tmp"),  # written and fsync'd, never renamed
])
def test_crash_before_the_sqlite_txn_leaves_an_orphan_that_recover_removes(tmp_path, step, left_behind):
    script = CRASH_SCRIPT.format(repo=str(REPO), run_dir=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script, step], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 17, proc.stderr
    assert part_files(tmp_path) == ["shards/s00000/part-000000.parquet", left_behind]

    store = ShardStore(tmp_path)
    # before recover, a new commit still never reuses the orphan's number
    assert store.state.take_seq("s00000") == 2
    store.state.next_seq.clear()
    assert store.recover() == [left_behind]
    assert part_files(tmp_path) == ["shards/s00000/part-000000.parquet"]
    assert store.is_committed("kept#turn0") and not store.is_committed("lost#turn0")
    assert committed_count(store) == 1
    info = store.commit("s00000", [make_row("lost")])
    assert info.seq == 2  # recover() remembered the removed orphan's number: never reused
    assert pq.read_table(tmp_path / info.path).column("sample_id").to_pylist() == ["lost#turn0"]
    assert store.recover() == []
    store.close()


LOOP_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
from engine.store.shard_store import ShardStore
from tests.test_shard_store import make_row
store = ShardStore({run_dir!r})
store.ensure_shards({{"s00000": 10**6, "s00001": 10**6}})
n = 0
while True:
    shard = "s0000%d" % (n % 2)
    rows = [make_row("c%d" % (n * 5 + i), prompt_len=50, output_len=200 + i,
                     text="<think>\\n\\n</think>\\n\\nOK.<|im_end|>" if i == 0 else "<think>\\nx y z\\n</think>\\n\\nAn answer here.",
                     finish_reason="length" if i == 1 else "stop") for i in range(5)]
    info = store.commit(shard, rows, {{r["sample_id"]: "ans" for r in rows}})
    print(info.path, flush=True)
    n += 1
"""


def test_sigkilled_writer_then_reopen_every_committed_sample_once(tmp_path):
    script = LOOP_SCRIPT.format(repo=str(REPO), run_dir=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reported = []
    try:
        while len(reported) < 12:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            reported.append(line.strip())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL

    store = ShardStore(tmp_path)  # the dead writer's lock is gone with it
    removed = store.recover()
    assert all(r.endswith((".tmp", ".parquet")) for r in removed)
    parts = store.parts()
    assert set(reported) <= {p.path for p in parts}  # everything the writer saw committed is committed
    assert part_files(tmp_path) == sorted(p.path for p in parts)  # and nothing else is on disk
    seen: list[str] = []
    for p in parts:
        table = pq.read_table(tmp_path / p.path)
        assert table.num_rows == p.rows == 5
        seen += table.column("sample_id").to_pylist()
    assert len(seen) == len(set(seen))  # each sample in exactly one part
    assert set(seen) == committed_sample_ids(store)
    assert committed_count(store) == len(seen) == 5 * len(parts)
    progress = {p.shard_id: p for p in store.progress()}
    for shard_id, prog in progress.items():
        n_parts = sum(1 for p in parts if p.shard_id == shard_id)
        assert (prog.parts, prog.done_samples, prog.empty, prog.truncated) == (n_parts, 5 * n_parts, n_parts, n_parts)
        assert prog.output_tokens == n_parts * sum(200 + i for i in range(5))
    assert sums_from_samples(store) == sums_kept(store)
    # writing resumes where it stopped
    info = store.commit("s00000", [make_row("after-crash")])
    assert info.seq > max(p.seq for p in parts if p.shard_id == "s00000")
    store.close()


def test_pause_is_persisted_across_reopen(tmp_path):
    s = ShardStore(tmp_path)
    s.ensure_shards({"s00000": 1, "s00001": 1, "s00002": 1})
    assert s.set_paused(["s00001"], True) == ["s00001"]
    with pytest.raises(KeyError, match="unknown shard.*s00009"):
        s.set_paused(["s00009"], True)
    s.close()
    s = ShardStore(tmp_path)
    assert s.paused() == {"s00001"}
    assert s.set_paused(None, True) == ["s00000", "s00001", "s00002"]
    assert s.paused() == {"s00000", "s00001", "s00002"}
    s.set_paused(["s00000", "s00002"], False)
    s.close()
    s = ShardStore(tmp_path)
    assert s.paused() == {"s00001"}
    assert [p.paused for p in s.progress()] == [False, True, False]
    s.close()


def test_progress_counts(store):
    store.ensure_shards({"s00000": 10}, sample_totals={"s00000": 14})
    store.commit("s00000", [make_row("a", output_len=4), make_row("b", output_len=6, text=EMPTY_TEXT)])
    store.commit("s00000", [make_row("c", output_len=9, finish_reason="length", text="<think>\nnever ends")])
    store.commit("s00001", [make_row("d", turn=1, output_len=2, text="OK.<|im_end|>")])
    progress = {p.shard_id: p for p in store.progress()}
    p0, p1 = progress["s00000"], progress["s00001"]
    assert (p0.total_conversations, p0.total_samples, p0.done_samples, p0.output_tokens, p0.empty, p0.truncated,
            p0.parts, p0.paused) == (10, 14, 3, 19, 1, 1, 2, False)
    assert (p1.total_conversations, p1.total_samples, p1.done_samples, p1.output_tokens, p1.empty, p1.parts) == (
        10, None, 1, 2, 1, 1)
    assert sums_from_samples(store) == sums_kept(store)


def test_meta_roundtrip(store, tmp_path):
    assert store.get_meta("x") is None
    store.set_meta("x", "1")
    store.set_meta("x", "2")
    store.close()
    with ShardStore(tmp_path) as again:
        assert again.get_meta("x") == "2"


def test_a_second_writer_is_refused(store, tmp_path):
    store.commit("s00000", [make_row("a")])
    other = ShardStore(tmp_path)  # reading is fine
    assert other.is_committed("a#turn0")
    with pytest.raises(StoreBusy) as exc:
        other.commit("s00000", [make_row("b")])
    assert f"pid {os.getpid()}" in str(exc.value)
    other.close()


def test_committed_part_missing_on_disk_is_uncommitted_by_recover(store, tmp_path):
    keep = store.commit("s00000", [make_row("a")])
    gone = store.commit("s00000", [make_row("b"), make_row("c")])
    (tmp_path / gone.path).unlink()
    removed = store.recover()
    assert removed == [f"{gone.path} (committed part missing on disk: 2 samples un-committed, to be regenerated)"]
    assert store.parts() == [keep]
    assert not store.is_committed("b#turn0") and committed_count(store) == 1
    assert store.progress()[0].parts == 1 and store.progress()[0].done_samples == 1
    assert store.commit("s00000", [make_row("b")]).seq == 2


# --- the committer's compact rows (compact_row) and the fast paths of build_table ----------------

def _tables_equal_with_and_without(rows_factory):
    from engine.store.part_table import build_table, compact_row

    plain = build_table(rows_factory())
    compact = build_table([compact_row(r) for r in rows_factory()])
    assert compact.equals(plain)
    return plain


def test_compacted_rows_give_the_same_table():
    from array import array

    from engine.store.part_table import compact_row, STANDARD_MASK

    table = _tables_equal_with_and_without(lambda: [make_row("a"), make_row("b", prompt_len=0, output_len=3),
                                                    make_row("c", prompt_len=4, output_len=0)])
    assert table.column("loss_mask").to_pylist() == [[0] * 5 + [1] * 4, [1] * 3, [0] * 4]
    row = compact_row(make_row("d"))
    assert type(row["input_ids"]) is array and row["loss_mask"] is STANDARD_MASK
    odd = compact_row(make_row("e") | {"loss_mask": [0, 1] * 4 + [1]})
    assert type(odd["loss_mask"]) is list  # not the standard shape: kept, build_table judges it


@pytest.mark.parametrize("change, message", [
    (lambda r: r.update(loss_mask=r["loss_mask"][:-1]), "len(input_ids)=9 != len(loss_mask)=8"),
    (lambda r: r.update(output_len=3), "prompt_len 5 + output_len 3 != len(input_ids) 9"),
    (lambda r: r.update(input_ids=r["input_ids"][:-1]), "len(input_ids)=8 != len(loss_mask)=9"),
    (lambda r: r.update(loss_mask=[0] * 6 + [1] * 3), "sum(loss_mask)=3 != output_len=4"),
    (lambda r: r.update(loss_mask=[0, 0, 0, 0, 1, 0, 1, 1, 1]), "loss_mask[4]=1: must be 0 on the prompt (first 5 tokens)"),
    (lambda r: r.update(input_ids=[1, 2, 3, 4, 5, 6, 7, 8, 2**40]), "field input_ids is not list<item: int32>"),
    (lambda r: r.update(turn="one"), "field turn is not int32"),
])
def test_compacted_rows_are_refused_with_the_same_messages(store, change, message):
    from engine.store.part_table import compact_row

    for compact in (False, True):
        bad = make_row("bad")
        change(bad)
        rows = [make_row("good"), bad]
        if compact:
            rows = [compact_row(r) for r in rows]
        with pytest.raises(ValueError) as exc:
            store.commit("s00000", rows)
        assert "'bad#turn0'" in str(exc.value) and message in str(exc.value), (compact, str(exc.value))


def committed_count(store: ShardStore) -> int:
    return sum(p.done_samples for p in store.progress())


def committed_sample_ids(store: ShardStore) -> set[str]:
    with sqlite3.connect(store.db_path) as db:
        return {r[0] for r in db.execute("SELECT sample_id FROM samples")}


def sums_kept(store: ShardStore) -> dict[str, tuple]:
    return {p.shard_id: (p.done_samples, p.output_tokens, p.empty, p.truncated, p.parts) for p in store.progress()}


def sums_from_samples(store: ShardStore) -> dict[str, tuple]:
    """The counters kept in the commit transaction, recomputed from the samples and parts tables (a full scan)."""
    with sqlite3.connect(store.db_path) as db:
        return {sid: db.execute(
            "SELECT count(*), coalesce(sum(output_len),0), coalesce(sum(empty),0),"
            " coalesce(sum(finish_reason='length'),0), (SELECT count(*) FROM parts WHERE shard_id=?)"
            " FROM samples WHERE shard_id=?", (sid, sid)).fetchone()
            for sid in sums_kept(store)}


def test_a_commit_returns_its_sums_and_outcomes_settle_samples_without_rows(store):
    store.ensure_shards({"s00000": 4}, {"s00000": 4})
    info = store.commit("s00000", [make_row("a", output_len=9, finish_reason="length", text="<think>\nnever ends"),
                                   make_row("b", output_len=2, text="OK.<|im_end|>")])
    assert (info.rows, info.output_tokens, info.empty, info.truncated) == (2, 11, 1, 1)
    store.settle("s00000", "c#turn0", "rejected", "context_overflow")
    store.settle("s00000", "d#turn0", "failed", "generation_failed")
    p = {p.shard_id: p for p in store.progress()}["s00000"]
    assert (p.done_samples, p.rejected, p.failed) == (2, 1, 1)
    assert store.is_settled("a#turn0") and store.is_settled("c#turn0") and not store.is_settled("e#turn0")
    assert store.forget_failed() == 1  # a new start generates the failed one again; a rejected one stays settled
    p = {p.shard_id: p for p in store.progress()}["s00000"]
    assert (p.rejected, p.failed) == (1, 0) and not store.is_settled("d#turn0")
    with pytest.raises(ValueError, match="'rejected' or 'failed'"):
        store.settle("s00000", "e#turn0", "committed", "")
