"""The ledger (engine.run.ledger) settling every outcome, its figures (engine.run.counts) and the one shard-state
rule (engine.observe.status)."""
from __future__ import annotations

import asyncio

import orjson

from engine.config.load import RunConfig
from engine.text.ingest import Conversation
from engine.text.row_errors import Reject
from engine.store.rejects import RejectLog
from engine.run.counts import RATE_MIN_SPAN_S, RATE_WINDOW_S, CommitRate, ShardCounts, counts_from_store, eta_s
from engine.run.items import Committed, Failed, Rejected, Retry, WorkItem
from engine.run.conversations import ConvProgress, Unfit
from engine.run.ledger import Ledger
from tests.ledger_stubs import StubWing
from engine.observe.status import dispatch_figures, shard_state, shard_statuses
from engine.store.shard_store import ShardProgress, ShardStore
from engine.store.state_db import PartInfo
from tests.test_shard_store import make_row


def test_the_commit_rate_is_none_until_measurable_and_counts_only_this_start_and_the_window():
    rate = CommitRate()
    rate.add(500, now=0.0)
    assert rate.tokens_per_s(now=1.0) is None  # dispatch has not begun
    rate.start(now=100.0)
    rate.add(100, now=100.5)
    assert rate.tokens_per_s(now=100.0 + RATE_MIN_SPAN_S) is None  # one commit: not yet a rate
    rate.add(100, now=101.0)
    assert rate.tokens_per_s(now=100.0 + RATE_MIN_SPAN_S / 2) is None  # under RATE_MIN_SPAN_S since the start
    # from the first commits on: every token committed since this start's dispatch, over all that time
    assert rate.tokens_per_s(now=100.0 + RATE_MIN_SPAN_S) == 200 / RATE_MIN_SPAN_S  # the earlier 500 is not counted
    rate.add(100, now=103.0)
    assert rate.tokens_per_s(now=105.0) == 300 / 5.0
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


# -- the Ledger: every outcome settled in one place, over a real store and reject log ------------------------


def conv(cid: str) -> Conversation:
    return Conversation(cid, "/data/p.jsonl", "p.jsonl:3", 0, ({"role": "user", "content": "q"},
                                                                 {"role": "assistant", "content": "a"},
                                                                 {"role": "user", "content": "q2"}))


def work(cid: str, turn: int = 0, last: bool = True, shard: str = "s00000") -> WorkItem:
    return WorkItem(sample_id=f"{cid}#turn{turn}", conv=conv(cid), turn=turn, shard_id=shard, prompt_ids=[1, 2],
                    max_new_tokens=8, is_last_turn=last)


def open_ledger(tmp_path, totals: dict[str, int], turns: str = "last") -> Ledger:
    cfg = RunConfig(run_dir=str(tmp_path), model="/m", prompts=("/data/p.jsonl",), turns=turns)
    store = ShardStore(tmp_path)
    wing = StubWing()
    ledger = Ledger(cfg, {sid: ShardCounts(total=n, conversations=n) for sid, n in totals.items()}, store,
                    RejectLog(tmp_path), feed=wing, events=wing)
    ledger.open()
    return ledger


def admit(ledger: Ledger, *items: WorkItem, turns: list[int] | None = None) -> ConvProgress:
    p = ConvProgress(conv=items[0].conv, shard_id=items[0].shard_id, turns=turns or [i.turn for i in items])
    ledger.begin([p])
    ledger.admit(p, list(items))
    return p


def reject_rows(tmp_path) -> list[dict]:
    return [orjson.loads(line) for line in (tmp_path / "rejects.jsonl").read_bytes().splitlines()]


def test_every_outcome_settles_in_the_ledger_and_moves_only_its_own_count(tmp_path):
    async def main():
        ledger = open_ledger(tmp_path, {"s00000": 4})
        for cid in "abcd":
            admit(ledger, work(cid))
        a, b, c, d = (ledger.next_item() for _ in range(4))
        part = ledger.store.commit("s00000", [make_row("a", output_len=7)])
        ledger.settle(Committed(part, ((a, None),)))
        ledger.settle(Failed(b, "generation failed after 4 attempts", excerpt="gpu0: HTTP 500"))
        ledger.settle(Rejected(c, "rejected by SGLang (HTTP 400): too long"))
        ledger.settle(Retry(d))
        assert ledger.next_item() is d  # a retry goes back to the front of the queue
        counts = ledger.shards["s00000"]
        assert (counts.done, counts.output_tokens, counts.failed, counts.rejected, counts.to_generate) == (1, 7, 1, 1, 2)
        assert not ledger.finished and ledger.unsettled("s00000") == 1
        assert [(r["conversation_id"], r["kind"]) for r in reject_rows(tmp_path)] == [
            ("b", "generation_failed"), ("c", "sglang_rejected")]
        # the store holds the same outcomes: a ledger opened again on it counts the same (failed are retried)
        again = open_ledger(tmp_path, {"s00000": 4})
        assert (again.shards["s00000"].done, again.shards["s00000"].rejected, again.shards["s00000"].failed) == (1, 1, 0)

    asyncio.run(main())


def test_a_pause_holds_queued_items_at_pull_and_a_resume_puts_them_first_and_asks_for_the_rest(tmp_path):
    async def main():
        ledger = open_ledger(tmp_path, {"s00000": 2, "s00001": 1})
        resumed = ledger.feed.rescanned
        admit(ledger, work("a"))
        admit(ledger, work("x", shard="s00001"))
        admit(ledger, work("b"))
        assert ledger.set_paused(["s00000"], True) == ["s00000"]
        assert ledger.next_item().sample_id == "x#turn0"  # a and b are held, not handed out
        assert ledger.next_item() is None and ledger.paused == {"s00000"}
        assert ledger.store.paused() == {"s00000"}  # recorded: a restart keeps the pause
        assert ledger.set_paused(None, False) == ["s00000"]  # --all: the one shard that was paused, not every shard
        assert ledger.set_paused(["s00001"], False) == []  # not paused: nothing resumed
        assert resumed == ["s00000"]  # the feed streams again what it passed while the shard was paused
        assert [ledger.next_item().sample_id for _ in range(2)] == ["a#turn0", "b#turn0"]

    asyncio.run(main())


def test_a_committed_turn_asks_the_feed_for_the_next_and_a_failed_turn_settles_the_later_ones(tmp_path):
    async def main():
        ledger = open_ledger(tmp_path, {"s00000": 4}, turns="all")
        asked = []

        def build_turn(progress: ConvProgress, turn: int):
            asked.append((progress.conv.conversation_id, turn, dict(progress.answers)))
            return work(progress.conv.conversation_id, turn, last=True)

        ledger.feed.turn_builder = build_turn
        admit(ledger, work("a", 0, last=False), turns=[0, 1])
        admit(ledger, work("b", 0, last=False), turns=[0, 1])
        a0, b0 = ledger.next_item(), ledger.next_item()
        part = ledger.store.commit("s00000", [make_row("a")], {"a#turn0": "first answer"})
        ledger.settle(Committed(part, ((a0, "first answer"),)))
        assert asked == [("a", 1, {0: "first answer"})] and ledger.next_item().sample_id == "a#turn1"
        ledger.settle(Failed(b0, "generation failed after 4 attempts"))
        counts = ledger.shards["s00000"]
        assert (counts.done, counts.failed, ledger.unsettled("s00000")) == (1, 2, 1)
        assert [r["kind"] for r in reject_rows(tmp_path)] == ["generation_failed", "earlier_turn_failed"]

    asyncio.run(main())


def test_an_unfit_turn_is_rejected_and_settles_its_shard(tmp_path):
    async def main():
        ledger = open_ledger(tmp_path, {"s00000": 1})
        p = ConvProgress(conv=conv("a"), shard_id="s00000", turns=[0])
        ledger.begin([p])
        ledger.admit(p, [Unfit(0, Reject(file="/data/p.jsonl", line=3, row=None, reason="does not fit",
                                         excerpt="a#turn0", conversation_id="a", kind="context_overflow"))])
        assert ledger.finished and ledger.shards["s00000"].rejected == 1 and not ledger.is_active("a")

    asyncio.run(main())


def test_answers_waiting_for_their_commit_do_not_hold_back_the_feed(tmp_path):
    """Issue 25: a finished answer waits up to [store] part_max_age_s in the committer's buffer; its conversation
    must not count against the conversations in progress, or the freed slots find no work until the commit."""
    async def main():
        ledger = open_ledger(tmp_path, {"s00000": 600})
        ledger.size_for(1)  # _max_active = MIN_ACTIVE
        cap = ledger._max_active
        items = [work(f"c{i}") for i in range(cap)]
        for item in items:
            admit(ledger, item)
        taken = [ledger.next_item() for _ in range(cap)]
        assert not ledger.needs_work()  # every conversation in progress needs a server
        for item in taken[:10]:
            ledger.generated(item)  # answered: in the committer's buffer, not committed
        assert ledger.needs_work()  # ten conversations only wait for their commit: the feed may admit ten more
        assert ledger.shards["s00000"].done == 0  # nothing is settled before its commit
        part = ledger.store.commit("s00000", [make_row(i.conv.conversation_id, output_len=3) for i in taken[:10]])
        ledger.settle(Committed(part, tuple((i, None) for i in taken[:10])))
        assert ledger.shards["s00000"].done == 10 and ledger.needs_work()

    asyncio.run(main())
