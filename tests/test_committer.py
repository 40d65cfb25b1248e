"""The committer commits in its own thread: the event loop keeps running during a slow commit,
rows count as committed (one `Committed` outcome settled by the ledger, on the loop thread) only after ShardStore.commit
returned, failed commits keep their rows in order, and drain waits for the commit in
flight. A real ShardStore underneath; its commit slowed down where the test needs a slow disk."""
from __future__ import annotations

import asyncio
import threading
import time
from array import array

import pyarrow.parquet as pq
import pytest

from engine.text.ingest import Conversation
from engine.run.committer import Committer
from engine.run.items import Committed, Generated, SampleRow, WorkItem
from engine.store.shard_store import ShardStore
from engine.store.state_db import StoreError
from tests.test_shard_store import make_row
from tests.waiting import await_until


class FakeLedger:
    """The committer's side of the ledger: its two questions, and the outcomes it is told."""
    def __init__(self, turns: str = "last"):
        self.turns = turns
        self.shards: dict = {}  # no shard counts: every part waits for max_rows / max_age_s
        self.committed: list[tuple[str, int]] = []  # (sample id, thread id)

    def chains_on(self, item) -> bool:
        return self.turns == "all" and not item.is_last_turn

    def unsettled(self, shard_id: str) -> int | None:
        counts = self.shards.get(shard_id)
        return None if counts is None else counts.total - counts.settled

    def settle(self, outcome: Committed) -> None:
        self.committed += [(item.sample_id, threading.get_ident()) for item, _ in outcome.samples]


def generated(conv: str, prompt_len: int = 5, output_len: int = 4) -> Generated:
    """An answer as the dispatcher hands it over (the ids those of tests.test_shard_store.make_row)."""
    c = Conversation(conv, "p.jsonl", "p.jsonl:1", 0, ({"role": "user", "content": "q"},))
    it = WorkItem(sample_id=f"{conv}#turn0", conv=c, turn=0, shard_id="s00000",
                  prompt_ids=list(range(100, 100 + prompt_len)), max_new_tokens=8, is_last_turn=True)
    row = SampleRow(sample_id=it.sample_id, conversation_id=conv, turn=0, source="p.jsonl", origin="p.jsonl:1",
                    prompt_ids=it.prompt_ids, output_ids=array("i", range(100 + prompt_len, 100 + prompt_len + output_len)),
                    reasoning_tokens=1, prompt_opened=False, finish_reason="stop", completion_tokens=output_len, cached_tokens=2,
                    latency_s=0.5, worker="gpu0", text="<think>\nhmm\n</think>\n\nThe answer is four.")
    return Generated(it, row)


class SlowStore(ShardStore):
    delay = 0.0
    fail_next = 0
    threads: list[int]

    def commit(self, shard_id, rows, history={}):  # noqa: B006
        self.threads.append(threading.get_ident())
        time.sleep(self.delay)  # kept: the slow disk this store simulates
        if self.fail_next:
            self.fail_next -= 1
            raise StoreError("No space left on device (simulated)")
        return super().commit(shard_id, rows, history)


@pytest.fixture
def store(tmp_path):
    s = SlowStore(tmp_path)
    s.threads = []
    s.ensure_shards({"s00000": 1000})
    yield s
    s.close()


def committed_ids(store: ShardStore) -> list[str]:
    ids = []
    for part in store.parts():
        ids += pq.read_table(store.run_dir / part.path).column("sample_id").to_pylist()
    return ids


def test_a_slow_commit_does_not_block_the_loop(store):
    store.delay = 1.0
    ledger = FakeLedger()
    alerts = []

    async def main():
        c = Committer(store, ledger, alerts.append, max_rows=4, max_age_s=10)
        task = asyncio.create_task(c.run_forever())
        for i in range(4):
            c.add(generated(f"a{i}"))
        gaps, last = [], time.monotonic()
        deadline = last + 30  # for the commit to be counted; the gaps measured until then
        while time.monotonic() < deadline:
            await asyncio.wait({task}, timeout=0.01)  # the probe of the loop's responsiveness (it measures the gaps)
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            if ledger.committed:
                break
        assert c.pending == 0 or ledger.committed
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        c.close()
        return max(gaps), c

    worst, c = asyncio.run(main())
    # a commit on the loop would stall it for the whole second; a loaded machine delays a wake-up a little
    assert worst < 0.5, f"the loop stalled {worst:.2f} s during a 1 s commit"
    loop_thread = threading.get_ident()
    assert store.threads and all(t != loop_thread for t in store.threads)  # committed in the thread
    assert [sid for sid, _ in ledger.committed] == [f"a{i}#turn0" for i in range(4)]
    assert all(t == loop_thread for _, t in ledger.committed)  # the ledger heard it on the loop
    assert [p.rows for p in store.parts()] == [4] and alerts == []


def test_a_failed_commit_keeps_its_rows_first_and_is_retried(store):
    store.fail_next = 1
    ledger = FakeLedger()
    alerts = []

    async def main():
        c = Committer(store, ledger, alerts.append, max_rows=2, max_age_s=10)
        c.add(generated("a"))
        c.add(generated("b"))
        await c.commit_due_async()
        assert ledger.committed == [] and c.pending == 2  # nothing counted, nothing lost
        c.add(generated("c"))
        await c.drain()
        c.close()
        return c

    c = asyncio.run(main())
    assert len(alerts) == 1 and "cannot write a part file of s00000" in alerts[0].text
    assert committed_ids(store) == ["a#turn0", "b#turn0", "c#turn0"]  # the kept rows first, in order
    assert [sid for sid, _ in ledger.committed] == ["a#turn0", "b#turn0", "c#turn0"] and c.pending == 0


def test_drain_waits_for_the_commit_in_flight_then_commits_the_rest(store):
    store.delay = 0.3
    ledger = FakeLedger()

    async def main():
        c = Committer(store, ledger, lambda e: None, max_rows=2, max_age_s=10)
        task = asyncio.create_task(c.run_forever())
        c.add(generated("a"))
        c.add(generated("b"))
        await await_until(lambda: c.committing, 10, "the first commit in its thread")
        c.add(generated("c"))
        assert c.pending == 3
        await c.drain()
        assert c.pending == 0 and not c.committing
        # run_forever, which waited on that commit, wakes up and finds the job settled already (not counted twice)
        await await_until(lambda: not c._job_lock.locked(), 10, "run_forever done with the settled job")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        c.close()

    asyncio.run(main())
    assert sorted(committed_ids(store)) == ["a#turn0", "b#turn0", "c#turn0"]
    assert sorted(sid for sid, _ in ledger.committed) == ["a#turn0", "b#turn0", "c#turn0"]


def test_drain_commits_everything_off_the_loop(store):
    store.delay = 0.2
    ledger = FakeLedger()

    async def main():
        c = Committer(store, ledger, lambda e: None, max_rows=100, max_age_s=10)
        task = asyncio.create_task(c.run_forever())
        for i in range(5):
            c.add(generated(f"d{i}"))
        ticks = 0

        drained = asyncio.create_task(c.drain())
        while not drained.done():  # a tick every 10 ms while the drain runs shows the loop stays free
            await asyncio.wait({drained}, timeout=0.01)
            ticks += 1
        await drained
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        c.close()
        return ticks, c

    ticks, c = asyncio.run(main())
    assert ticks >= 5  # the loop ran while the commit was in the thread
    assert c.pending == 0 and sorted(committed_ids(store)) == [f"d{i}#turn0" for i in range(5)]


def test_a_duplicate_sample_is_dropped_with_an_alert_and_the_rest_committed(store):
    store.commit("s00000", [make_row("x")])
    ledger = FakeLedger()
    alerts = []

    async def main():
        c = Committer(store, ledger, alerts.append, max_rows=100, max_age_s=10)
        for conv in ("y", "x", "z"):
            c.add(generated(conv))
        await c.drain()
        await c.drain()  # the fresh rows go back to the buffer and are committed with the next part
        c.close()
        return c

    c = asyncio.run(main())
    assert len(alerts) == 1 and "duplicate sample ids in a commit of s00000; dropped 1" in alerts[0].text
    assert sorted(committed_ids(store)) == ["x#turn0", "y#turn0", "z#turn0"]
    assert [sid for sid, _ in ledger.committed] == ["y#turn0", "z#turn0"] and c.pending == 0


def test_a_shard_whose_outstanding_samples_are_all_buffered_is_committed_without_waiting(store):
    """The shard's last rows go at once: no later row can join that part, so max_age_s would only delay it."""
    from engine.run.counts import ShardCounts

    ledger = FakeLedger()
    ledger.shards = {"s00000": ShardCounts(total=5, done=0, failed=1)}  # 4 samples left to settle

    async def main():
        c = Committer(store, ledger, lambda e: None, max_rows=100, max_age_s=3600)
        for conv in ("a", "b", "c"):
            c.add(generated(conv))
        assert c._due() == []  # one sample still out: wait for it (or for the age)
        c.add(generated("d"))
        assert c._due() == ["s00000"] and c._wake.is_set()
        await c.commit_due_async()
        c.close()
        return c

    c = asyncio.run(main())
    assert [p.rows for p in store.parts()] == [4] and c.pending == 0
    assert sorted(committed_ids(store)) == ["a#turn0", "b#turn0", "c#turn0", "d#turn0"]
