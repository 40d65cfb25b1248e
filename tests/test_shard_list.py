"""The Shards tab's list without a screen (filter, sort, counts, jump, selection); the model's changed shards."""
from __future__ import annotations

import dataclasses
import random

import pytest

from console.view.model import RunModel

from console.view.model_parts import ShardView
from console.view.shard_list import FILTERS, SORTS, ShardList, has_problem, sort_key
from engine.api.status import RunStatus
from engine.api.events import ShardEvent
from engine.api.wire import AlertLevels
from tests.shard_fixtures import T0, ShardsSource, frozen_shards

LEVELS = AlertLevels()  # the engine's defaults: [alerts] empty_share 0.05, truncated_share 0.10


def view(sid: str, state: str = "running", done: int = 0, total: int = 20, empty: int = 0, truncated: int = 0,
         repetition: int = 0) -> ShardView:
    return ShardView(sid, state=state, done=done, total=total, empty=empty, truncated=truncated,
                     repetition=repetition)


def brute(shards: list[ShardView], filter: str, sort: str) -> list[str]:
    """What the list must show, computed the slow way."""
    keep = [s for s in shards if filter == "all" or (has_problem(s, LEVELS) if filter == "problems" else s.state == filter)]
    return [s.id for s in sorted(keep, key=lambda s: sort_key(s, sort))]


def test_a_problem_is_an_empty_or_truncated_share_over_its_threshold_after_some_samples_or_a_runaway():
    assert not has_problem(view("a", done=9, empty=9), LEVELS)  # too few samples to say
    assert has_problem(view("a", done=10, empty=1), LEVELS)  # 10% > 5%
    assert not has_problem(view("a", done=20, empty=1), LEVELS)  # 5% is not over 5%
    assert has_problem(view("a", done=20, truncated=3), LEVELS)  # 15% > 10%
    assert not has_problem(view("a", done=20, truncated=2), LEVELS)
    assert has_problem(view("a", done=1, repetition=1), LEVELS)  # a runaway stopped says enough on its own
    assert has_problem(view("a", state="done", done=2, total=2, empty=1), LEVELS)  # a small shard counts once complete


def test_counts_by_state_and_problems():
    sl = ShardList()
    sl.update([view("a", "done", 20, empty=5), view("b", "running", 3), view("c", "pending"), view("d", "paused"),
               view("e", "stopped"), view("f", "running", 12, truncated=4)])
    s = sl.summary()
    assert (s.total, s.done, s.running, s.pending, s.paused, s.other, s.problems, s.listed) == (6, 1, 2, 1, 1, 1, 2, 6)


@pytest.mark.parametrize("filter", FILTERS)
@pytest.mark.parametrize("sort", SORTS)
def test_incremental_updates_keep_the_order_the_slow_way_would_give(filter, sort):
    rng = random.Random(f"{filter}-{sort}")
    shards = {f"s{i:05d}": view(f"s{i:05d}", "pending") for i in range(300)}
    sl = ShardList(filter, sort)
    sl.update(shards.values())
    for _ in range(40):  # batches of changes, as telemetry brings them
        changed = rng.sample(sorted(shards), 12)
        for sid in changed:
            s = shards[sid]
            s.done = min(s.total, s.done + rng.randint(0, 6))
            s.empty += rng.random() < 0.2
            s.truncated = min(s.done, s.truncated + (rng.random() < 0.2))
            s.empty = min(s.empty, s.done)
            s.state = "done" if s.done == s.total else rng.choice(["running", "paused", "running"])
        sl.update(shards[sid] for sid in changed)
        assert sl.ids() == brute(list(shards.values()), filter, sort)
    kinds = sl.summary()
    assert kinds.problems == sum(has_problem(s, LEVELS) for s in shards.values())
    assert kinds.running == sum(s.state == "running" for s in shards.values())


def test_an_update_that_changes_nothing_listed_leaves_the_order_alone():
    sl = ShardList("running", "id")
    a = view("a", "running", 1)
    assert sl.update([a, view("b", "pending")])
    version = sl.version
    a.output_tokens += 100  # not a sort key, not the filter
    assert not sl.update([a])
    assert sl.version == version


def test_cycling_filter_and_sort_and_the_next_problem_wraps():
    sl = ShardList()
    sl.update([view("a", "done", 20), view("b", "running", 20, empty=4), view("c", "running", 2),
               view("d", "done", 20, truncated=5)])
    assert [sl.cycle_filter() for _ in FILTERS] == [*FILTERS[1:], FILTERS[0]]
    assert [sl.cycle_sort() for _ in SORTS] == [*SORTS[1:], SORTS[0]]
    assert sl.next_problem(0) == 1 and sl.next_problem(1) == 3 and sl.next_problem(3) == 1
    sl.set_view(filter="running")
    assert sl.ids() == ["b", "c"] and sl.next_problem(0) == 0
    sl.set_view(filter="done")
    assert sl.next_problem(0) == 1
    sl.set_view(filter="pending")
    assert len(sl) == 0 and sl.next_problem(0) is None
    with pytest.raises(ValueError, match="unknown shard filter 'stuck'"):
        sl.set_view(filter="stuck")


def test_sort_by_share_puts_the_worst_first_and_shards_without_samples_last():
    sl = ShardList(sort="empty")
    sl.update([view("a", done=0), view("b", done=10, empty=1), view("c", done=10, empty=5), view("d", done=10)])
    assert sl.ids() == ["c", "b", "d", "a"]
    sl.set_view(sort="progress")
    assert sl.ids() == ["a", "b", "c", "d"]  # least progress first, then by id


def test_selection_the_listed_shards_and_what_pause_acts_on():
    sl = ShardList()
    sl.update([view("a", "running"), view("b", "pending"), view("c", "running")])
    assert sl.targets("b") == ["b"]  # nothing selected: the cursor's shard
    assert sl.targets(None) == []
    sl.toggle("c")
    sl.toggle("a")
    sl.toggle("c")
    assert sl.targets("b") == ["a"]
    sl.set_view(filter="running")
    assert sl.select_listed() == 2 and sl.targets("b") == ["a", "c"]
    assert sl.summary().selected == 2
    sl.clear_selection()
    assert sl.targets("a") == ["a"]


def test_the_model_marks_only_the_shards_whose_figures_changed():
    m = RunModel()
    status = RunStatus(run_dir="/r", state="running", shards=frozen_shards(2000), checked_at=T0)
    assert "shards" in m.apply_status(status)
    assert len(m.take_changed_shards()) == 2000
    # the same snapshot ten seconds later: nothing to redraw
    status = dataclasses.replace(status, checked_at=T0 + 10)
    assert "shards" not in m.apply_status(status)
    assert m.take_changed_shards() == set()
    # one shard moved on: only it
    shards = list(status.shards)
    shards[5] = dataclasses.replace(shards[5], done=shards[5].done + 1)
    status = dataclasses.replace(status, checked_at=T0 + 20, shards=shards)
    assert "shards" in m.apply_status(status) and m.take_changed_shards() == {"s00005"}
    ev = ShardEvent(ts=T0 + 30, id="s00007", state="paused", done=2, total=2)
    assert m.apply(ev) == {"shards"} and m.take_changed_shards() == {"s00007"}
    assert m.apply(dataclasses.replace(ev, ts=T0 + 31)) == set()  # a repeat of the same figures


def test_the_fake_source_pauses_and_resumes_what_it_is_asked():
    import asyncio

    src = ShardsSource(500)
    asyncio.run(src.pause(["s00100", "s00101"]))
    asyncio.run(src.resume(["s00100"]))
    assert src.requests == [("pause", ["s00100", "s00101"]), ("resume", ["s00100"])]
    assert (src.shards["s00100"].state, src.shards["s00101"].state) == ("pending", "paused")


def test_the_run_levels_from_the_engine_move_the_problem_marks():
    shards = ShardList()
    shards.update([view("a", done=20, empty=2)])  # 10%: over the default 5%
    assert shards.summary().problems == 1
    assert shards.set_levels(AlertLevels(empty_share=0.2, truncated_share=0.3))
    assert shards.summary().problems == 0 and not shards.set_levels(AlertLevels(empty_share=0.2, truncated_share=0.3))
