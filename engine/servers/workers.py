"""Per-GPU-group SGLang worker processes: launch, readiness, health, metrics, crash and restart.

State machine: starting -> loading -> ready -> crashed -> (backoff) starting ... -> failed after
`workers.max_restarts` crashes inside RESTART_WINDOW_S. stdout+stderr of each server are appended
to workers/<name>/server.log; the server runs in its own process group so a kill takes its whole
tree (SGLang forks scheduler and detokenizer processes).

A worker is only ever the server it launched: the port must be free before each launch, and the
server that answers must prove it is this launch (engine/servers/identity.py) before the worker is
ready. Otherwise it is `refused` (not a crash): one critical alert naming the holder and the
remedy, the port re-checked with backoff, and the launch made once the port is free again.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import aiohttp

from engine.servers import stream_flag
from engine.api.wire import AlertKind, InFlightSource, Severity, WorkerState
from engine.servers.capacity import BatchSize, ServerCapacity, batch_from_log, configured_batch, discover, parse_server_info
from engine.config.load import RunConfig
from engine.servers.metrics_client import ServerMetrics, parse_metrics
from engine.servers.port_holder import PortCheck, check_port
from engine.servers.target import SingleServer
from engine.servers.ranks import ServerRank, rank_argv
from engine.servers.identity import (
    SERVED_NAME_FLAG, Expected, IdentityCheck, Verdict, check_identity, judge_health_only, launch_token,
    operator_served_name, served_name, socket_owner,
)
from engine.api.events import AlertEvent, Event, WorkerEvent

if TYPE_CHECKING:
    from engine.run.counts import ServedTokens

log = logging.getLogger("regen.workers")

READY_LINE = "The server is fired up and ready to roll!"
ERROR_PATTERN = re.compile(
    r"out of memory|OutOfMemoryError|Not enough memory|CUDA error|Scheduler hit an exception|Received sigquit"
    r"|SIGQUIT received|[Ww]atchdog timeout|is dead|died during initialization|Initialization failed"
    r"|NCCL error|Connection closed by remote peer|DistNetworkError|DistStoreError"
    r"|^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Interrupt): "
)  # 0.5.23: a lowercase `watchdog timeout (...)`, and `Rank N scheduler died during initialization` for `is dead`;
# a server across nodes: NCCL's remote error naming the peer that went, torch's rendezvous errors;
# a Python traceback's last line (`ModuleNotFoundError: No module named 'sglang'`, unindented), which is the cause of
# any death before SGLang's own handlers run (an import, a bad flag's ValueError)
# fatal lines that only say the server is going, not why: a crash's error quotes the last line that says why
WRAPPER_LINES = re.compile(r"Received sigquit|SIGQUIT received|Scheduler hit an exception: Traceback")
PROMETHEUS_DIR_VAR = "PROMETHEUS_MULTIPROC_DIR"
LOADING_HINTS = ("server_args=", "Load weight begin", "Init torch distributed", "Loading")
# uvicorn's line when the port was taken between regen's check and the server's bind
BIND_IN_USE = re.compile(r"\[Errno 98\]|address already in use", re.IGNORECASE)
REFUSED_RECHECK_S = (1.0, 30.0)  # first and longest wait between checks of a refused worker's port
IDENTITY_FILE = "identity.json"
RESTART_WINDOW_S = 600.0
HEALTH_INTERVAL_S = 5.0
POLL_S = 0.25  # a server's process, log and health are looked at this often
# ... while it starts: its ready line is seen sooner (a resume's first dispatch and a restarted server's share of
# the work wait on it), and reading a few new bytes of a local file costs nothing
STARTING_POLL_S = 0.05
METRICS_INTERVAL_S = 0.5  # the dispatcher's feedback reads each server's queue this often (engine.run.batch_feedback)
STOP_GRACE_S = 10.0
MAX_ERROR_LINES = 8


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    gpus: tuple[int, ...]
    host: str
    port: int
    rank: ServerRank | None = None  # this node's part of a server across nodes (engine/servers/ranks.py)

    @property
    def tp_size(self) -> int:
        """The server's TP size: its GPUs here, times the nodes when it spans several."""
        return self.rank.tp_size if self.rank else len(self.gpus)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def worker_specs(cfg: RunConfig) -> list[WorkerSpec]:
    specs = []
    for i, group in enumerate(cfg.workers.groups()):
        name = "gpu" + "-".join(str(g) for g in group)
        specs.append(WorkerSpec(name=name, gpus=group, host=cfg.workers.host, port=cfg.workers.base_port + i))
    return specs


def launch_argv(cfg: RunConfig, spec: WorkerSpec, python: str, served_model_name: str | None = None) -> list[str]:
    """The template is split first and each word formatted, so paths with spaces stay one argument.
    `served_model_name` (the per-launch identity) is added unless the operator's line sets its own."""
    fields = {
        "python": python,
        "model": cfg.model,
        "host": spec.host,
        "port": str(spec.port),
        "tp": str(spec.tp_size),
        "gpus": ",".join(str(g) for g in spec.gpus),
    }
    argv = [word.format(**fields) for word in shlex.split(cfg.workers.launch)]
    argv += list(cfg.workers.extra_args)
    if served_model_name and operator_served_name(argv) is None:
        argv += [SERVED_NAME_FLAG, served_model_name]
    if cfg.workers.api_key and "--api-key" not in argv:
        argv += ["--api-key", cfg.workers.api_key]
    return rank_argv(argv, spec.rank) if spec.rank else argv


SLURM_GPUS_VAR = "REGEN_SLURM_GPUS"  # set by engine.placement.slurm.step: the GPU ids Slurm gave the job step on this node


def visible_gpus(gpus: tuple[int, ...]) -> list[str]:
    """CUDA_VISIBLE_DEVICES of a server: its GPU indices, or, in a Slurm job step, the ids Slurm gave the step at
    those positions (names stay <host>.gpu0-1 whichever GPUs of the node the job got)."""
    given = [g for g in os.environ.get(SLURM_GPUS_VAR, "").split(",") if g]
    return [given[g] if g < len(given) else str(g) for g in gpus]


def die_with_parent() -> None:
    """preexec_fn: SIGKILL the server when the supervisor dies (Linux prctl PR_SET_PDEATHSIG), so a
    killed supervisor does not leave servers holding GPUs and ports. Elsewhere the pid-file reaping
    at the next start (reap_orphan) covers it."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def reap_orphan(pid_path: Path, port: int) -> str | None:
    """Kill the process group of a server a previous supervisor left behind (pid file + matching cmdline)."""
    import psutil

    try:
        pid = int(pid_path.read_text().strip())
    except FileNotFoundError:
        return None
    except ValueError:
        return f"ignored unreadable {pid_path}"
    try:
        proc = psutil.Process(pid)
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return f"pid {pid} from {pid_path} is not ours to inspect (access denied); left alone"
    if f"--port {port}" not in cmdline:
        return None  # the pid was reused by something else
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    except PermissionError as exc:
        return f"cannot kill leftover server pid {pid}: {exc}"
    try:
        proc.wait(timeout=10)
    except psutil.TimeoutExpired:
        return f"leftover server pid {pid} still alive 10 s after SIGKILL"
    return f"killed leftover server pid {pid} (process group) from a previous supervisor: {cmdline[:200]}"


def redact(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


def own_prometheus_dir(worker_dir: Path) -> Path:
    """An empty multiprocess-metrics dir of this server's own. SGLang makes a subdirectory of PROMETHEUS_MULTIPROC_DIR
    but does not point the variable at it, so servers launched with one environment would share one directory and
    mix their gauges (each reading the others' queue); emptied at each launch, as prometheus_client requires."""
    path = worker_dir / "prometheus_multiproc"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def error_lines(log_path: Path, start_offset: int, limit: int = MAX_ERROR_LINES) -> list[str]:
    """The last lines matching SGLang's fatal-error patterns written since this launch."""
    try:
        with open(log_path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            begin = max(start_offset, size - 4 * 2**20)
            f.seek(begin)
            text = f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return [f"(cannot read {log_path}: {exc})"]
    hits = [line.strip() for line in text.splitlines() if ERROR_PATTERN.search(line)]
    return hits[-limit:]


def startup_text(log_path: Path, start_offset: int, limit: int = 4 * 2**20) -> str:
    """This launch's server.log from its start (at most `limit` bytes): the start-up lines come before the
    ready line, so they are in it once the server is ready."""
    try:
        with open(log_path, "rb") as f:
            f.seek(start_offset)
            return f.read(limit).decode("utf-8", errors="replace")
    except OSError as exc:
        log.warning("cannot read %s for its start-up lines: %s", log_path, exc)
        return ""


def bind_failure(log_path: Path, start_offset: int, port: int) -> str | None:
    """The server's own "address already in use" line for `port` since this launch, if it logged one
    (a line about another port, e.g. a distributed-init port, is not the worker's port)."""
    for line in reversed(log_tail(log_path, start_offset, lines=40)):
        if BIND_IN_USE.search(line) and re.search(rf"\b{port}\b", line):
            return line.strip()
    return None


@dataclass(frozen=True)
class IdentityRecord:
    """workers/<name>/identity.json: the server this worker launched and whether it proved its
    identity. A multi-host run's dispatch host reads it (over ssh) before a remote server may join
    the router: the name the server must answer with, and the host agent's verdict."""
    name: str
    state: str
    served_model_name: str | None
    pid: int | None
    port: int
    error: str | None = None
    # the per-DP-rank batch size in this launch's start-up log line, read where the log is (the dispatch
    # host cannot read it): one of the sources of the server's batch size (engine/servers/capacity.py)
    startup_batch: int | None = None
    # the process that wrote it (a host agent): a record of an agent that has gone since is stale
    agent_pid: int | None = None
    restarts: int = 0
    last_words: tuple[str, ...] = ()  # its last crash's fatal lines (or its log's tail), kept after a relaunch
    # every crash of this agent's launches, counted: a reader that polls (the dispatch host) tells each crash once
    # even when the agent relaunched the server before the reader saw it crashed
    crashes: int = 0
    last_crash: str | None = None  # the last crash's error

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "IdentityRecord":
        data = json.loads(text)
        words = data.get("last_words")
        return cls(name=str(data["name"]), state=str(data["state"]), served_model_name=data.get("served_model_name"),
                   pid=data.get("pid"), port=int(data["port"]), error=data.get("error"),
                   startup_batch=_int_or_none(data.get("startup_batch")), agent_pid=_int_or_none(data.get("agent_pid")),
                   restarts=_int_or_none(data.get("restarts")) or 0,
                   last_words=tuple(str(w) for w in words) if isinstance(words, list) else (),
                   crashes=_int_or_none(data.get("crashes")) or 0,
                   last_crash=str(data["last_crash"]) if data.get("last_crash") is not None else None)


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def write_identity(path: Path, record: IdentityRecord) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(record.to_json() + "\n")
    os.replace(tmp, path)


def log_tail(log_path: Path, start_offset: int, lines: int = 5) -> list[str]:
    try:
        with open(log_path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(start_offset, size - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return [f"(cannot read {log_path}: {exc})"]
    return [line for line in text.splitlines() if line.strip()][-lines:]


async def read_server_info(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                           name: str) -> ServerCapacity | None:
    """The server's batch size and context length (/get_server_info, or /server_info in newer SGLang);
    None, with the reason logged, if neither answers."""
    for path in ("/get_server_info", "/server_info"):
        try:
            async with session.get(url + path, headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status == 200:
                    info = parse_server_info(await resp.json(content_type=None))
                    log.info("worker %s: %s", name, info)
                    return info
                text = await resp.text()
                log.warning("worker %s: GET %s -> %d %s", name, path, resp.status, text[:200])
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            log.warning("worker %s: GET %s failed: %s", name, path, exc)
    return None


def with_batch(ev: WorkerEvent, w) -> WorkerEvent:
    """`ev` with the batch size of a dispatch target or server: the size in use (the dispatcher's, else the
    discovered one) and the discovered one, each with its source; left empty until discovery ran."""
    info = w.capacity_info
    discovered = info.batch() if info.discovered else None
    batch = getattr(w, "batch", None) or discovered
    if batch is not None:
        ev.batch_size, ev.batch_source = batch.size, batch.source
    if discovered is not None:
        ev.discovered_batch, ev.discovered_source = discovered.size, discovered.source
    return ev


def worker_event(w, *, host: str = "", remote: bool = False) -> WorkerEvent:
    """The telemetry event of a server, launched here (Worker) or watched on another host (RemoteWorker)."""
    m = w.metrics
    return with_batch(WorkerEvent(
        name=w.name, state=w.state, url=w.url, gpus=list(w.spec.gpus), pid=w.pid, restarts=w.restarts,
        running_reqs=m.running_reqs, queued_reqs=m.queued_reqs, gen_throughput=m.gen_throughput,
        token_usage=m.token_usage, in_flight=w.in_flight, in_flight_source=w.in_flight_source,
        held=getattr(w, "held", 0), capacity=w.capacity, error=w.error, host=host, remote=remote,
        node=getattr(w, "node", ""), job_id=getattr(w, "job_id", ""), **served_fields(w.served)), w)


def served_fields(served: ServedTokens | None) -> dict:
    """A dispatch target's committed prompt and cached tokens for its event (the ledger's figures)."""
    if served is None:
        return {}
    return {"prompt_tokens": served.prompt_tokens, "cached_tokens": served.cached_tokens}


@dataclass
class Worker(SingleServer):  # a dispatch target (engine.servers.target.DispatchTarget)
    spec: WorkerSpec
    cfg: RunConfig
    run_dir: Path
    session: aiohttp.ClientSession
    emit: Callable[[Event], None]  # telemetry sink (WorkerEvent / AlertEvent)
    python: str = sys.executable
    state: str = WorkerState.STARTING
    pid: int | None = None
    restarts: int = 0
    capacity_info: ServerCapacity = field(default_factory=ServerCapacity)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    error: str | None = None
    # maintained by the dispatcher; behind the router (a [[hosts]] run's local servers) by the router's endpoint:
    # the router's count of it, or None where the router keeps none (engine.placement.router.RouterEndpoint.refresh)
    in_flight: int | None = 0
    in_flight_source: str = InFlightSource.DISPATCH
    held: int = 0  # maintained by the dispatcher: regen's queued items held for it
    capacity: int = 0  # maintained by the dispatcher
    batch: BatchSize | None = None  # maintained by the dispatcher: the batch size it works with
    listeners: list[Callable[["Worker", str], None]] = field(default_factory=list)
    host_name: str = ""  # the [[hosts]] name in a multi-host run
    served: ServedTokens | None = None  # the ledger's figures of it as a dispatch target (set by the supervisor)

    def __post_init__(self) -> None:
        self.log_path = self.run_dir / "workers" / self.spec.name / "server.log"
        self._proc: asyncio.subprocess.Process | None = None
        self._log_offset = 0
        self._crash_times: list[float] = []
        self._stopping = False
        self._manual_restart = asyncio.Event()
        self._stream_flag: stream_flag.StreamFlag | None = None  # chosen at the first launch (engine.servers.stream_flag)
        self._ready_event = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._expected: Expected | None = None  # the identity of the current launch
        self._proxy_warned = False
        self._startup_batch: int | None = None  # from the current launch's start-up log line
        self.last_error_lines: list[str] = []  # the last crash's fatal lines (or its log's tail)
        self.crashes = 0  # every crash of this worker, in its identity record (engine/placement/hosts/link.py reads it)
        self.last_crash: str | None = None

    # -- public -----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def headers(self) -> dict[str, str]:
        key = self.cfg.workers.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def start(self) -> None:
        self._task = asyncio.create_task(self._lifecycle(), name=f"worker-{self.name}")

    async def wait_ready(self) -> None:
        await self._ready_event.wait()

    def restart(self) -> None:
        """Operator-requested restart: kill and relaunch; not counted as a crash. A failed worker
        gets a fresh crash budget and is launched again."""
        if self._task is not None and self._task.done() and not self._stopping:
            self._crash_times.clear()
            self.restarts += 1
            self.start()
            return
        self._manual_restart.set()

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        self._stopping = True
        self._manual_restart.set()
        await self._kill(grace_s)
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=grace_s + 5)
            except asyncio.TimeoutError:
                self._task.cancel()
        self._set_state(WorkerState.STOPPED)

    def snapshot(self) -> WorkerEvent:
        return worker_event(self, host=self.host_name)

    # -- lifecycle --------------------------------------------------------------------------
    def _set_state(self, state: str) -> None:
        if state == self.state:
            return
        log.info("worker %s: %s -> %s%s", self.name, self.state, state, f" ({self.error})" if self.error else "")
        self.state = state
        if state == WorkerState.READY:
            self._ready_event.set()
        else:
            self._ready_event.clear()
        for listener in list(self.listeners):
            listener(self, state)
        self.emit(self.snapshot())
        self._record_identity()

    def _record_identity(self) -> None:
        expected = self._expected
        ended = self.state in (WorkerState.CRASHED, WorkerState.FAILED)
        record = IdentityRecord(name=self.name, state=self.state, pid=self.pid, port=self.spec.port, error=self.error,
                                served_model_name=expected.served_model_name if expected else None,
                                startup_batch=self._startup_batch, agent_pid=os.getpid(), restarts=self.restarts,
                                last_words=tuple(self.last_error_lines) if ended or self.crashes else (),
                                crashes=self.crashes, last_crash=self.last_crash)
        try:
            write_identity(self.log_path.parent / IDENTITY_FILE, record)
        except OSError as exc:
            log.warning("worker %s: cannot write %s: %s", self.name, IDENTITY_FILE, exc)

    @property
    def port_remedy(self) -> str:
        where = "[[hosts]] base_port (or workers.base_port)" if self.host_name else "workers.base_port"
        return f"stop that process, or set {where} in run.toml to a free range"

    def _refuse(self, reason: str, evidence: str) -> None:
        """Another process's server holds or answers the port: refused, alerted once per refusal."""
        first = self.state != WorkerState.REFUSED
        error = f"{reason}; {self.port_remedy}"
        changed = error != self.error
        self.error = error
        self.pid = None  # no server of ours runs: the pid shown must never be the other process's
        if first:
            self._set_state(WorkerState.REFUSED)
            self._alert(Severity.CRITICAL, f"worker {self.name} refused: {error}", evidence, "refused",
                        AlertKind.RAISED)
        elif changed:  # another holder now: show it, without a second alert
            log.warning("worker %s: still refused: %s", self.name, error)
            self.emit(self.snapshot())
            self._record_identity()

    def _clear_refusal(self) -> None:
        where = f"port {self.spec.port} on {self.spec.host}"
        log.info("worker %s: %s is free again; launching its server", self.name, where)
        self._alert(Severity.INFO, f"worker {self.name}: {where} is free again; launching its server",
                    f"refused before: {self.error}", "refused", AlertKind.CLEARED)
        self.error = None

    async def _wait_for_port(self) -> bool:
        """Launch only on a free port: while another process holds it the worker stays refused and the
        port is checked again with backoff (not a crash). True when free, False when stopping."""
        delay, longest = REFUSED_RECHECK_S
        self.log_path.parent.mkdir(parents=True, exist_ok=True)  # identity.json records a refusal too
        while not self._stopping:
            pid_path = self.log_path.parent / "server.pid"
            reaped = await asyncio.to_thread(reap_orphan, pid_path, self.spec.port)
            if reaped:
                log.warning("worker %s: %s", self.name, reaped)
            check = await asyncio.to_thread(check_port, self.spec.host, self.spec.port)
            if not check.held:
                if not check.free:  # not a holder (e.g. an address this host does not have): the launch says why
                    log.warning("worker %s: %s; %s", self.name, check.bind_error, check.note)
                if self.state == WorkerState.REFUSED:
                    self._clear_refusal()
                return True
            self._refuse(f"port {check.port} on {check.host} is already in use by {check.holder_text()}",
                         check.evidence())
            try:
                await asyncio.wait_for(self._manual_restart.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass  # check again
            self._manual_restart.clear()
            delay = min(longest, delay * 2)
        return False

    async def _lifecycle(self) -> None:
        while not self._stopping:
            self._manual_restart.clear()
            if not await self._wait_for_port():
                break
            try:
                await self._launch()
            except OSError as exc:
                self.error = f"cannot launch: {exc}"
                self.last_error_lines = [self.error]
                self._count_crash()
                self._set_state(WorkerState.CRASHED)
                self._alert(Severity.ERROR, f"worker {self.name} could not be launched", str(exc), "launch")
            else:
                outcome = await self._monitor()
                if self._stopping:
                    break
                if outcome == "manual":
                    await self._kill(STOP_GRACE_S)
                    self.restarts += 1
                    self.error = None
                    continue
                if outcome == "refused":  # not a crash of ours: wait for the port, then launch again
                    await self._kill(STOP_GRACE_S)
                    continue
            # crashed (or hung / never ready, already killed)
            now = time.time()
            self._crash_times = [t for t in self._crash_times if now - t < RESTART_WINDOW_S] + [now]
            if len(self._crash_times) > self.cfg.workers.max_restarts:
                self._set_state(WorkerState.FAILED)
                self._alert(
                    Severity.CRITICAL,
                    f"worker {self.name} failed: {len(self._crash_times)} crashes in {RESTART_WINDOW_S:.0f} s,"
                    f" not restarted again",
                    "\n".join([self.error or ""] + self.last_error_lines), "failed",
                )
                return
            delay = min(60.0, 2.0 ** (len(self._crash_times) - 1))
            log.info("worker %s: restarting in %.0f s", self.name, delay)
            try:
                await asyncio.wait_for(self._manual_restart.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass  # backoff elapsed: restart
            if self._stopping:
                break
            self.restarts += 1

    async def _launch(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        pid_path = self.log_path.parent / "server.pid"
        ours = served_name(self.cfg.run_dir, self.name, launch_token())
        argv = launch_argv(self.cfg, self.spec, self.python, served_model_name=ours)
        if self.cfg.runaway.enabled:  # answers are streamed: have the server stream deltas where it can
            if self._stream_flag is None:
                self._stream_flag = await stream_flag.choose(argv, self.python)
                chosen = self._stream_flag
                if chosen.flag:
                    log.info("worker %s: launched with %s (SGLang %s, from %s): streams carry only the new ids",
                             self.name, chosen.flag, chosen.version, chosen.how)
                elif "already" not in chosen.how:
                    log.warning("worker %s: no delta-streaming flag added (%s): if the server streams every id "
                                "so far in each chunk, regen reads that too, at a client CPU cost growing with the "
                                "square of the answer's length", self.name, chosen.how)
            if self._stream_flag.flag:
                argv.append(self._stream_flag.flag)
        name = operator_served_name(argv) or ours
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus(self.spec.gpus))
        env.update(self.cfg.workers.env)
        if env.get(PROMETHEUS_DIR_VAR):
            env[PROMETHEUS_DIR_VAR] = str(own_prometheus_dir(self.log_path.parent))
        shown = redact(shlex.join(argv), self.cfg.workers.api_key)
        with open(self.log_path, "ab") as logf:
            self._log_offset = logf.seek(0, os.SEEK_END)
            header = f"[regen {time.strftime('%Y-%m-%d %H:%M:%S')}] launching: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} {shown}\n"
            logf.write(header.encode())
            logf.flush()
            self._log_offset = logf.tell()
            self._proc = await asyncio.create_subprocess_exec(
                *argv, stdout=logf, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                env=env, cwd=str(self.run_dir), start_new_session=True, preexec_fn=die_with_parent,
            )
        self.pid = self._proc.pid
        pid_path.write_text(f"{self.pid}\n")
        self._expected = Expected(served_model_name=name, token_is_ours=name == ours, pid=self.pid,
                                  host=self.spec.host, port=self.spec.port)
        self.error = None
        self.metrics = ServerMetrics()
        self._startup_batch = None
        log.info("worker %s: launched pid %d: %s (log %s)", self.name, self.pid, shown, self.log_path)
        self._set_state(WorkerState.STARTING)

    async def _monitor(self) -> str:
        """Returns "crashed", "refused" or "manual". Kills the process itself when hung or never ready."""
        proc = self._proc
        assert proc is not None
        launched = time.monotonic()
        seen = self._log_offset
        next_health = 0.0
        next_metrics = 0.0
        health_failures = 0
        unproven = ""
        while True:
            if self._manual_restart.is_set():
                return "manual"
            if proc.returncode is not None:
                return await self._exited(proc.returncode)
            now = time.monotonic()
            if self.state in (WorkerState.STARTING, WorkerState.LOADING):
                text, seen = self._read_log(seen)
                if self.state == WorkerState.STARTING and (text.strip() or now - launched > 1.0):
                    if any(h in text for h in LOADING_HINTS) or now - launched > 1.0:
                        self._set_state(WorkerState.LOADING)
                ready = READY_LINE in text
                if not ready and now >= next_health:
                    next_health = now + 1.0
                    ready = await self._health_ok(timeout=2.0)
                if ready:  # by its log line or /health: either way, only once it proves it is this launch
                    check = await self._prove_identity()
                    if check.verdict == Verdict.PROVEN:
                        if self.serves_http:
                            await self._read_capacity()
                        self._set_state(WorkerState.READY)
                    elif check.verdict == Verdict.FOREIGN:
                        self._refuse(check.reason, self._identity_evidence(check))
                        return "refused"
                    elif check.verdict == Verdict.OWN_MISMATCH:
                        await self._kill(STOP_GRACE_S)
                        return self._crashed(proc.returncode, reason=check.reason)
                    else:
                        unproven = check.reason
                if self.state != WorkerState.READY and now - launched > self.cfg.workers.ready_timeout_s:
                    self.error = f"not ready after {self.cfg.workers.ready_timeout_s:.0f} s (workers.ready_timeout_s)"
                    if unproven:
                        self.error += f"; it answered, but its identity was not proven: {unproven}"
                    await self._kill(STOP_GRACE_S)
                    return self._crashed(proc.returncode, reason=self.error)
            else:
                if now >= next_metrics and self.serves_http:
                    next_metrics = now + METRICS_INTERVAL_S
                    await self._scrape_metrics()
                if now >= next_health:
                    timeout = self.cfg.workers.health_timeout_s
                    if await self._health_ok(timeout=timeout):
                        health_failures = 0
                    else:
                        health_failures += 1
                        if health_failures >= self.cfg.workers.health_failures and proc.returncode is None:
                            self.error = f"hung: /health failed {health_failures} times while the process lives; killed"
                            self._alert(Severity.ERROR, f"worker {self.name} hung, killing it", self.error, "hung")
                            await self._kill(2.0)
                            return self._crashed(proc.returncode, reason=self.error)
                    next_health = time.monotonic() + min(HEALTH_INTERVAL_S, timeout)
            starting = self.state in (WorkerState.STARTING, WorkerState.LOADING)
            try:
                await asyncio.wait_for(self._manual_restart.wait(), timeout=STARTING_POLL_S if starting else POLL_S)
            except asyncio.TimeoutError:
                pass  # poll tick

    @property
    def serves_http(self) -> bool:
        """False for a rank > 0 of a server across nodes: only a dummy /health, no API, no metrics, no name."""
        return self.spec.rank is None or self.spec.rank.serves_http

    async def _prove_identity(self) -> IdentityCheck:
        assert self._expected is not None
        if self.serves_http:
            check = await check_identity(self.session, self.url, self.headers, self._expected)
        else:
            owner = await asyncio.to_thread(socket_owner, self._expected.host, self._expected.port, self._expected.pid)
            check = judge_health_only(self._expected, owner)
        log.info("worker %s: identity %s: %s", self.name, check.verdict, check.reason)
        if check.warning and not self._proxy_warned:
            self._proxy_warned = True
            self._alert(Severity.WARNING, f"worker {self.name}: {check.warning}", self._identity_evidence(check), "proxy")
        return check

    def _identity_evidence(self, check: IdentityCheck) -> str:
        expected = self._expected
        lines = [f"port: {self.spec.port} on {self.spec.host}",
                 f"launched: pid {expected.pid if expected else None}, served-model-name "
                 f"{expected.served_model_name if expected else None!r}",
                 f"answered: served-model-name {', '.join(map(repr, check.names)) or '(none)'}"]
        for h in check.holders:
            lines.append(f"holder pid: {h.pid if h.pid is not None else 'not visible'}")
            lines.append(f"holder command: {h.cmdline or h.note}")
        return "\n".join(lines)

    async def _exited(self, returncode: int) -> str:
        """The launched server exited. When it could not bind its port because another process took it
        after the check, that is a refusal naming the holder; if the holder has gone since, a crash that
        says why."""
        line = bind_failure(self.log_path, self._log_offset, self.spec.port)
        if line is None:
            return self._crashed(returncode)
        check: PortCheck = await asyncio.to_thread(check_port, self.spec.host, self.spec.port)
        taken = f"port {self.spec.port} on {self.spec.host} was taken before the server could bind it ({line})"
        if check.held:
            self._refuse(f"{taken}; it is held by {check.holder_text()}", check.evidence() + f"\nserver log: {line}")
            return "refused"
        return self._crashed(returncode, reason=f"{taken}; the holder has gone since")

    def _crashed(self, returncode: int | None, reason: str | None = None) -> str:
        lines = error_lines(self.log_path, self._log_offset)
        evidence_lines = lines or log_tail(self.log_path, self._log_offset)
        code = "unknown" if returncode is None else (
            f"signal {-returncode}" if returncode < 0 else f"exit code {returncode}")
        cause = next((line for line in reversed(lines) if not WRAPPER_LINES.search(line)), lines[-1] if lines else "")
        self.error = (reason + "; " if reason else "") + f"{code}" + (f": {cause}" if cause else "")
        self.last_error_lines = evidence_lines
        self._count_crash()
        self._set_state(WorkerState.CRASHED)
        self._alert(Severity.ERROR, f"worker {self.name} crashed ({code})", "\n".join(evidence_lines), "crash")
        return "crashed"

    def _count_crash(self) -> None:
        """Into the identity record: a reader that polls tells each crash once (engine/placement/hosts/link.py)."""
        self.crashes, self.last_crash = self.crashes + 1, self.error

    def _read_log(self, offset: int) -> tuple[str, int]:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError as exc:
            log.warning("worker %s: cannot read %s: %s", self.name, self.log_path, exc)
            return "", offset
        # keep a partial last line for the next read so the ready line is never split
        cut = data.rfind(b"\n") + 1
        return data[:cut].decode("utf-8", errors="replace"), offset + cut

    async def _health_ok(self, timeout: float) -> bool:
        try:
            async with self.session.get(self.url + "/health", headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _read_capacity(self) -> None:
        """The server's batch size from what it reports, its start-up log line or the launch flag
        (engine/servers/capacity.py); its context length from /get_server_info (kept from before if it does not answer)."""
        reported = await read_server_info(self.session, self.url, self.headers, self.name)
        if reported is None:
            reported = ServerCapacity(max_total_num_tokens=self.capacity_info.max_total_num_tokens,
                                      context_length=self.capacity_info.context_length,
                                      max_req_input_len=self.capacity_info.max_req_input_len)
        self._startup_batch = batch_from_log(startup_text(self.log_path, self._log_offset))
        flag = configured_batch(self.cfg.workers.launch, self.cfg.workers.extra_args)
        self.capacity_info = discover(reported, self._startup_batch, flag)
        log.info("worker %s: batch size %s (source %s)", self.name, self.capacity_info.batch().size,
                 self.capacity_info.batch().source)

    async def _scrape_metrics(self) -> None:
        try:
            async with self.session.get(self.url + "/metrics", headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=5)) as resp:
                text = await resp.text()
                if resp.status != 200:
                    self.metrics = ServerMetrics()
                    self.error = f"/metrics -> HTTP {resp.status} (is --enable-metrics set?)"
                    return
            self.metrics = parse_metrics(text)
            if self.error and self.error.startswith("/metrics"):
                self.error = None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            self.metrics = ServerMetrics()
            self.error = f"/metrics failed: {type(exc).__name__}: {exc}"

    async def _kill(self, grace_s: float) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                await asyncio.wait_for(proc.wait(), timeout=wait)
                break
            except asyncio.TimeoutError:
                log.warning("worker %s: pid %d still alive %.0f s after %s", self.name, proc.pid, wait, sig.name)
        # the group may hold children that outlived the leader
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # whole group already gone: the normal case

    def _alert(self, severity: Severity, text: str, evidence: str, key: str, kind: AlertKind = AlertKind.EVENT) -> None:
        self.emit(AlertEvent(severity=severity, text=text, evidence=redact(evidence, self.cfg.workers.api_key),
                             key=f"worker:{self.name}:{key}", kind=kind))
