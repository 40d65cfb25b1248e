"""A server on a remote host as the dispatch host sees it through its forward: its state (told to its listeners),
its live figures (dropped once its host is gone), and the /health and /metrics reads of it."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import aiohttp

from engine.api.events import WorkerEvent
from engine.api.tuning import LaunchTuning
from engine.api.wire import InFlightSource
from engine.servers.capacity import BatchSize, ServerCapacity
from engine.servers.metrics_client import ServerMetrics, parse_metrics
from engine.servers.target import SingleServer
from engine.servers.launch import WorkerSpec
from engine.api.wire import WorkerState
from engine.servers.worker_event import worker_event

if TYPE_CHECKING:
    from engine.run.counts import ServedTokens

log = logging.getLogger("regen.hosts")

ENDED = (WorkerState.CRASHED, WorkerState.FAILED)

# a server whose host (or job) is not there: what was last read of it is not live
GONE = (WorkerState.UNREACHABLE, WorkerState.LOST, WorkerState.STOPPED)


@dataclass
class RemoteWorker(SingleServer):  # a dispatch target (engine.servers.target.DispatchTarget)
    """An SGLang server on a remote host, watched through its forward; launched by the host agent."""
    spec: WorkerSpec
    host: str
    url: str
    headers: dict[str, str]
    state: str = WorkerState.STARTING
    pid: int | None = None
    restarts: int = 0
    error: str | None = None
    capacity_info: ServerCapacity = field(default_factory=ServerCapacity)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    # behind the router (always, in a multi-host run): the router's count of requests open on it, or None where the
    # router keeps none or the server has no live figure (engine.placement.router.RouterEndpoint.refresh)
    in_flight: int | None = 0
    in_flight_source: str = InFlightSource.DISPATCH
    held: int = 0
    capacity: int = 0
    batch: BatchSize | None = None  # set by a dispatcher that sends to it directly (the router's members: never)
    node: str = ""  # a [slurm] group's server: the node its job runs on (pid is that node's)
    job_id: str = ""  # a [slurm] group's server: its job
    listeners: list[Callable[["RemoteWorker", str], None]] = field(default_factory=list)
    unhealthy_since: float | None = None
    ready_this_join: bool = False
    served_model_name: str | None = None  # the proven name it was admitted with (None: not admitted)
    last_error_lines: list[str] = field(default_factory=list)  # its last crash's fatal lines, as its agent read them
    agent_seen: tuple = ()  # the agent's (state, restarts, pid) last mirrored
    crashes_told: tuple[int | None, int] = (None, 0)  # (agent pid, its crash count) told: each crash told once
    served: ServedTokens | None = None  # the ledger's ServedTokens when it is a dispatch target (behind a router: None)
    tuning: LaunchTuning | None = None  # its launch's --schedule-conservativeness, from its agent's identity record

    @property
    def name(self) -> str:
        return self.spec.name

    def restart(self) -> None:
        raise NotImplementedError(f"{self.name} runs on host {self.host}: restart it there (its host agent"
                                  " restarts crashed servers itself)")

    def set_state(self, state: str, error: str | None = None) -> None:
        self.error = error
        if state in GONE or state in ENDED:
            self.drop_live_figures()
        if state == self.state:
            return
        log.info("worker %s: %s -> %s%s", self.name, self.state, state, f" ({error})" if error else "")
        self.state = state
        for listener in list(self.listeners):
            listener(self, state)

    def drop_live_figures(self) -> None:
        """Its host or job is gone (lost, unreachable, stopped): no reading of it is live any more. Its gauges, pid and
        in-flight count go (N/A), not kept at their last values; they come back with the next reading once it
        answers again."""
        self.metrics = ServerMetrics()
        self.pid = None
        self.in_flight = None

    def snapshot(self) -> WorkerEvent:
        return worker_event(self, host=self.host, remote=True)


def server_log(work_dir: str, m: RemoteWorker) -> str:
    """The server's log on its host."""
    return f"{work_dir}/workers/{m.name}/server.log"


async def health(session: aiohttp.ClientSession, m: RemoteWorker) -> tuple[bool, str]:
    try:
        async with session.get(m.url + "/health", headers=m.headers,
                                    timeout=aiohttp.ClientTimeout(total=5)) as resp:
            await resp.read()
            return resp.status == 200, f"/health -> HTTP {resp.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        return False, f"/health: {type(exc).__name__}: {exc}"


async def scrape(session: aiohttp.ClientSession, m: RemoteWorker) -> None:
    try:
        async with session.get(m.url + "/metrics", headers=m.headers,
                                    timeout=aiohttp.ClientTimeout(total=5)) as resp:
            text = await resp.text()
        m.metrics = parse_metrics(text) if resp.status == 200 else ServerMetrics()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        m.metrics = ServerMetrics()
