"""A server's fair share of scarce work, its room, and the stranded-queue alert (engine.run.spread)."""
from __future__ import annotations

from engine.run.spread import STRANDED_ALERT_S, ServerLoad, StrandedWatch, room, within_share
from engine.api.wire import AlertKind


def load(name: str, in_flight: int, capacity: int = 100, **kw) -> ServerLoad:
    return ServerLoad(name=name, capacity=capacity, in_flight=in_flight, **kw)


def test_with_more_work_queued_than_free_slots_every_server_fills_up():
    a, b = load("a", 90), load("b", 10)
    assert within_share(b, [a, b], queued=200) and within_share(a, [a, b], queued=200)


def test_scarce_work_is_split_by_capacity():
    # 60 items left in all (40 in flight + 20 queued), two servers of equal capacity: 30 each
    a, b = load("a", 30), load("b", 10)
    assert not within_share(a, [a, b], queued=20)  # a holds its share already
    assert within_share(b, [a, b], queued=20)
    big, small = load("big", 0, capacity=300), load("small", 0, capacity=100)
    assert within_share(big, [big, small], queued=40)
    assert not within_share(load("small", 10), [big, load("small", 10)], queued=30)  # 40 x 100/400 = 10


def test_a_server_still_starting_keeps_its_share_from_the_first_ready_one():
    first = load("a", 50)
    assert not within_share(first, [first], queued=50, starting=1)  # 100 left, half of it for the one starting
    assert within_share(first, [first], queued=50)  # alone (its grace over): all of it


def test_a_server_takes_one_item_even_when_its_share_rounds_to_none():
    a = load("a", 0, capacity=1)
    assert within_share(a, [a, load("b", 0, capacity=1000)], queued=1)


def test_room_is_what_a_server_could_start_now():
    assert room(load("a", 40, batch=60, running=40.0, queued=0.0)) == 20
    assert room(load("a", 95, batch=60, running=40.0, queued=0.0)) == 5  # its cap is nearly full
    assert room(load("a", 70, batch=60, running=60.0, queued=0.0)) == 0  # runs its batch
    assert room(load("a", 70, batch=60, running=40.0, queued=3.0)) == 0  # its own queue holds work
    assert room(load("a", 0, batch=None, running=None)) == 0  # not known yet


def test_the_stranded_alert_fires_once_after_the_idle_time_and_clears():
    watch = StrandedWatch()
    busy = load("a", 100, running=60.0, queued=40.0)
    idle = load("b", 0, running=0.0, queued=0.0)
    # the first look says `cleared` (telemetry drops it unless an earlier supervisor's alert is still raised)
    first = watch.check([busy, idle], now=100.0)  # idle from now
    assert first is not None and first.kind == AlertKind.CLEARED
    assert watch.check([busy, idle], now=100.5) is None
    ev = watch.check([busy, idle], now=100.0 + STRANDED_ALERT_S)
    assert ev is not None and ev.severity == "warning" and "while b idles" in ev.text and "a 40" in ev.evidence
    assert ev.kind == AlertKind.RAISED
    assert watch.check([busy, idle], now=101.0 + STRANDED_ALERT_S) is None  # said once
    done = watch.check([busy, load("b", 20, running=20.0, queued=0.0)], now=102.0 + STRANDED_ALERT_S)
    assert done is not None and done.severity == "info" and done.text.startswith("cleared")
    assert done.kind == AlertKind.CLEARED
