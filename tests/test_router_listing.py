"""The router as the dispatcher's target is ready only once SGLang's router (sglang-router 0.3.2) lists the servers it
was given; its own list says how many requests it has open on each server where its policy counts them; and a 503 "No
available workers" (a request that reached no server) is no attempt of the sample."""
from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from engine.config.load import Dispatch, Router, RunConfig
from engine.placement.hosts.remote_worker import RemoteWorker
from engine.placement.router import ListedWorker, RouterEndpoint, RouterProcess, parse_listing
from engine.run.dispatch.loop import Dispatcher
from engine.servers.capacity import ServerCapacity
from engine.api.wire import WorkerState
from engine.servers.launch import WorkerSpec
from engine.api.wire import InFlightSource, in_flight_text
from tests.sim_fixtures import start_sim  # noqa: F401  (fixture)
from tests.sshd_fixtures import free_port
from tests.test_dispatcher_requeue import RecordingOutcomes, make_item
from tests.waiting import await_until

pytestmark = pytest.mark.timeout(60)

NO_WORKERS = {"error": {"type": "Service Unavailable", "code": "no_available_workers",
                        "message": "No available workers (all circuits open or unhealthy)"}}


def test_the_routers_list_is_read_by_url_with_health_and_load():
    listed = parse_listing({"workers": [
        {"id": "a1", "url": "http://h:1", "is_healthy": True, "load": 12, "worker_type": "regular"},
        {"id": "b2", "url": "http://h:2", "is_healthy": False, "load": 0},
        {"id": "c3", "url": "http://h:3"}], "total": 3})
    assert listed == {"http://h:1": ListedWorker("http://h:1", "a1", True, 12),
                      "http://h:2": ListedWorker("http://h:2", "b2", False, 0),
                      "http://h:3": ListedWorker("http://h:3", "c3", True, None)}
    with pytest.raises(ValueError, match="no `workers` list"):
        parse_listing({"error": "nope"})
    with pytest.raises(ValueError, match="without a url"):
        parse_listing({"workers": [{"id": "x"}]})


class _Router:
    """RouterProcess's membership side, without a process."""
    url = "http://127.0.0.1:30500"
    headers: dict = {}
    restarts = 0
    error = None

    def __init__(self, policy: str):
        self.up = True
        self.members: set[str] = set()
        self.listed: dict[str, ListedWorker] = {}
        self.counts_load = policy == "cache_aware"

    def routes_to(self, url: str) -> bool:
        return self.up and url in self.members and url in self.listed and self.listed[url].healthy

    def load_of(self, url: str):
        return self.listed[url].load if self.counts_load and self.routes_to(url) else None


def _member(name: str, port: int) -> RemoteWorker:
    m = RemoteWorker(spec=WorkerSpec(name=name, gpus=(0,), host="127.0.0.1", port=port), host=name.split(".")[0],
                     url=f"http://127.0.0.1:{port}", headers={})
    m.capacity_info = ServerCapacity(max_running_requests=16, context_length=4096)
    m.state = WorkerState.READY
    return m


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_the_endpoint_waits_for_the_routers_list_and_attributes_in_flight_per_server(policy):
    router = _Router(policy)
    a, b = _member("h1.gpu0", 40000, ), _member("h2.gpu0", 40001)
    ep = RouterEndpoint(router, members=[a, b])
    router.members = {a.url, b.url}  # given to the router (POST /workers answered 202) ...
    ep.refresh()
    assert ep.state == WorkerState.STARTING  # ... but not listed by it yet: no request would reach a server
    assert (a.in_flight, b.in_flight) == (None, None)
    router.listed = {a.url: ListedWorker(a.url, "1", True, 7)}
    ep.refresh()
    assert ep.state == WorkerState.READY and ep.capacity_info.max_running_requests == 16  # only the listed one
    if policy == "cache_aware":
        assert (a.in_flight, a.in_flight_source) == (7, InFlightSource.ROUTER)
        assert b.in_flight is None  # not routed to: nothing live
        assert in_flight_text(a.in_flight, a.capacity, a.in_flight_source) == "7 (router)"
    else:
        assert (a.in_flight, a.in_flight_source) == (None, InFlightSource.UNKNOWN)  # the router keeps no count
        assert in_flight_text(a.in_flight, a.capacity, a.in_flight_source, 96) == "N/A (router 96)"
    assert a.snapshot().in_flight == a.in_flight and a.snapshot().in_flight_source == a.in_flight_source


async def test_a_503_no_available_workers_is_no_attempt_and_pauses_the_router_target():
    answers = {"n": 0}

    async def generate(request: web.Request) -> web.Response:
        answers["n"] += 1
        return web.json_response(NO_WORKERS, status=503)

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    relisted = []
    target = SimpleNamespace(name="router", url=f"http://127.0.0.1:{port}", headers={}, listeners=[], is_router=True,
                             no_servers=lambda: relisted.append(1))
    cfg = RunConfig(run_dir="/nonexistent", model="/nonexistent", prompts=("/nonexistent",),
                    dispatch=Dispatch(retry_backoff_s=2.0))
    plan = RecordingOutcomes()
    events: list[object] = []
    try:
        async with aiohttp.ClientSession() as session:
            d = Dispatcher(cfg, queue=SimpleNamespace(worker_ready=lambda *a: None), workers=[target], deliver=plan,
                           renderer=None, session=session, emit=events.append)
            item = make_item("c#turn0", [1, 2, 3])
            await d._send(target, item)
            await d._send(target, item)
    finally:
        await runner.cleanup()
    assert answers["n"] == 2 and plan.failed == []
    assert plan.requeued == ["c#turn0", "c#turn0"]  # the same rid: no attempt counted
    assert (d.retried, d.answers.unrouted, item.attempt) == (0, 2, 0)
    assert relisted == [1, 1]  # the router's list is read again at once
    assert d.pauses.paused("router", now=0.0)  # a pause was set: the router takes no new work for a moment
    assert not events  # an alert only once it lasts (UNROUTED_ALERT_AFTER in a row)


def test_a_503_of_a_server_is_still_a_retry():
    from engine.run.dispatch.client import no_servers

    assert no_servers(b'{"object": "error", "message": "The scheduler is dead.", "type": "503", "code": 503}') is False
    assert no_servers(b'{"error": {"code": "no_available_workers", "message": "x"}}') is True
    assert no_servers(b"No available workers") is True


async def test_the_real_router_lists_a_server_about_a_second_after_it_was_given(start_sim, tmp_path):
    """sglang-router 0.3.2: POST /workers is 202 (queued); routes_to turns true only once GET /workers lists it, and
    under cache_aware the list carries the router's count of the requests open on it."""
    sim = await start_sim(sim_step_ms=20.0, sim_output_mean=200)
    cfg = RunConfig(run_dir=str(tmp_path), model="/nonexistent", prompts=("/nonexistent",),
                    router=Router(policy="cache_aware", port=free_port(), prometheus_port=free_port(),
                                  python=sys.executable))
    async with aiohttp.ClientSession() as session:
        router = RouterProcess(cfg, tmp_path, session, emit=lambda _: None)
        changes: list[bool] = []
        router.on_change = lambda: changes.append(router.routes_to(sim.url))
        await router.start()
        try:
            await router.add(sim.url)
            assert not router.routes_to(sim.url)  # accepted, not listed yet
            await await_until(lambda: router.routes_to(sim.url), 15, "the router listing the server")
            assert changes[-1] is True
            posts = [asyncio.create_task(session.post(router.url + "/generate", json={
                "input_ids": [1, 2, 3, i], "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}))
                for i in range(5)]
            await await_until(lambda: router.load_of(sim.url) == 5, 15, "the router's count of the 5 open requests")
            for resp in await asyncio.gather(*posts):
                assert resp.status == 200
                resp.release()
            await router.remove(sim.url)
            assert not router.routes_to(sim.url)  # at once, whatever the router still lists
        finally:
            await router.stop()


def test_once_ready_a_list_that_drops_every_server_for_a_moment_cancels_nothing():
    """The router's own health check may drop a busy server from its list: the endpoint stays ready (its requests
    open through the router are not cancelled and re-sent as retries); a new request answered 503 goes back to the
    queue without an attempt (above). A server that leaves regen's side (its host lost) does end it."""
    router = _Router("cache_aware")
    a = _member("h1.gpu0", 40000)
    ep = RouterEndpoint(router, members=[a])
    seen = []
    ep.listeners.append(lambda _, state: seen.append(state))
    router.members = {a.url}
    router.listed = {a.url: ListedWorker(a.url, "1", True, 3)}
    ep.refresh()
    router.listed = {a.url: ListedWorker(a.url, "1", False, 3)}  # unhealthy in the router's eyes
    ep.refresh()
    assert ep.state == WorkerState.READY and seen == [WorkerState.READY]
    assert ep.capacity_info.max_running_requests == 16 and a.in_flight is None  # not listed: its count not known
    a.state = WorkerState.LOST
    router.members = set()
    ep.refresh()
    assert seen == [WorkerState.READY, WorkerState.STARTING]
    # and ready again only once the router lists a server again
    a.state = WorkerState.READY
    router.members = {a.url}
    ep.refresh()
    assert ep.state == WorkerState.STARTING
    router.listed = {a.url: ListedWorker(a.url, "1", True, 0)}
    ep.refresh()
    assert ep.state == WorkerState.READY
