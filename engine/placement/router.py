"""SGLang's router (`python -m sglang_router.launch_router`) on the dispatch host, and the one
dispatch target it becomes for the dispatcher.

The router is started with no workers; the fleet adds each server when it turns ready and
removes it when it stops answering, through the router's own API (`POST /workers {"url"}`,
`DELETE /workers/{id}`). Routing (cache_aware by default) is the router's: regen only keeps it
fed. The router process is supervised: if it exits it is launched again and given the current
members.
"""
from __future__ import annotations

import asyncio
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
from engine.api.events import AlertEvent, WorkerEvent
from engine.servers.workers import WorkerState, die_with_parent, log_tail, served_fields, with_batch

if TYPE_CHECKING:
    from engine.run.counts import ServedTokens

log = logging.getLogger("regen.router")


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
    def __init__(self, cfg: RunConfig, run_dir: Path, session: aiohttp.ClientSession, emit: Callable[[object], None]):
        self.cfg = cfg
        self.session = session
        self.emit = emit
        self.url = f"http://127.0.0.1:{cfg.router.port}"
        self.log_path = run_dir / "router" / "router.log"
        self.members: set[str] = set()  # worker URLs that should be in the router
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
        self.up, self.error = True, None
        log.info("router pid %d up at %s (policy %s)", self._proc.pid, self.url, self.cfg.router.policy)
        for url in sorted(self.members):
            await self._post(url)
        self.on_change()

    async def _supervise(self) -> None:
        while not self._stopping:
            await self._proc.wait()
            if self._stopping:
                return
            self.up = False
            self.error = f"router exited with {self._proc.returncode}"
            self.on_change()
            self.emit(AlertEvent(severity="error", text="the router exited; restarting it",
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

    async def stop(self) -> None:
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
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

    # -- membership ---------------------------------------------------------------------------
    async def add(self, url: str) -> None:
        async with self._lock:
            self.members.add(url)
            if self.up:
                await self._post(url)

    async def remove(self, url: str) -> None:
        async with self._lock:
            self.members.discard(url)
            if not self.up:
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

    async def listed(self) -> list[dict]:
        async with self.session.get(self.url + "/workers", headers=self.headers,
                                    timeout=aiohttp.ClientTimeout(total=10)) as resp:
            data = await resp.json(content_type=None)
        return list(data.get("workers") or [])

    async def _ids_for(self, url: str) -> list[str]:
        try:
            return [w["id"] for w in await self.listed() if w.get("url") == url]
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError) as exc:
            log.warning("router: GET /workers failed: %s", exc)
            return []


@dataclass
class RouterEndpoint:
    """The router as the dispatcher's one target: ready while the router is up with a ready member;
    its capacity is the sum of the ready members' (so the dispatcher keeps every server fed)."""
    router: RouterProcess
    name: str = "router"
    state: str = WorkerState.STARTING
    capacity_info: ServerCapacity = field(default_factory=ServerCapacity)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    in_flight: int = 0
    capacity: int = 0
    batch: BatchSize | None = None  # maintained by the dispatcher
    listeners: list[Callable[[object, str], None]] = field(default_factory=list)
    members: list = field(default_factory=list)  # RemoteWorker / Worker objects behind the router
    served: ServedTokens | None = None  # the ledger's ServedTokens of everything sent through it (set by the supervisor)

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def headers(self) -> dict[str, str]:
        return self.router.headers

    @property
    def queue_margin(self) -> int:
        """Half a batch queued per ready server: the router picks servers without seeing their free slots."""
        ready = [m for m in self.members if m.state == WorkerState.READY and m.url in self.router.members]
        return sum(max(2, m.capacity_info.batch().size // 2) for m in ready)

    def refresh(self) -> None:
        ready = [m for m in self.members if m.state == WorkerState.READY and m.url in self.router.members]
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

    def snapshot(self) -> WorkerEvent:
        return with_batch(WorkerEvent(
            name=self.name, state=self.state, url=self.url, in_flight=self.in_flight, capacity=self.capacity,
            restarts=self.router.restarts, error=self.router.error, running_reqs=self.metrics.running_reqs,
            queued_reqs=self.metrics.queued_reqs, gen_throughput=self.metrics.gen_throughput,
            **served_fields(self.served)), self)


def _smallest(values) -> int | None:
    """The smallest of the figures the ready servers reported (None: none did): the one every server meets."""
    return min((v for v in values if v), default=None)
