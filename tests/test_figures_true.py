"""Every figure the operator sees comes from committed state (issue 14): after each of three SIGKILL restarts
`regen status --json` says done/total, output tokens and per-shard figures equal to the sums over the
committed Parquet rows, and no ETA until one is measurable; a stopped run shows no rate, no ETA and no
shard `running`; a sample rejected at dispatch settles its shard, so the run ends at done == total with
every shard `done`, and each shard's last `shard` event equals its Parquet sums; a console left open across
the restarts (the TUI's model, fed as the TUI feeds it) shows the same figures."""
from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from console.host.follow import Backoff, RunFollower, SourceError
from console.host.transport_local import LocalTransport
from console.tui.app_base import STATUS_EVERY_S
from console.tui.app_follow import BACKFILL_S
from console.view.model import RunModel
from console.host.source import HostSource
from tests.run_helpers import REPO, ctl, events, live_status, make_config, quick_state, status, wait_for
from tests.run_helpers import renderer_for, supervisors  # noqa: F401  (fixtures)
from tests.test_cli_run import regen
from tests.waiting import wait_until

SLOW_SIM = ("--sim-output-mean", "60", "--sim-step-ms", "10", "--sim-tokens-per-step", "2",
            "--max-running-requests", "4")


def status_cli(run_dir: Path, home: Path, *args: str):
    """`regen status local` for a run not started by `regen start`: the host's python3 is this interpreter."""
    return regen("status", "local", "--run-dir", str(run_dir), *args, home=home,
                 env={"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})


def parquet_sums(run_dir: Path) -> dict[str, dict[str, int]]:
    """Per shard, over the rows of the committed parts (listed in state.sqlite, read from Parquet)."""
    with sqlite3.connect(run_dir / "state.sqlite") as db:
        parts = db.execute("SELECT shard_id, path FROM parts").fetchall()
    sums: dict[str, dict[str, int]] = defaultdict(lambda: {"done": 0, "output_tokens": 0, "truncated": 0})
    for shard_id, path in parts:
        t = pq.read_table(run_dir / path, columns=["output_len", "finish_reason"])
        s = sums[shard_id]
        s["done"] += t.num_rows
        s["output_tokens"] += sum(t.column("output_len").to_pylist())
        s["truncated"] += sum(1 for fr in t.column("finish_reason").to_pylist() if fr == "length")
    return dict(sums)


def shard_figures(shards: list[dict]) -> dict[str, dict[str, int]]:
    return {sh["id"]: {"done": sh["done"], "output_tokens": sh["output_tokens"], "truncated": sh["truncated"]}
            for sh in shards if sh["done"]}


def steady_status(run_dir: Path, read) -> tuple[dict, dict]:
    """A status and the Parquet sums of the same committed state: read until no commit lands in between."""
    def attempt():
        before = read()
        sums = parquet_sums(run_dir)
        after = read()
        if before and after and before["dispatch"]["done"] == after["dispatch"]["done"] == sum(
                s["done"] for s in sums.values()):
            return before, sums
        return None
    return wait_for(attempt, 60, "a status with no commit landing while the Parquet files are read")


def check_against_parquet(st: dict, sums: dict) -> None:
    d = st["dispatch"]
    assert d["done"] == sum(s["done"] for s in sums.values())
    assert d["output_tokens"] == sum(s["output_tokens"] for s in sums.values())
    assert shard_figures(st["shards"]) == sums
    assert d["total"] == sum(sh["total"] for sh in st["shards"]) and d["done"] <= d["total"]


class ConsoleModel:
    """The TUI's model (console.view.model.RunModel) fed the way RegenApp feeds it, without Textual: the app's follow
    loop (console.host.follow.RunFollower over a HostSource on the local transport, an hour of backfill) folds status
    replies with apply_status and telemetry with apply, and while connected the status is asked again every
    STATUS_EVERY_S (RegenApp.poll_status). It runs on its own event loop in a thread; `figures()` reads it there.

    watch_ended=False: attach once and stop when the run's stream ends (an operator opening the console on a dead
    run); True: stay attached across the supervisor's death and restarts (a console left open), checking every
    `ended_check_s` whether the run runs again (the app: ENDED_CHECK_S)."""

    def __init__(self, run_dir: Path, *, watch_ended: bool, ended_check_s: float = 3.0):
        self.model = RunModel("local", str(run_dir))
        self.source = HostSource("local", str(run_dir), host_python=sys.executable, transport=LocalTransport())
        self.states: list = []  # the follow loop's states (connected, ended, ...) and warnings, for failure messages
        self.follower = RunFollower(self.source, since=time.time() - BACKFILL_S, on_status=self.model.apply_status,
                                    on_state=self._on_state, on_warning=self.states.append,
                                    backoff=Backoff(first_s=0.5, max_s=2.0), ended_check_s=ended_check_s,
                                    watch_ended=watch_ended)
        self.loop = asyncio.new_event_loop()
        self.error: BaseException | None = None
        self.ended = threading.Event()  # the follow loop returned (watch_ended=False: the run's stream ended)
        self._task: asyncio.Task | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _on_state(self, st) -> None:
        self.states.append(st)
        self.model.connection.state = st.state

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._task = self.loop.create_task(self._feed())
        try:
            self.loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass  # close() cancelled the feed
        except BaseException as exc:  # noqa: BLE001 - kept, and raised by figures()
            self.error = exc
        finally:
            self.loop.run_until_complete(self.source.transport.close())
            self.loop.close()
            self.ended.set()

    async def _feed(self) -> None:
        poller = asyncio.ensure_future(self._poll_status())
        try:
            async for ev in self.follower.events():
                self.model.apply(ev)
        finally:
            poller.cancel()

    async def _poll_status(self) -> None:
        """RegenApp.poll_status: while connected, the status reply every STATUS_EVERY_S."""
        while True:
            await asyncio.sleep(STATUS_EVERY_S)  # the app's timer interval (what is simulated), not a wait
            if self.model.connection.state != "connected":
                continue
            try:
                self.model.apply_status(await self.source.status())
            except SourceError as exc:
                self.states.append(f"status poll: {exc}")

    def figures(self) -> dict:
        """What the model shows: done/total, output tokens, per shard (those with samples done), the state."""
        if self.error is not None:
            raise AssertionError(f"the console's follow loop failed: {self.error!r}")

        def read():
            m = self.model
            return {"done": m.done, "total": m.total,
                    "output_tokens": m.dispatch.output_tokens if m.dispatch is not None else None,
                    "shards": {s.id: {"done": s.done, "output_tokens": s.output_tokens, "truncated": s.truncated}
                               for s in m.shards.values() if s.done},
                    "shard_totals": sum(s.total for s in m.shards.values()),
                    "state": m.state, "running": m.running, "last_ts": m.last_ts, "follow": self.states[-3:]}
        if not self.ended.is_set():
            try:
                return asyncio.run_coroutine_threadsafe(_call(read), self.loop).result(30)
            except RuntimeError:  # the loop closed meanwhile: the feed ended
                self.ended.wait(30)
        return read()

    def close(self) -> None:
        if not self.ended.is_set() and self._task is not None:
            try:
                self.loop.call_soon_threadsafe(self._task.cancel)
            except RuntimeError:
                pass  # the loop closed meanwhile: the feed ended on its own
        self.thread.join(30)


async def _call(fn):
    return fn()


def model_matches(figures: dict, sums: dict) -> bool:
    return (figures["done"] == sum(s["done"] for s in sums.values())
            and figures["output_tokens"] == sum(s["output_tokens"] for s in sums.values())
            and figures["shards"] == sums and figures["total"] == figures["shard_totals"])


def model_difference(figures: dict, sums: dict) -> str:
    want = {"done": sum(s["done"] for s in sums.values()),
            "output_tokens": sum(s["output_tokens"] for s in sums.values())}
    shards = {sid: (figures["shards"].get(sid), s) for sid, s in sums.items() if figures["shards"].get(sid) != s}
    shards.update({sid: (f, None) for sid, f in figures["shards"].items() if sid not in sums})
    return (f"the console model shows done {figures['done']}/{figures['total']} (shard totals "
            f"{figures['shard_totals']}), output tokens {figures['output_tokens']}, state {figures['state']} (follow "
            f"loop: {figures['follow']}); the Parquet sums are {want}; shards that differ (model, Parquet): {shards}")


def wait_model_equals_parquet(console: ConsoleModel, run_dir: Path, what: str, timeout: float = 30) -> dict:
    seen: dict = {}

    def equal():
        seen["figures"], seen["sums"] = console.figures(), parquet_sums(run_dir)
        return seen["figures"] if model_matches(seen["figures"], seen["sums"]) else None

    return wait_until(equal, timeout, what, interval=0.2,
                      describe=lambda: model_difference(seen["figures"], seen["sums"]))


@pytest.fixture
def consoles(monkeypatch):
    """ConsoleModel(run_dir, ...) factory; every one is closed at the end. The console runs engine.ctl on this
    machine with this checkout's engine and the host's `python3` (no .regen/launch.json: the supervisor is started
    by the tests, as in status_cli): this interpreter."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    made: list[ConsoleModel] = []

    def make(run_dir: Path, **kwargs) -> ConsoleModel:
        made.append(ConsoleModel(run_dir, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_three_sigkill_restarts_keep_every_figure_equal_to_the_parquet_sums(tmp_path, tiny_model_dir, supervisors,
                                                                            consoles):
    """... and a console left open throughout (the TUI's RunModel fed as the TUI feeds it) shows the same figures
    after each kill, and after each restart once the run is held still (every shard paused, nothing in flight)."""
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=400, gpus=1, sim=SLOW_SIM)
    done_before = 0
    kept_open = None
    for restart in range(4):
        sup = supervisors(run_dir).start(cfg if restart == 0 else None)
        wait_for(lambda: quick_state(run_dir) == "running", 120, "a running supervisor", sup)
        if kept_open is None:
            kept_open = consoles(run_dir, watch_ended=True)
        if restart:
            # right after a restart: no ETA (nothing measured since this start), every committed figure is there
            first = live_status(run_dir)
            assert first["dispatch"]["eta_s"] is None, first["dispatch"]
            assert first["dispatch"]["done"] >= done_before > 0
            st, sums = steady_status(run_dir, lambda: live_status(run_dir))
            check_against_parquet(st, sums)
            # the console left open follows the restarted run; held still (every shard paused, nothing in flight)
            # it shows the Parquet sums
            wait_until(lambda: kept_open.figures()["running"] and kept_open.figures()["state"] == "running", 60,
                       f"the console left open to follow restart {restart}", describe=lambda: str(kept_open.figures()))
            assert ctl(run_dir, "pause", "--all").returncode == 0
            wait_for(lambda: ((live_status(run_dir) or {}).get("dispatch") or {}).get("in_flight") == 0, 60,
                     "nothing in flight", sup)
            wait_model_equals_parquet(kept_open, run_dir, f"the console left open to show the Parquet sums after "
                                      f"restart {restart}", timeout=STATUS_EVERY_S + 20)
            assert ctl(run_dir, "resume", "--all").returncode == 0
        # let it commit more than before, then kill it mid-dispatch
        target = done_before + 20
        wait_for(lambda: ((live_status(run_dir) or {}).get("dispatch") or {}).get("done", 0) >= target, 120,
                 f"{target} committed samples", sup)
        st = status(run_dir)  # over engine.ctl, as the console asks
        assert st["dispatch"]["output_tokens"] > 0 and st["dispatch"]["done"] >= target
        sup.kill()
        out = status_cli(run_dir, tmp_path, "--json")
        assert out.stdout, out.stderr
        offline = json.loads(out.stdout)
        sums = parquet_sums(run_dir)
        check_against_parquet(offline, sums)
        assert offline["dispatch"]["eta_s"] is None and offline["dispatch"]["tokens_per_s"] is None
        assert not [sh for sh in offline["shards"] if sh["state"] == "running"]
        wait_model_equals_parquet(kept_open, run_dir, f"the console left open to show the Parquet sums after "
                                  f"kill {restart + 1}")
        done_before = offline["dispatch"]["done"]
    # the last round: the rate becomes measurable and an ETA appears, then stop: no rate, no ETA, nothing running
    sup = supervisors(run_dir).start()
    wait_for(lambda: ((live_status(run_dir) or {}).get("dispatch") or {}).get("eta_s") is not None, 120,
             "a measurable ETA", sup)
    assert ctl(run_dir, "stop").returncode == 0
    assert sup.wait(60) == 0, sup.log_text()[-3000:]
    human = status_cli(run_dir, tmp_path)
    said = " ".join(human.stdout.split())
    assert "- tok/s" in said and "ETA -" in said, said
    offline = json.loads(status_cli(run_dir, tmp_path, "--json").stdout)
    check_against_parquet(offline, parquet_sums(run_dir))
    assert offline["state"] == "stopped" and offline["dispatch"]["eta_s"] is None
    assert {sh["state"] for sh in offline["shards"]} <= {"done", "stopped", "pending"}
    last_shard_events = {ev["id"]: ev for ev in events(run_dir) if ev["type"] == "shard"}
    assert not [ev for ev in last_shard_events.values() if ev["state"] == "running"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_ends_at_done_equal_total_with_every_shard_done_and_its_last_event_the_parquet_sums(tmp_path):
    """The demo's too-long prompt is rejected at dispatch time (it does not fit the context): it settles its shard,
    counts apart as a rejected sample, and is one of the rows of rejects.jsonl (with the three bad input rows)."""
    run_dir = tmp_path / "demo"
    r = regen("demo", "--quick", "--headless", "--until-done", "--gpus", "2", "--prompts", "120", "--run-dir", str(run_dir),
              "--sim-arg=--sim-step-ms", "--sim-arg=2", home=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = status_cli(run_dir, tmp_path, "--json")
    st = json.loads(out.stdout)
    d = st["dispatch"]
    assert st["state"] == "done" and d["done"] == d["total"] > 0, d
    # besides it, the later turns of conversations whose turn was cut at max_new_tokens (turns_after_cut = "stop")
    cut = d["after_cut"]
    assert d["rejected"] == 1 + cut and d["planned"] == d["total"] + d["rejected"] + d["failed"]
    assert {sh["state"] for sh in st["shards"]} == {"done"}
    assert [sh["rejected"] - sh["after_cut"] for sh in st["shards"] if sh["rejected"] - sh["after_cut"]] == [1]
    assert st["rejects"]["total"] == 4 + cut and st["rejects"]["by_reason"].get("context_overflow") == 1
    assert st["rejects"]["by_reason"].get("after_cut", 0) == cut
    sums = parquet_sums(run_dir)
    check_against_parquet(st, sums)
    last = {ev["id"]: ev for ev in events(run_dir) if ev["type"] == "shard"}
    assert {sid: (ev["state"], ev["done"], ev["output_tokens"], ev["truncated"]) for sid, ev in last.items()} == {
        sid: ("done", s["done"], s["output_tokens"], s["truncated"]) for sid, s in sums.items()}
    human = " ".join(status_cli(run_dir, tmp_path).stdout.split())
    assert f"done: {d['done']}/{d['total']} samples (100.0%)" in human and f"rejected samples {1 + cut}" in human, human


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_running_shards_telemetry_events_follow_its_commits(tmp_path, tiny_model_dir, supervisors):
    """While a shard runs, telemetry.jsonl gets `shard` events with its growing figures (a tick after its commits),
    not only the events of its state changes."""
    run_dir = tmp_path / "run"
    # ~3 samples/s: the first shard (~70 samples) stays running for ~20 s, ten ticks
    sim = ("--sim-output-mean", "60", "--sim-step-ms", "40", "--sim-tokens-per-step", "2",
           "--max-running-requests", "4")
    sup = supervisors(run_dir).start(make_config(run_dir, tiny_model_dir, prompts=200, gpus=1, sim=sim))

    def shard_events(state: str | None = None) -> list[dict]:
        if not (run_dir / "telemetry.jsonl").exists():
            return []  # the supervisor has not written its first event yet
        return [ev for ev in events(run_dir) if ev["type"] == "shard" and ev["id"] == "s00000"
                and (state is None or ev["state"] == state)]

    def status_now() -> list[dict]:
        return [sh for sh in (live_status(run_dir) or {}).get("shards", []) if sh["id"] == "s00000"]

    first = wait_for(lambda: next(iter(shard_events("running")), None), 120, "s00000 running", sup)
    later = wait_until(lambda: [ev for ev in shard_events("running") if ev["done"] > first["done"]], 12,
                       "a later `shard` event of s00000 with more samples done, while it runs",
                       describe=lambda: f"s00000's events: {shard_events()}; its status now: {status_now()}")
    assert later[-1]["output_tokens"] > first["output_tokens"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_console_opened_after_a_sigkill_shows_the_parquet_sums(tmp_path, tiny_model_dir, supervisors, consoles):
    """`regen tui` opened on a run whose supervisor was SIGKILLed shows done, output tokens and each shard's figures
    equal to the committed Parquet rows (as `regen status` does)."""
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(make_config(run_dir, tiny_model_dir, prompts=400, gpus=1, sim=SLOW_SIM))
    wait_for(lambda: ((live_status(run_dir) or {}).get("dispatch") or {}).get("done", 0) >= 40, 120,
             "40 committed samples", sup)
    sup.kill()
    offline = json.loads(status_cli(run_dir, tmp_path, "--json").stdout)
    sums = parquet_sums(run_dir)
    check_against_parquet(offline, sums)  # what `regen status` shows is true
    console = consoles(run_dir, watch_ended=False)
    assert console.ended.wait(60), f"the console's follow loop did not end on a dead run: {console.figures()}"
    figures = console.figures()
    assert model_matches(figures, sums), model_difference(figures, sums)
