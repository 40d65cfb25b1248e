"""The ledger's figures (engine.run.counts) and the one shard-state rule (engine.run.status)."""
from __future__ import annotations

from engine.run.counts import RATE_MIN_SPAN_S, RATE_WINDOW_S, CommitRate, ShardCounts, counts_from_store, eta_s
from engine.run.status import dispatch_figures, shard_state, shard_statuses
from engine.shard_store import PartInfo, ShardProgress


def test_the_commit_rate_is_none_until_measurable_and_counts_only_this_start_and_the_window():
    rate = CommitRate()
    rate.add(500, now=0.0)
    assert rate.tokens_per_s(now=1.0) is None  # dispatch has not begun
    rate.start(now=100.0)
    for t in (101.0, 102.0, 103.0):
        rate.add(100, now=t)
    assert rate.tokens_per_s(now=105.0) is None  # under RATE_MIN_SPAN_S since the start
    assert rate.tokens_per_s(now=100.0 + RATE_MIN_SPAN_S) == 300 / RATE_MIN_SPAN_S  # the earlier 500 is not counted
    later = 100.0 + RATE_WINDOW_S + 50
    for t in (later - 3, later - 2, later - 1):
        rate.add(60, now=t)
    assert rate.tokens_per_s(now=later) == 180 / RATE_WINDOW_S  # only the last window


def test_eta_from_remaining_samples_committed_tokens_per_sample_and_the_rate():
    assert eta_s(left=300, done=100, output_tokens=20_000, tokens_per_s=1000.0) == 60.0
    assert eta_s(left=300, done=100, output_tokens=20_000, tokens_per_s=None) is None
    assert eta_s(left=300, done=0, output_tokens=0, tokens_per_s=50.0) is None
    assert eta_s(left=0, done=10, output_tokens=10, tokens_per_s=None) == 0.0


def test_counts_move_with_a_part_and_load_from_the_store():
    c = ShardCounts(total=10)
    c.add_part(PartInfo("s00000", "shards/s00000/part-000000.parquet", 3, 0.0, output_tokens=30, empty=1, truncated=2))
    assert (c.done, c.output_tokens, c.empty, c.truncated) == (3, 30, 1, 2)
    (loaded,) = counts_from_store([ShardProgress("s00000", 5, 3, 30, 1, 2, False, 1, total_samples=10, rejected=2)]
                                  ).values()
    assert (loaded.done, loaded.output_tokens, loaded.rejected, loaded.to_generate, loaded.complete) == (
        3, 30, 2, 8, False)


def test_one_rule_for_a_shard_state():
    done = ShardCounts(total=4, done=3, rejected=1)
    started = ShardCounts(total=4, done=1)
    fresh = ShardCounts(total=4)
    assert shard_state(done, paused=True, run_state="running", started=False) == "done"  # settled: rejected counts
    assert shard_state(started, paused=True, run_state="running", started=True) == "paused"
    assert shard_state(started, paused=False, run_state="running", started=False) == "running"
    assert shard_state(fresh, paused=False, run_state="running", started=False) == "pending"
    assert shard_state(fresh, paused=False, run_state="running", started=True) == "running"
    assert shard_state(started, paused=False, run_state="draining", started=True) == "draining"
    for ended in ("stopped", "drained", "failed", "dead", "done"):
        assert shard_state(started, paused=False, run_state=ended, started=False) == "stopped"
        assert shard_state(fresh, paused=False, run_state=ended, started=False) == "pending"


def test_dispatch_figures_sum_the_counts_and_give_no_rate_or_eta_unless_running():
    shards = {"s00000": ShardCounts(total=4, done=3, rejected=1, output_tokens=90),
              "s00001": ShardCounts(total=4, done=1, output_tokens=30)}
    rate = CommitRate()
    rate.start(now=0.0)
    stopped = dispatch_figures(shards, "stopped", rate=rate, in_flight=0)
    assert (stopped.done, stopped.total, stopped.planned, stopped.rejected, stopped.output_tokens) == (4, 7, 8, 1, 120)
    assert stopped.tokens_per_s is None and stopped.eta_s is None
    assert [s.state for s in shard_statuses(shards, [], "stopped")] == ["done", "stopped"]
