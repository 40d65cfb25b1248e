"""The dispatcher hands every in-flight item back exactly once when its worker goes away.

A crashed server's requests fail on their own (connection reset) at about the moment the worker
is marked crashed; the two paths must not both re-queue the same item, or the same rid reaches the
restarted server twice and SGLang refuses the second one with 400 "Duplicate request ID(s)".
"""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import aiohttp
import pytest

from engine.config.load import Dispatch, RunConfig
from engine.text.ingest import Conversation
from engine.run.dispatch.loop import Dispatcher
from engine.run.items import Failed, Rejected, Retry, WorkItem
from tests.sim_fixtures import start_sim  # noqa: F401  (fixture)
from tests.waiting import await_until

pytestmark = pytest.mark.timeout(60)


class RecordingOutcomes:
    """The dispatcher's outcomes, as the ledger would receive them."""
    def __init__(self):
        self.requeued: list[str] = []
        self.failed: list[tuple[str, str, str]] = []

    def __call__(self, outcome) -> None:
        if isinstance(outcome, Retry):
            self.requeued.append(outcome.item.rid)
        elif isinstance(outcome, (Failed, Rejected)):
            self.failed.append((outcome.item.sample_id, type(outcome).__name__, outcome.reason))


def make_item(sample_id: str, prompt_ids: list[int]) -> WorkItem:
    conv = Conversation(conversation_id=sample_id.split("#")[0], source="test", origin="t", index=0,
                        messages=({"role": "user", "content": "hi"},))
    return WorkItem(sample_id=sample_id, conv=conv, turn=0, shard_id="s00000", prompt_ids=prompt_ids,
                    max_new_tokens=64, is_last_turn=True)


class ReadyWorkers:
    """The ledger's side of worker readiness, recorded (these tests pull nothing)."""
    def __init__(self):
        self.ready: dict[str, bool] = {}

    def worker_ready(self, name: str, ready: bool) -> None:
        self.ready[name] = ready


def make_dispatcher(session=None, url: str = "", backoff: float = 2.0):
    cfg = RunConfig(run_dir="/nonexistent", model="/nonexistent", prompts=("/nonexistent",),
                    dispatch=Dispatch(retry_backoff_s=backoff))
    worker = SimpleNamespace(name="gpu0", url=url, headers={}, listeners=[])
    events: list[object] = []
    plan = RecordingOutcomes()
    d = Dispatcher(cfg, queue=ReadyWorkers(), workers=[worker], deliver=plan, renderer=None, session=session, emit=events.append)
    return d, worker, plan, events


async def test_a_finished_task_whose_callback_has_not_run_is_not_requeued_again():
    d, w, plan, _ = make_dispatcher()
    settled = make_item("a#turn0", [1, 2])
    pending = make_item("b#turn0", [1, 2])
    never = asyncio.get_running_loop().create_future()

    async def settles_itself():
        d.answers.deliver(Retry(settled))  # what _send does on a connection reset

    async def waits_for_answer():
        await never

    done_task = asyncio.create_task(settles_itself())
    live_task = asyncio.create_task(waits_for_answer())
    await asyncio.wait([done_task], timeout=5)  # ran to completion; no dispatcher done-callback: as if pending
    assert done_task.done() and not live_task.done()
    d.inflight["gpu0"] = {done_task: settled, live_task: pending}

    d._on_worker_state(w, "crashed")
    d._on_worker_state(w, "starting")  # the relaunch notifies again: nothing is handed back twice
    await asyncio.wait([live_task], timeout=5)  # its cancellation delivered (or the assert below says not)

    assert plan.requeued == ["a#turn0", "b#turn0@1"]
    assert d.queue.ready == {"gpu0": False}  # the ledger hears it: what was held for gpu0 goes to the others
    assert live_task.cancelled()
    assert plan.failed == []


async def test_a_duplicate_rid_400_is_retried_with_an_alert_never_rejected(start_sim, tiny_tokenizer):
    sim = await start_sim(sim_step_ms=5.0, sim_output_mean=400)
    ids = tiny_tokenizer.encode("hello there")
    async with aiohttp.ClientSession() as session:
        first = asyncio.create_task(session.post(sim.url + "/generate", json={
            "rid": "c#turn0", "input_ids": ids, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}))
        await await_until(lambda: "c#turn0" in sim.server.in_flight_rids, 10, "the first c#turn0 in flight")
        d, w, plan, events = make_dispatcher(session, sim.url, backoff=0.01)
        await d._send(w, make_item("c#turn0", ids))
        await await_until(lambda: plan.requeued, 10, "the retry handed back")
        (await first).release()

    assert plan.failed == [], "a sample must not be rejected because the dispatcher sent its rid twice"
    assert plan.requeued == ["c#turn0@1"]
    alerts = [e for e in events if getattr(e, "key", "").startswith("duplicate-rid")]
    assert alerts and "c#turn0" in alerts[0].evidence and alerts[0].severity == "error"
    assert "refused a duplicate request id" in alerts[0].text


class ListQueue:
    """A ledger's ready queue reduced to a list; each pull's time recorded."""
    def __init__(self, items: list[WorkItem]):
        self.items = items
        self.pulls: list[float] = []

    def next_item(self, worker: str | None = None) -> WorkItem | None:
        if not self.items:
            return None
        self.pulls.append(time.monotonic())
        return self.items.pop(0)

    async def wait_item(self, timeout: float) -> None:
        await asyncio.sleep(timeout)

    def worker_ready(self, name: str, ready: bool) -> None:
        pass

    @property
    def queued(self) -> int:
        return len(self.items)

    def queued_for(self, worker: str) -> int:
        return 0


async def test_a_server_failing_every_request_takes_no_new_work_for_a_moment(start_sim, tiny_tokenizer):
    """A server whose scheduler died answers 503 at once: without a pause its loop passed regen's whole queue through
    it into retry backoff before the crash was seen, and the other servers had nothing to do."""
    from engine.placement.hosts.remote_worker import RemoteWorker
    from engine.run.dispatch.answers import FAULT_PAUSE_S
    from engine.servers.capacity import ServerCapacity
    from engine.api.wire import WorkerState
    from engine.servers.launch import WorkerSpec

    sim = await start_sim(sim_5xx_rate=1.0)
    ids = tiny_tokenizer.encode("hello there")
    queue = ListQueue([make_item(f"c{i}#turn0", ids) for i in range(200)])
    w = RemoteWorker(spec=WorkerSpec(name="gpu0", gpus=(0,), host="127.0.0.1", port=30000), host="", url=sim.url,
                     headers={})
    w.state, w.capacity_info = WorkerState.READY, ServerCapacity(max_running_requests=8)
    first_retry: list[float] = []
    plan = RecordingOutcomes()

    def deliver(outcome) -> None:
        if isinstance(outcome, Retry) and not first_retry:
            first_retry.append(time.monotonic())
        plan(outcome)

    cfg = RunConfig(run_dir="/nonexistent", model="/nonexistent", prompts=("/nonexistent",),
                    dispatch=Dispatch(retry_backoff_s=2.0, max_in_flight_per_worker=8))
    async with aiohttp.ClientSession() as session:
        d = Dispatcher(cfg, queue=queue, workers=[w], deliver=deliver, renderer=None, session=session,
                       emit=lambda _: None)
        d.start()
        try:
            await await_until(lambda: len(queue.pulls) > 8, 10, "a pull after the first ones failed")
        finally:
            await d.close()
    assert queue.pulls[8] - first_retry[0] >= FAULT_PAUSE_S * 0.9  # nothing pulled while the pause ran
    assert len(plan.requeued) < 50 and plan.failed == []
