"""console/host/follow.py, the one follow loop, against a scripted source: a cut stream is backfilled from the last
ts with nothing missed or repeated, only read operations are re-issued, a refusal stops it at once, a run that
ends ends it (watch_ended=False). The real-sshd cut is tests/test_faults_ssh.py; the TUI's is test_tui_app.py."""
from __future__ import annotations

from typing import Any

from console.host.follow import Backoff, FollowState, RunFollower, SourceError
from engine.api.status import RunStatus
from engine.api.events import DispatchEvent, Event

FAST = Backoff(first_s=0.001, max_s=0.01, lost_after=2)


class ScriptedSource:
    """A host whose telemetry is `log`; `cuts` says after how many events each follow() call loses the
    connection; `refuse_reconnect` makes every reconnect a refusal; `calls` records every operation issued."""

    host = "scripted"
    run_dir = "/run"

    def __init__(self, log: list[Event], cuts: list[int], *, refuse_reconnect: bool = False,
                 unreachable_reconnects: int = 0):
        self.log = log
        self.cuts = list(cuts)
        self.refuse_reconnect = refuse_reconnect
        self.unreachable_reconnects = unreachable_reconnects
        self.calls: list[tuple[str, Any]] = []
        self.running = True

    async def connect(self) -> None:
        self.calls.append(("connect", None))

    async def reconnect(self) -> None:
        self.calls.append(("reconnect", None))
        if self.refuse_reconnect:
            raise SourceError("scripted refused the connection: Host key is not trusted", "refused")
        if self.unreachable_reconnects:
            self.unreachable_reconnects -= 1
            raise SourceError("cannot connect to scripted: Connection refused", "connection")

    async def status(self) -> RunStatus:
        self.calls.append(("status", None))
        if not self.running:
            raise SourceError("no supervisor at scripted:/run", "no_supervisor")
        return RunStatus(run_dir=self.run_dir, state="running", running=True)

    async def last_status(self) -> RunStatus:
        self.calls.append(("last_status", None))
        return RunStatus(run_dir=self.run_dir, state="done", running=False)

    async def follow(self, since: float | None):
        self.calls.append(("follow", since))
        sent = 0
        for ev in self.log:
            if since is not None and ev.ts < since:
                continue
            if self.cuts and sent == self.cuts[0]:
                self.cuts.pop(0)
                raise SourceError("telemetry stream from scripted ended (closed): connection lost", "connection")
            sent += 1
            yield ev
        self.running = False  # the supervisor exited once its telemetry is drained


def telemetry() -> list[Event]:
    # several events share a ts: the backfill starts at last_ts inclusive and must not repeat them
    return [DispatchEvent(ts=100.0 + i // 3, done=i, total=30) for i in range(30)]


async def collect(follower: RunFollower, again: bool = False) -> list[Event]:
    return [ev async for ev in follower.events(again)]


async def test_cut_streams_are_backfilled_without_gap_or_repeat():
    log = telemetry()
    source = ScriptedSource(log, cuts=[4, 7, 1])
    states: list[FollowState] = []
    statuses: list[RunStatus] = []
    got = await collect(RunFollower(source, since=None, backoff=FAST, watch_ended=False, on_state=states.append,
                                    on_status=statuses.append))
    assert [e.to_json() for e in got] == [e.to_json() for e in log]
    assert [s.state for s in states].count("reconnecting") == 3
    assert all("(closed)" in s.error for s in states if s.state == "reconnecting")
    assert [s.error for s in states if s.state == "connected"] == ["", "regained", "regained", "regained"]
    assert states[-1].state == "ended" and (statuses[-1].state, statuses[-1].running) == ("done", False)
    # only reads were issued again, each backfill from the last ts delivered
    assert {op for op, _ in source.calls} <= {"connect", "reconnect", "status", "last_status", "follow"}
    assert [since for op, since in source.calls if op == "follow"][:2] == [None, log[3].ts]


async def test_a_refused_reconnect_stops_the_loop_and_says_why():
    source = ScriptedSource(telemetry(), cuts=[5], refuse_reconnect=True)
    states: list[FollowState] = []
    follower = RunFollower(source, since=None, backoff=FAST, on_state=states.append)
    got = await collect(follower)
    assert len(got) == 5
    assert states[-1].state == "refused" and "Host key is not trusted" in states[-1].error
    assert follower.stopped_by is not None and follower.stopped_by.kind == "refused"
    assert [op for op, _ in source.calls].count("reconnect") == 1  # no retry: the operator must act


async def test_unreachable_turns_lost_with_growing_backoff_then_comes_back():
    source = ScriptedSource(telemetry(), cuts=[2], unreachable_reconnects=3)
    states: list[FollowState] = []
    follower = RunFollower(source, since=None, backoff=FAST, watch_ended=False, on_state=states.append)
    got = await collect(follower)
    assert len(got) == 30 and follower.stopped_by is None
    waits = [(s.state, s.retry_in_s) for s in states if s.state in ("reconnecting", "lost")]
    assert waits == [("reconnecting", 0.001), ("reconnecting", 0.002), ("lost", 0.004), ("lost", 0.008)]


async def test_again_keeps_its_place():
    log = telemetry()
    source = ScriptedSource(log, cuts=[5], refuse_reconnect=True)
    follower = RunFollower(source, since=None, backoff=FAST, watch_ended=False)
    first = await collect(follower)
    source.refuse_reconnect = False  # the operator fixed it and pressed ctrl+r
    rest = await collect(follower, again=True)
    assert [e.to_json() for e in first + rest] == [e.to_json() for e in log]


def test_follow_progress_never_goes_back():
    """The status snapshot first, then only newer events: a backfilled event from before it is not shown."""
    from console.commands.status_follow import Progress
    from engine.api.events import DispatchEvent

    shown = Progress()
    assert shown.take(DispatchEvent(ts=10.0, done=200, total=2750))
    assert not shown.take(DispatchEvent(ts=9.5, done=182, total=2750))  # older than the snapshot
    assert shown.take(DispatchEvent(ts=10.5, done=205, total=2750))
    assert not shown.take(DispatchEvent(ts=11.0, done=190, total=2750))  # newer, but fewer committed: stale
    assert shown.take(DispatchEvent(ts=12.0, done=206, total=2750))
