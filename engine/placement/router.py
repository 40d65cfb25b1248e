"""SGLang's router on the dispatch host, and the one dispatch target it becomes for the dispatcher.

The router starts with no workers; the fleet adds and removes servers through its API. A server counts as routed only
once the router's own list shows it healthy (it queues an addition for about a second), and its in-flight count is the
router's `load` only under the policies that keep one (LOAD_COUNTING_POLICIES); otherwise it is None, not 0.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import aiohttp

from engine.servers.capacity import BatchSize, ServerCapacity
from engine.config.load import RunConfig
from engine.servers.metrics_client import ServerMetrics
from engine.api.events import AlertEvent, Event, WorkerEvent
from engine.api.wire import InFlightSource
from engine.api.wire import WorkerState
from engine.servers.launch import die_with_parent
from engine.servers.server_log import log_tail
from engine.servers.worker_event import served_fields, with_batch
from engine.api.wire import Severity

if TYPE_CHECKING:
    from engine.run.counts import ServedTokens

log = logging.getLogger("regen.router")

LIST_EVERY_S = 1.0  # the router's own list of servers (health, load) is read this often
LIST_WAITING_S = 0.2  # ... and this often while a server given to it is not listed healthy yet
# the policies under which sglang-router 0.3.2 counts the requests it has open on each server (GET /workers `load`):
# measured against the simulator, 12 requests open: cache_aware 12, round_robin and random 0 (they keep no count)
LOAD_COUNTING_POLICIES = frozenset({"cache_aware"})


@dataclass(frozen=True)
class ListedWorker:
    """One server as the router lists it (GET /workers)."""
    url: str
    id: str
    healthy: bool
    load: int | None  # requests the router has open on it (counted under LOAD_COUNTING_POLICIES only)


def parse_listing(data: object) -> dict[str, ListedWorker]:
    """GET /workers' reply ({"workers": [{"id", "url", "is_healthy", "load", ...}], ...}) by URL; ValueError naming
    what is not as expected."""
    if not isinstance(data, dict) or not isinstance(data.get("workers"), list):
        raise ValueError(f"GET /workers: no `workers` list in {str(data)[:200]}")
    out: dict[str, ListedWorker] = {}
    for w in data["workers"]:
        if not isinstance(w, dict) or not isinstance(w.get("url"), str):
            raise ValueError(f"GET /workers: an entry without a url: {str(w)[:200]}")
        load = w.get("load")
        out[w["url"]] = ListedWorker(url=w["url"], id=str(w.get("id", "")), healthy=w.get("is_healthy") is not False,
                                     load=load if isinstance(load, int) and not isinstance(load, bool) else None)
    return out


class RouterError(Exception):
    """The router could not be started or did not accept a change; the message says why."""


def router_argv(cfg: RunConfig) -> list[str]:
    r = cfg.router
    python = r.python or cfg.host_python
    argv = [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(r.port),
            "--policy", r.policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(r.prometheus_port or r.port + 1),
            "--log-level", "warn"]
    if cfg.workers.api_key:
        argv += ["--api-key", cfg.workers.api_key]
    return argv + list(r.extra_args)


class RouterProcess:
    def __init__(self, cfg: RunConfig, run_dir: Path, session: aiohttp.ClientSession, emit: Callable[[Event], None]):
        self.cfg = cfg
        self.session = session
        self.emit = emit
        self.url = f"http://127.0.0.1:{cfg.router.port}"
        self.log_path = run_dir / "router" / "router.log"
        self.members: set[str] = set()  # worker URLs that should be in the router
        self.listed: dict[str, ListedWorker] = {}  # what the router itself listed last (GET /workers), by URL
        self.listing_error: str | None = None  # why the last GET /workers failed (None: it answered)
        self._list_wake = asyncio.Event()
        self._lister: asyncio.Task | None = None
        self.up = False
        self.restarts = 0
        self.error: str | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task | None = None
        self._stopping = False
        self.on_change: Callable[[], None] = lambda: None

    @property
    def headers(self) -> dict[str, str]:
        key = self.cfg.workers.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def start(self) -> None:
        await self._launch()
        self._watch = asyncio.create_task(self._supervise(), name="router")
        self._lister = asyncio.create_task(self._list_loop(), name="router-list")

    # -- the router's own list: which servers it routes to, and its count of each one's requests --------------
    def routes_to(self, url: str) -> bool:
        """The router is up, `url` is one of the servers given to it, and the router lists it healthy: a request
        sent to the router now can be routed there."""
        listed = self.listed.get(url)
        return self.up and url in self.members and listed is not None and listed.healthy

    @property
    def counts_load(self) -> bool:
        return self.cfg.router.policy in LOAD_COUNTING_POLICIES

    def load_of(self, url: str) -> int | None:
        """The requests the router has open on server `url`; None where it keeps no count (its policy) or does not
        route there."""
        listed = self.listed.get(url)
        return listed.load if self.counts_load and listed is not None and self.routes_to(url) else None

    def relist_soon(self) -> None:
        """Read the router's list now, not at the next interval."""
        self._list_wake.set()

    def _waiting_for_listing(self) -> bool:
        return self.up and any(not self.routes_to(url) for url in self.members)

    async def _list_loop(self) -> None:
        while not self._stopping:
            if self.up:
                await self.relist()
            self._list_wake.clear()
            try:
                await asyncio.wait_for(self._list_wake.wait(),
                                       LIST_WAITING_S if self._waiting_for_listing() else LIST_EVERY_S)
            except asyncio.TimeoutError:
                pass  # time for the next read

    async def relist(self) -> None:
        """Read the router's list; a change in the servers it routes to is passed on (on_change)."""
        try:
            async with self.session.get(self.url + "/workers", headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=10)) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise ValueError(f"GET /workers -> HTTP {resp.status}: {text[:200]}")
                listed = parse_listing(json.loads(text))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            if error != self.listing_error:
                log.warning("router: cannot read its list of servers: %s", error)
            self.listing_error = error
            return
        if self.listing_error is not None:
            log.info("router: its list of servers is read again")
        self.listing_error = None
        before = {u for u in self.members if self.routes_to(u)}
        self.listed = listed
        after = {u for u in self.members if self.routes_to(u)}
        if before != after:
            log.info("router: routes to %d of %d servers given to it%s%s", len(after), len(self.members),
                     f"; now listed: {', '.join(sorted(after - before))}" if after - before else "",
                     f"; no longer: {', '.join(sorted(before - after))}" if before - after else "")
            self.on_change()

    async def _launch(self) -> None:
        argv = router_argv(self.cfg)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            offset = logf.seek(0, os.SEEK_END)
            logf.write(f"[regen {time.strftime('%Y-%m-%d %H:%M:%S')}] launching: {shlex.join(argv)}\n".encode())
            logf.flush()
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    *argv, stdout=logf, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True, preexec_fn=die_with_parent)
            except OSError as exc:
                raise RouterError(f"cannot launch the router ({argv[0]}): {exc}") from exc
        deadline = time.monotonic() + self.cfg.router.ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.returncode is not None:
                tail = " | ".join(log_tail(self.log_path, offset, 6))
                hint = (" (sglang-router is not installed for that python: pip install sglang-router)"
                        if "No module named" in tail else "")
                raise RouterError(f"the router exited with {self._proc.returncode} during startup: {tail}{hint}")
            try:
                async with self.session.get(self.url + "/liveness", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        break
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass  # not listening yet
            await asyncio.sleep(0.2)
        else:
            raise RouterError(f"the router did not answer /liveness within {self.cfg.router.ready_timeout_s:.0f} s")
        self.listed = {}  # a new router lists nothing until it is given the servers again
        self.up, self.error = True, None
        log.info("router pid %d up at %s (policy %s)", self._proc.pid, self.url, self.cfg.router.policy)
        for url in sorted(self.members):
            await self._post(url)
        self._list_wake.set()
        self.on_change()

    async def _supervise(self) -> None:
        while not self._stopping:
            proc = self._proc  # the latest launch's (a relaunch below replaces it)
            if proc is None:
                raise RuntimeError("the router is supervised before it was launched (start() launches it first)")
            await proc.wait()
            if self._stopping:
                return
            self.up = False
            self.listed = {}
            self.error = f"router exited with {proc.returncode}"
            self.on_change()
            self.emit(AlertEvent(severity=Severity.ERROR, text="the router exited; restarting it",
                                 evidence=" | ".join(log_tail(self.log_path, 0, 6)), key="router-exit"))
            while not self._stopping:
                await asyncio.sleep(min(30.0, 2.0 ** min(self.restarts, 5)))
                self.restarts += 1
                try:
                    await self._launch()
                    break
                except RouterError as exc:
                    self.error = str(exc)
                    log.error("%s", exc)

    def closing(self) -> None:
        """The run is ending: the router goes with every server in it, so servers stopping now are not removed one by
        one (a DELETE racing the router's own stop fails)."""
        self._stopping = True

    async def stop(self) -> None:
        self._stopping = True
        for task in (self._watch, self._lister):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        proc = self._proc
        if proc is not None and proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                await asyncio.wait_for(proc.wait(), 10)
            except (ProcessLookupError, asyncio.TimeoutError):
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # exited meanwhile
        self.up = False
        self.listed = {}

    # -- membership ---------------------------------------------------------------------------
    async def add(self, url: str) -> None:
        """Give the router server `url`; it is routed to once the router lists it (routes_to), read at once."""
        async with self._lock:
            self.members.add(url)
            if self.up:
                await self._post(url)
                self._list_wake.set()

    async def remove(self, url: str) -> None:
        async with self._lock:
            self.members.discard(url)
            self.listed.pop(url, None)  # not routed to from now on, whatever the router still lists
            if not self.up or self._stopping:  # stopping: the router goes with every server in it
                return
            for wid in await self._ids_for(url):
                try:
                    async with self.session.delete(f"{self.url}/workers/{wid}", headers=self.headers,
                                                   timeout=aiohttp.ClientTimeout(total=10)) as resp:
                        body = await resp.text()
                        if resp.status >= 300:
                            log.error("router: DELETE /workers/%s (%s) -> %d %s", wid, url, resp.status, body[:200])
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    log.error("router: removing %s failed: %s", url, exc)
            log.info("router: removed %s", url)

    async def _post(self, url: str) -> None:
        if await self._ids_for(url):
            return
        try:
            async with self.session.post(self.url + "/workers", json={"url": url, **(
                    {"api_key": self.cfg.workers.api_key} if self.cfg.workers.api_key else {})},
                    headers=self.headers, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                body = await resp.text()
                if resp.status >= 300:
                    raise RouterError(f"router refused worker {url}: HTTP {resp.status} {body[:200]}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise RouterError(f"router: adding {url} failed: {exc}") from exc
        log.info("router: added %s", url)

    async def _ids_for(self, url: str) -> list[str]:
        try:
            async with self.session.get(self.url + "/workers", headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=10)) as resp:
                data = await resp.json(content_type=None)
            return [w["id"] for w in data.get("workers") or [] if w.get("url") == url]
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError, AttributeError) as exc:
            log.warning("router: GET /workers failed: %s", exc)
            return []


@dataclass
class RouterEndpoint:
    """The router as the dispatcher's one target (engine.servers.target.DispatchTarget): ready while the router is
    up with a ready member; its capacity is the sum of the ready members' (so the dispatcher keeps every server
    fed)."""
    router: RouterProcess
    name: str = "router"
    state: str = WorkerState.STARTING
    capacity_info: ServerCapacity = field(default_factory=ServerCapacity)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    in_flight: int = 0
    held: int = 0  # maintained by the dispatcher: regen's queued items held for it
    capacity: int = 0
    batch: BatchSize | None = None  # maintained by the dispatcher
    listeners: list[Callable[["RouterEndpoint", str], None]] = field(default_factory=list)
    members: list = field(default_factory=list)  # RemoteWorker / Worker objects behind the router
    served: ServedTokens | None = None  # the ledger's ServedTokens of everything sent through it (set by the supervisor)

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def headers(self) -> dict[str, str]:
        return self.router.headers

    def routed(self) -> list:
        """The ready servers the router routes to now (given to it, and listed by it healthy)."""
        return [m for m in self.members if m.state == WorkerState.READY and self.router.routes_to(m.url)]

    def serving(self) -> list:
        """The servers the endpoint's capacity counts: those the router lists. The endpoint turns ready only once the
        router lists one (before that every request would be answered 503 "No available workers"); once ready, a
        list that drops every server for a moment (the router's own health check) leaves it ready with the servers
        given to it: requests open through the router may still be answered and are not cancelled for it, and a new
        one answered 503 goes back to regen's queue without an attempt (engine.run.dispatch.answers)."""
        routed = self.routed()
        if routed or self.state != WorkerState.READY:
            return routed
        return [m for m in self.members if m.state == WorkerState.READY and m.url in self.router.members]

    @property
    def is_router(self) -> bool:
        return True

    @property
    def queue_margin(self) -> int:
        """Half a batch queued per ready server: the router picks servers without seeing their free slots."""
        return sum(max(2, m.capacity_info.batch().size // 2) for m in self.serving())

    def no_servers(self) -> None:
        """The router answered 503 "No available workers": its list is read again now (the dispatcher holds the
        router's pulls meanwhile)."""
        self.router.relist_soon()

    def refresh(self) -> None:
        ready = self.serving()
        self._attribute(self.routed())
        batches = [m.capacity_info.batch() for m in ready]
        self.capacity_info = ServerCapacity(
            max_running_requests=sum(b.size for b in batches) or None,
            batch_source="+".join(sorted({b.source for b in batches})),
            context_length=_smallest(m.capacity_info.context_length for m in ready),
            max_total_num_tokens=_smallest(m.capacity_info.max_total_num_tokens for m in ready),
            max_req_input_len=_smallest(m.capacity_info.max_req_input_len for m in ready))
        running = [m.metrics.running_reqs for m in ready]
        queued = [m.metrics.queued_reqs for m in ready]
        self.metrics = ServerMetrics(
            running_reqs=sum(running) if ready and None not in running else None,
            queued_reqs=sum(queued) if ready and None not in queued else None,
            gen_throughput=sum(m.metrics.gen_throughput or 0.0 for m in ready) if ready else None)
        state = WorkerState.READY if self.router.up and ready else WorkerState.STARTING
        if state != self.state:
            log.info("router endpoint: %s -> %s (%d ready servers)", self.state, state, len(ready))
            self.state = state
            for listener in list(self.listeners):
                listener(self, state)

    def _attribute(self, routed: list) -> None:
        """Each server's in-flight figure behind the router: the router's own count of it where its policy keeps one;
        otherwise not known (None, the source says why), never 0. A server the router does not route to has none
        live (its host lost, its job ended, not admitted yet)."""
        routed_ids = {id(m) for m in routed}
        counts = self.router.counts_load
        for m in self.members:
            m.in_flight_source = InFlightSource.ROUTER if counts else InFlightSource.UNKNOWN
            m.in_flight = self.router.load_of(m.url) if id(m) in routed_ids and counts else None

    def snapshot(self) -> WorkerEvent:
        return with_batch(WorkerEvent(
            name=self.name, state=self.state, url=self.url, in_flight=self.in_flight, capacity=self.capacity,
            restarts=self.router.restarts, error=self.router.error, running_reqs=self.metrics.running_reqs,
            queued_reqs=self.metrics.queued_reqs, gen_throughput=self.metrics.gen_throughput,
            **served_fields(self.served)), self)


def _smallest(values) -> int | None:
    """The smallest of the figures the ready servers reported (None: none did): the one every server meets."""
    return min((v for v in values if v), default=None)
