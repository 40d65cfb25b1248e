"""Fault: SIGKILL around compaction. A writer (tests/compaction_child.py) commits the parts of small shards and
compacts each; it is killed at each step of a compaction (from inside, at the step) and at seeded random
moments, restarted each time (its recover() first), and finally run to the end.

After every kill, what sqlite lists as committed holds every committed sample exactly once, in whole files;
after recover() no file is on disk that is not committed (no orphan, no tmp). At the end every sample is
exactly once across the shard files and each shard is one file, shards/<id>/shard.parquet.
"""
from __future__ import annotations

import collections
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from engine.store.committed_view import read_committed

from engine.store.shard_store import ShardStore
from tests.compaction_child import STEPS, TARGET_SHARD, sample_ids

REPO = Path(__file__).resolve().parents[1]
RANDOM_KILLS = 12
SEED = 20261203


def run_child(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.compaction_child", str(run_dir), *args], capture_output=True,
                          text=True, timeout=60, cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)))


def files_on_disk(run_dir: Path) -> set[str]:
    shards = run_dir / "shards"
    return {p.relative_to(run_dir).as_posix() for p in shards.rglob("*") if p.is_file()} if shards.is_dir() else set()


def committed_ids(run_dir: Path) -> tuple[list[str], list[str]]:
    """(every sample id in the committed files, in listing order; the committed files)."""
    listed = read_committed(run_dir).parts
    ids: list[str] = []
    for rel, _, rows in listed:
        got = pq.read_table(run_dir / rel, columns=["sample_id"]).column(0).to_pylist()
        assert len(got) == rows, f"{rel}: {len(got)} rows, state.sqlite says {rows}"
        ids += got
    return ids, [rel for rel, _, _ in listed]


def where_it_died(run_dir: Path, committed: list[str]) -> str:
    """The compaction step a kill left on disk (before recover), from the files alone."""
    disk, listed = files_on_disk(run_dir), set(committed)
    if any(f.endswith("shard.parquet.tmp") for f in disk):
        return "writing the shard file"
    if any(f.endswith("/shard.parquet") and f not in listed for f in disk):
        return "renamed, not swapped"
    if any(f.rpartition("/")[2].startswith("part-") and f not in listed and f.rpartition("/")[0] + "/shard.parquet"
           in listed for f in disk):
        return "swapped, parts not all unlinked"
    if any(f not in listed for f in disk):
        return "writing a part"
    return "between steps"


def check_after_kill(run_dir: Path, expected: set[str]) -> str:
    ids, committed = committed_ids(run_dir)
    assert len(ids) == len(set(ids)), [i for i, n in collections.Counter(ids).items() if n > 1][:5]
    assert set(ids) <= expected
    moment = where_it_died(run_dir, committed)
    store = ShardStore(run_dir)
    try:
        store.recover()
    finally:
        store.close()
    again, committed_after = committed_ids(run_dir)
    assert sorted(again) == sorted(ids), "recover() changed what is committed"
    assert files_on_disk(run_dir) == set(committed_after), "an orphan (or tmp) file survived recover()"
    return moment


@pytest.mark.timeout(150)
def test_sigkill_around_compaction_leaves_each_sample_once_and_each_done_shard_in_one_file(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    per_shard = sample_ids()
    expected = {i for ids in per_shard.values() for i in ids}
    moments = []
    # each step of a compaction, killed at exactly that step (a fresh run dir each, so the step is reached)
    for step in STEPS:
        step_dir = tmp_path / f"step-{step}"
        step_dir.mkdir()
        r = run_child(step_dir, "--kill-at", step)
        assert r.returncode == -9, f"{step}: the child was not killed at the step: {r.returncode} {r.stderr[-2000:]}"
        moments.append(check_after_kill(step_dir, expected))
        assert run_child(step_dir).returncode == 0
        check_done(step_dir, per_shard)
    assert moments == ["writing the shard file", "renamed, not swapped", "swapped, parts not all unlinked",
                       "swapped, parts not all unlinked"]
    # then random moments, each run dir resumed after each kill until its writer finishes (then a fresh one)
    rng = random.Random(SEED)
    kills = rounds = 0
    run_dirs = [run_dir]
    while kills < RANDOM_KILLS:
        rounds += 1
        assert rounds < 3 * RANDOM_KILLS, f"only {kills} kills landed in {rounds} rounds"
        # every other kill: a moment after the writer's first compaction began (it takes ~0.1 s here), so that
        # many land inside one; the others anywhere in its work (mostly commits: fsyncs)
        when = ("--kill-in-compaction", f"{rng.uniform(0.0, 0.12):.3f}") if rounds % 2 else (
            "--kill-after", f"{rng.uniform(0.0, 0.3):.3f}")
        r = run_child(run_dirs[-1], *when)
        if r.returncode == 0:  # the writer finished before the moment came
            check_done(run_dirs[-1], per_shard)
            run_dirs.append(tmp_path / f"run{len(run_dirs)}")
            run_dirs[-1].mkdir()
            continue
        assert r.returncode == -9, r.stderr[-2000:]
        kills += 1
        moments.append(check_after_kill(run_dirs[-1], expected))
    landed = collections.Counter(moments[len(STEPS):])
    print(f"{kills} random kills in {len(run_dirs)} run dir(s) landed:", dict(landed))
    assert sum(n for m, n in landed.items() if m not in ("writing a part", "between steps")) >= 3, landed
    r = run_child(run_dirs[-1])
    assert r.returncode == 0, r.stderr[-2000:]
    check_done(run_dirs[-1], per_shard)


def check_done(run_dir: Path, per_shard: dict[str, list[str]]) -> None:
    ids, committed = committed_ids(run_dir)
    assert sorted(ids) == sorted(i for v in per_shard.values() for i in v)  # every sample, exactly once
    assert committed == [f"shards/{sid}/shard.parquet" for sid in sorted(per_shard)]  # each shard one file
    assert files_on_disk(run_dir) == set(committed)  # and nothing else on disk
    assert TARGET_SHARD in per_shard
