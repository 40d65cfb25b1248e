"""Compaction of a finished shard (ShardStore.compact): the swap, its failures, what recover() does with either side."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from engine.store.committed_view import read_committed

from engine.store.compaction import COMPACT_ROW_GROUP_ROWS, CompactionConflict, Compactor

from engine.store.shard_store import ShardStore

from engine.store.state_db import StoreError
from engine.store.stats import compute_stats
from tests.test_shard_store import make_row, part_files


@pytest.fixture
def store(tmp_path):
    s = ShardStore(tmp_path)
    s.ensure_shards({"s00000": 10, "s00001": 10})
    yield s
    s.close()


def fill(store: ShardStore, shard_id: str, parts: int, rows_per_part: int = 3) -> list[dict]:
    rows = []
    for p in range(parts):
        batch = [make_row(f"{shard_id}-c{p}-{i}", output_len=4 + i) for i in range(rows_per_part)]
        store.commit(shard_id, batch, {r["sample_id"]: f"answer {r['sample_id']}" for r in batch})
        rows += batch
    return rows


def test_compact_swaps_the_parts_for_one_file_in_commit_order(store, tmp_path):
    rows = fill(store, "s00000", 4)
    other = fill(store, "s00001", 2)
    before = {p.shard_id: p for p in store.progress()}
    done = store.compact("s00000")
    assert (done.shard_id, done.path, done.rows, done.parts_removed) == ("s00000", "shards/s00000/shard.parquet", 12, 4)
    # the other shard's parts are untouched; the compacted shard is its one file on disk and in sqlite
    assert part_files(tmp_path) == ["shards/s00000/shard.parquet", "shards/s00001/part-000000.parquet",
                                    "shards/s00001/part-000001.parquet"]
    assert [p.path for p in store.parts("s00000")] == ["shards/s00000/shard.parquet"]
    assert pq.read_table(tmp_path / done.path).to_pylist() == rows
    assert done.bytes == (tmp_path / done.path).stat().st_size
    # the shard's figures are those of its samples (only the number of files moved); history follows the rows
    after = {p.shard_id: p for p in store.progress()}
    assert after["s00000"].parts == 1 and after["s00000"].done_samples == before["s00000"].done_samples == 12
    assert after["s00000"].output_tokens == before["s00000"].output_tokens and after["s00001"] == before["s00001"]
    assert store.history("s00000-c2-1") == {0: "answer s00000-c2-1#turn0"}
    db = sqlite3.connect(tmp_path / "state.sqlite")
    assert db.execute("SELECT DISTINCT part_path FROM samples WHERE shard_id='s00000'").fetchall() == [
        ("shards/s00000/shard.parquet",)]
    # the stats read it as they read parts: every sample once, the recorded counts agree
    s = compute_stats(tmp_path)
    assert s.samples == len(rows) + len(other) and s.integrity_error_count == 0
    assert {g.name: g.parts for g in s.by_shard} == {"s00000": 1, "s00001": 2}
    assert store.compact("s00000") is None  # already one file: nothing to do


def test_compacted_shard_takes_no_more_parts(store, tmp_path):
    fill(store, "s00000", 2)
    store.compact("s00000")
    with pytest.raises(ValueError, match=r"s00000: it is compacted into shards/s00000/shard.parquet and takes no more"):
        store.commit("s00000", [make_row("late")])
    assert not store.is_committed("late#turn0")


def test_compact_of_a_shard_without_rows_does_nothing(store, tmp_path):
    assert store.compact("s00001") is None
    assert part_files(tmp_path) == [] if (tmp_path / "shards").exists() else True


def test_large_shard_is_written_in_row_groups_of_bounded_size(store, tmp_path):
    rows = fill(store, "s00000", 9, rows_per_part=COMPACT_ROW_GROUP_ROWS // 4)
    done = store.compact("s00000")
    meta = pq.ParquetFile(tmp_path / done.path).metadata
    assert meta.num_rows == len(rows)
    assert all(meta.row_group(i).num_rows <= COMPACT_ROW_GROUP_ROWS for i in range(meta.num_row_groups))
    assert meta.num_row_groups == 3  # 1024 + 1024 + 256 rows, not one group per part


def test_parts_changed_during_the_rewrite_swap_nothing(store, tmp_path, monkeypatch):
    fill(store, "s00000", 2)
    real = Compactor._write_compacted

    def racing(self, parts, tmp):
        out = real(self, parts, tmp)
        store.commit("s00000", [make_row("racer")])  # a commit lands between the read and the swap
        return out

    monkeypatch.setattr(Compactor, "_write_compacted", racing)
    with pytest.raises(CompactionConflict, match="parts changed while it was rewritten"):
        store.compact("s00000")
    assert part_files(tmp_path) == [f"shards/s00000/part-00000{i}.parquet" for i in range(3)]
    assert len(store.parts("s00000")) == 3 and store.is_committed("racer#turn0")


def test_a_failed_swap_leaves_the_parts_committed_and_no_shard_file(store, tmp_path, monkeypatch):
    fill(store, "s00000", 3)

    def broken(self, shard_id, parts, info):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(Compactor, "_swap", broken)
    with pytest.raises(StoreError, match=r"compaction of s00000 failed in .*disk I/O error; its parts stay committed"):
        store.compact("s00000")
    assert part_files(tmp_path) == [f"shards/s00000/part-00000{i}.parquet" for i in range(3)]
    assert len(store.parts("s00000")) == 3


def test_an_unreadable_part_stops_the_compaction_naming_it(store, tmp_path):
    fill(store, "s00000", 2)
    (tmp_path / "shards/s00000/part-000001.parquet").unlink()
    with pytest.raises(StoreError, match=r"compaction of s00000: cannot rewrite its parts into "
                                         r"shards/s00000/shard.parquet: .*part-000001.parquet"):
        store.compact("s00000")
    assert part_files(tmp_path) == ["shards/s00000/part-000000.parquet"]  # no tmp, no shard file left


@pytest.mark.parametrize("crash_after", ["rename", "swap"])
def test_recover_removes_whichever_side_is_the_orphan(tmp_path, crash_after):
    """The two states a crash can leave (the step-by-step SIGKILL suite is tests/test_compaction_kill.py):
    shard.parquet renamed but not swapped in -> it is the orphan; swapped in, parts not yet unlinked -> they are."""
    store = ShardStore(tmp_path)
    store.ensure_shards({"s00000": 10})
    rows = fill(store, "s00000", 3)
    parts = store.parts("s00000")
    shard_dir = tmp_path / "shards/s00000"
    n, nbytes = store._compactor._write_compacted(parts, shard_dir / "shard.parquet.tmp")
    store._compactor._publish(shard_dir / "shard.parquet.tmp", shard_dir / "shard.parquet")
    if crash_after == "swap":
        from engine.store.state_db import PartInfo
        store._compactor._swap("s00000", parts, PartInfo("s00000", "shards/s00000/shard.parquet", n, 0.0, 0, nbytes))
    store.close()
    assert len(part_files(tmp_path)) == 4  # both sides on disk
    store = ShardStore(tmp_path)
    removed = store.recover()
    if crash_after == "rename":
        assert removed == ["shards/s00000/shard.parquet"]
        assert part_files(tmp_path) == [p.path for p in parts]
    else:
        assert removed == [p.path for p in parts]
        assert part_files(tmp_path) == ["shards/s00000/shard.parquet"]
    listed = read_committed(tmp_path).parts
    got = [r["sample_id"] for rel, _, _ in listed for r in pq.read_table(tmp_path / rel).to_pylist()]
    assert sorted(got) == sorted(r["sample_id"] for r in rows)
    # and compacting again after a rename-side crash gives the same one file
    if crash_after == "rename":
        assert store.compact("s00000").rows == len(rows)
        assert part_files(tmp_path) == ["shards/s00000/shard.parquet"]
    store.close()


def test_recover_removes_a_half_written_shard_file(tmp_path):
    store = ShardStore(tmp_path)
    store.ensure_shards({"s00000": 10})
    fill(store, "s00000", 2)
    (tmp_path / "shards/s00000/shard.parquet.tmp").write_bytes(b"PAR1 half")
    store.close()
    store = ShardStore(tmp_path)
    assert store.recover() == ["shards/s00000/shard.parquet.tmp"]
    assert store.compact("s00000").parts_removed == 2
    store.close()


def _glob_rows(run_dir: Path, pattern: str) -> list[str]:
    return [r["sample_id"] for f in sorted(run_dir.glob(pattern)) for r in pq.read_table(f).to_pylist()]


def test_the_documented_glob_sees_each_finished_shard_once_at_every_step(store, tmp_path, monkeypatch):
    """shards/*/shard.parquet is the glob the store's docstring calls safe during a run: at every step of a
    compaction it shows the shard whole or not at all, never twice."""
    rows = fill(store, "s00000", 3)
    seen: list[list[str]] = []
    for name in ("_write_compacted", "_publish", "_swap"):
        real = getattr(Compactor, name)

        def spy(self, *args, _real=real):
            seen.append(_glob_rows(tmp_path, "shards/*/shard.parquet"))
            out = _real(self, *args)
            seen.append(_glob_rows(tmp_path, "shards/*/shard.parquet"))
            return out
        monkeypatch.setattr(Compactor, name, spy)
    store.compact("s00000")
    seen.append(_glob_rows(tmp_path, "shards/*/shard.parquet"))
    ids = sorted(r["sample_id"] for r in rows)
    assert all(s == [] or sorted(s) == ids for s in seen), seen
    assert seen[0] == [] and sorted(seen[-1]) == ids


def test_stats_read_beside_a_compaction_count_every_sample_once(store, tmp_path, monkeypatch):
    """`regen stats` lists the committed parts, then reads them: a shard compacted in between makes it list again,
    with no missing-part integrity error and no sample counted twice."""
    import engine.store.stats as stats
    rows = fill(store, "s00000", 3) + fill(store, "s00001", 2)
    real = stats.list_parts
    calls = []

    def list_then_compact(run_dir):
        listing = real(run_dir)
        calls.append(len(listing.parts))
        if len(calls) == 1:
            store.compact("s00000")  # lands between this listing and the reads
        return listing

    monkeypatch.setattr(stats, "list_parts", list_then_compact)
    s = compute_stats(tmp_path)
    assert calls[:3] == [5, 3, 3]  # listed, found parts gone and not committed any more, listed again
    assert (s.samples, s.integrity_error_count, s.parts.missing) == (len(rows), 0, [])
    assert {g.name: g.parts for g in s.by_shard} == {"s00000": 1, "s00001": 2}


def test_stats_without_state_sqlite_read_compacted_shard_files(store, tmp_path):
    rows = fill(store, "s00000", 3) + fill(store, "s00001", 2)
    store.compact("s00000")
    store.close()
    for f in tmp_path.glob("state.sqlite*"):
        f.unlink()
    s = compute_stats(tmp_path)
    assert s.parts.listed_from == "glob" and s.samples == len(rows)


def test_parts_written_before_prompt_opened_existed_compact_with_it_false(store, tmp_path):
    rows = fill(store, "s00000", 2)
    old = tmp_path / "shards/s00000/part-000000.parquet"
    table = pq.read_table(old)
    pq.write_table(table.drop(["prompt_opened"]), old, compression="zstd")  # as an older regen wrote it
    store.state.db.execute("UPDATE parts SET bytes=? WHERE path=?", (old.stat().st_size, "shards/s00000/part-000000.parquet"))
    done = store.compact("s00000")
    got = pq.read_table(tmp_path / done.path)
    assert got.column("prompt_opened").to_pylist() == [False] * len(rows)
    assert got.column("sample_id").to_pylist() == [r["sample_id"] for r in rows]
