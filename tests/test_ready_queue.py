"""Prefix-affinity dispatch (engine.run.ready_queue, through the ledger): which item a free slot of a worker takes."""
from __future__ import annotations

import asyncio
import collections
import random

from engine.config.load import Dispatch, RunConfig
from engine.store.rejects import RejectLog
from engine.run.counts import ShardCounts
from engine.run.items import Committed, WorkItem
from engine.run.conversations import ConvProgress
from engine.run.ledger import Ledger
from engine.run.ready_queue import PREFIX_TOKENS, ReadyQueue
from engine.store.shard_store import ShardStore
from tests.ledger_stubs import StubWing
from tests.test_ledger import conv
from tests.test_shard_store import make_row


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def item(name: str, prompt: list[int] | None = None, turn: int = 0) -> WorkItem:
    return WorkItem(sample_id=f"{name}#turn{turn}", conv=conv(name), turn=turn, shard_id="s00000",
                    prompt_ids=prompt if prompt is not None else [1, 2, 3], max_new_tokens=8, is_last_turn=True)


def long_prompt(seed: int, extra: int = 50) -> list[int]:
    """A prompt past PREFIX_TOKENS whose prefix is drawn from `seed` (equal seeds: a shared system prompt)."""
    r = random.Random(seed)
    return [r.randrange(1000) for _ in range(PREFIX_TOKENS)] + list(range(extra))


def queue(workers=("gpu0", "gpu1"), affinity=True, hold_s=0.5) -> tuple[ReadyQueue, Clock]:
    clock = Clock()
    q = ReadyQueue(affinity, hold_s, clock=clock)
    for w in workers:
        q.worker_ready(w, True)
    return q, clock


def test_a_later_turn_waits_for_its_worker_while_the_others_take_the_rest():
    q, _ = queue()
    q.push([item("a")])
    q.push([item("c", turn=1)], front=True, prefer="gpu0")
    assert q.pop_for("gpu1").sample_id == "a#turn0"  # the unassigned item, not gpu0's
    assert q.pop_for("gpu1") is None and len(q) == 1  # held for gpu0: gpu1 has to wait (or get new work)
    assert q.pop_for("gpu0").sample_id == "c#turn1"


def test_a_held_turn_goes_to_any_worker_once_its_hold_runs_out():
    q, clock = queue(hold_s=0.5)
    q.push([item("c", turn=1)], prefer="gpu0")
    assert q.pop_for("gpu1") is None
    clock.now += 0.5
    assert q.pop_for("gpu1").sample_id == "c#turn1"


def test_a_worker_that_stops_being_ready_gives_its_items_to_the_others_at_once():
    q, _ = queue()
    q.push([item("c", turn=1), item("d", turn=2)], prefer="gpu0")
    q.push([item("e", long_prompt(7))])  # a lane item (gpu0's or gpu1's)
    q.worker_ready("gpu0", False)
    assert [q.pop_for("gpu1").sample_id for _ in range(3)] == ["c#turn1", "d#turn2", "e#turn0"]
    assert q.pop_for("gpu1") is None and len(q) == 0
    q.push([item("f", turn=1)], prefer="gpu0")  # a conversation last served by the gone worker: no hold
    assert q.pop_for("gpu1").sample_id == "f#turn1"


def test_affinity_off_is_the_plain_queue_retries_and_later_turns_first():
    q, _ = queue(affinity=False)
    q.push([item("a"), item("b", long_prompt(1))])
    q.push([item("c", turn=1), item("d", turn=1)], front=True, prefer="gpu0")
    assert [q.pop_for("gpu1").sample_id for _ in range(4)] == ["c#turn1", "d#turn1", "a#turn0", "b#turn0"]


def test_prompts_sharing_a_prefix_go_to_one_worker_and_distinct_prefixes_spread_evenly():
    workers = [f"gpu{i}" for i in range(4)]
    q, _ = queue(workers)
    assert len({q.owner(long_prompt(42, extra=i + 1)) for i in range(20)}) == 1  # one document, 20 questions
    assert q.owner([1, 2, 3]) is None  # nothing long to share: no lane
    owners = {i: q.owner(long_prompt(i)) for i in range(4000)}
    spread = collections.Counter(owners.values())
    assert set(spread) == set(workers) and min(spread.values()) > 850  # 1,000 each, give or take the hash
    # consistent: a worker leaving moves only its own prompts; the others keep theirs
    q.worker_ready("gpu3", False)
    moved = [i for i, w in owners.items() if q.owner(long_prompt(i)) != w]
    assert moved and all(owners[i] == "gpu3" for i in moved)


def test_a_worker_with_nothing_of_its_own_takes_from_the_longest_lane_so_none_starves():
    q, _ = queue(["gpu0", "gpu1", "gpu2"])
    q.push([item(f"doc{i}", long_prompt(5, extra=i + 1)) for i in range(9)])  # all on one worker's lane
    owner = q.owner(long_prompt(5))
    others = [w for w in ("gpu0", "gpu1", "gpu2") if w != owner]
    taken = [q.pop_for(w) for w in others * 3] + [q.pop_for(owner) for _ in range(3)]
    assert all(t is not None for t in taken) and len({t.sample_id for t in taken}) == 9 and len(q) == 0


def test_nothing_is_lost_or_handed_out_twice_through_pushes_pulls_holds_and_worker_churn():
    rnd = random.Random(3)
    workers = ["gpu0", "gpu1", "gpu2"]
    q, clock = queue(workers, hold_s=1.0)
    pushed, taken = set(), collections.Counter()
    n = 0
    for _ in range(3000):
        op = rnd.random()
        if op < 0.4:
            n += 1
            it = item(f"c{n}", long_prompt(rnd.randrange(30)) if rnd.random() < 0.5 else None)
            pushed.add(it.sample_id)
            q.push([it], front=rnd.random() < 0.3, prefer=rnd.choice(workers + [None]))
        elif op < 0.9:
            got = q.pop_for(rnd.choice(workers))
            if got is not None:
                taken[got.sample_id] += 1
        elif op < 0.95:
            q.worker_ready(rnd.choice(workers), rnd.random() < 0.5)
        else:
            clock.now += rnd.random()
    for w in workers:
        q.worker_ready(w, True)
    clock.now += 10
    while (got := q.pop_for("gpu0")) is not None:
        taken[got.sample_id] += 1
    assert set(taken) == pushed and max(taken.values()) == 1 and len(q) == 0


def test_the_ledger_holds_a_conversations_next_turn_for_the_worker_that_served_it_and_sums_its_cache(tmp_path):
    async def main():
        cfg = RunConfig(run_dir=str(tmp_path), model="/m", prompts=("/data/p.jsonl",), turns="all",
                        dispatch=Dispatch(affinity_hold_s=30.0))
        wing = StubWing(build_turn=lambda progress, turn: item(progress.conv.conversation_id, turn=turn))
        ledger = Ledger(cfg, {"s00000": ShardCounts(total=4, conversations=2)}, ShardStore(tmp_path),
                        RejectLog(tmp_path), feed=wing, events=wing)
        ledger.open()
        ledger.worker_ready("gpu0", True)
        ledger.worker_ready("gpu1", True)
        for cid in "ab":
            p = ConvProgress(conv=conv(cid), shard_id="s00000", turns=[0, 1])
            ledger.begin([p])
            ledger.admit(p, [item(cid)])
        a0, b0 = ledger.next_item("gpu0"), ledger.next_item("gpu1")
        a0.served_by, b0.served_by = "gpu1", "gpu1"  # both answered by gpu1
        part = ledger.store.commit("s00000", [make_row("a"), make_row("b")])
        ledger.settle(Committed(part, ((a0, "x"), (b0, "y")), served=(("gpu1", 2000, 1500),)))
        assert ledger.next_item("gpu0") is None  # held for gpu1
        assert [ledger.next_item("gpu1").sample_id for _ in range(2)] == ["a#turn1", "b#turn1"]
        assert (ledger.served_for("gpu1").prompt_tokens, ledger.served_for("gpu1").cached_tokens) == (2000, 1500)

    asyncio.run(main())


def test_a_worker_that_joins_late_takes_its_share_of_the_prompts_already_queued():
    q, _ = queue(["gpu0"])
    docs = [item(f"doc{i}", long_prompt(i)) for i in range(40)]
    q.push(docs)  # only gpu0 ready: every long prompt sits in its lane
    q.worker_ready("gpu1", True)
    mine = []
    while (got := q.pop_for("gpu1")) is not None and q.owner(got.prompt_ids) == "gpu1":
        mine.append(got.sample_id)
    expected = [d.sample_id for d in docs if q.owner(d.prompt_ids) == "gpu1"]
    assert 10 < len(expected) < 30 and mine == expected  # its own share, in queue order, before any stealing
    rest = [got.sample_id] if got is not None else []
    while (got := q.pop_for("gpu0")) is not None:
        rest.append(got.sample_id)
    assert sorted(mine + rest) == sorted(d.sample_id for d in docs) and len(q) == 0
