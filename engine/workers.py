"""Per-GPU-group SGLang worker processes: launch, readiness, health, metrics, crash and restart.

State machine: starting -> loading -> ready -> crashed -> (backoff) starting ... -> failed after
`workers.max_restarts` crashes inside RESTART_WINDOW_S. stdout+stderr of each server are appended
to workers/<name>/server.log; the server runs in its own process group so a kill takes its whole
tree (SGLang forks scheduler and detokenizer processes).
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import aiohttp

from engine.config import RunConfig
from engine.metrics_client import ServerCapacity, ServerMetrics, parse_metrics, parse_server_info
from engine.telemetry_events import AlertEvent, WorkerEvent

log = logging.getLogger("regen.workers")

READY_LINE = "The server is fired up and ready to roll!"
ERROR_PATTERN = re.compile(
    r"out of memory|OutOfMemoryError|Not enough memory|CUDA error|Scheduler hit an exception|Received sigquit"
    r"|SIGQUIT received|Watchdog timeout|is dead|Initialization failed"
)
LOADING_HINTS = ("server_args=", "Load weight begin", "Init torch distributed", "Loading")
RESTART_WINDOW_S = 600.0
HEALTH_INTERVAL_S = 5.0
METRICS_INTERVAL_S = 2.0
STOP_GRACE_S = 10.0
MAX_ERROR_LINES = 8


class WorkerState:
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    CRASHED = "crashed"
    FAILED = "failed"
    STOPPED = "stopped"
    # the port is held by a process regen did not launch, or the server that answers cannot prove it is
    # the one launched: nothing is sent to it; `error` names the holder and the remedy
    REFUSED = "refused"


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    gpus: tuple[int, ...]
    host: str
    port: int

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


def launch_argv(cfg: RunConfig, spec: WorkerSpec, python: str) -> list[str]:
    """The template is split first and each word formatted, so paths with spaces stay one argument."""
    fields = {
        "python": python,
        "model": cfg.model,
        "host": spec.host,
        "port": str(spec.port),
        "tp": str(len(spec.gpus)),
        "gpus": ",".join(str(g) for g in spec.gpus),
    }
    argv = [word.format(**fields) for word in shlex.split(cfg.workers.launch)]
    argv += list(cfg.workers.extra_args)
    if cfg.workers.api_key and "--api-key" not in argv:
        argv += ["--api-key", cfg.workers.api_key]
    return argv


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


def worker_event(w, *, host: str = "", remote: bool = False) -> WorkerEvent:
    """The telemetry event of a server, launched here (Worker) or watched on another host (RemoteWorker)."""
    m = w.metrics
    return WorkerEvent(
        name=w.name, state=w.state, url=w.url, gpus=list(w.spec.gpus), pid=w.pid, restarts=w.restarts,
        running_reqs=m.running_reqs, queued_reqs=m.queued_reqs, gen_throughput=m.gen_throughput,
        token_usage=m.token_usage, in_flight=w.in_flight, capacity=w.capacity, error=w.error, host=host,
        remote=remote)


@dataclass
class Worker:
    spec: WorkerSpec
    cfg: RunConfig
    run_dir: Path
    session: aiohttp.ClientSession
    emit: Callable[[object], None]  # telemetry sink (WorkerEvent / AlertEvent)
    python: str = sys.executable
    state: str = WorkerState.STARTING
    pid: int | None = None
    restarts: int = 0
    capacity_info: ServerCapacity = field(default_factory=ServerCapacity)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    error: str | None = None
    in_flight: int = 0  # maintained by the dispatcher
    capacity: int = 0  # maintained by the dispatcher
    listeners: list[Callable[["Worker", str], None]] = field(default_factory=list)
    host_name: str = ""  # the [[hosts]] name in a multi-host run

    def __post_init__(self) -> None:
        self.log_path = self.run_dir / "workers" / self.spec.name / "server.log"
        self._proc: asyncio.subprocess.Process | None = None
        self._log_offset = 0
        self._crash_times: list[float] = []
        self._stopping = False
        self._manual_restart = asyncio.Event()
        self._ready_event = asyncio.Event()
        self._task: asyncio.Task | None = None

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

    async def _lifecycle(self) -> None:
        while not self._stopping:
            self._manual_restart.clear()
            try:
                await self._launch()
            except OSError as exc:
                self.error = f"cannot launch: {exc}"
                self._set_state(WorkerState.CRASHED)
                self._alert("error", f"worker {self.name} could not be launched", str(exc), "launch")
            else:
                outcome = await self._monitor()
                if self._stopping:
                    break
                if outcome == "manual":
                    await self._kill(STOP_GRACE_S)
                    self.restarts += 1
                    self.error = None
                    continue
            # crashed (or hung / never ready, already killed)
            now = time.time()
            self._crash_times = [t for t in self._crash_times if now - t < RESTART_WINDOW_S] + [now]
            if len(self._crash_times) > self.cfg.workers.max_restarts:
                self._set_state(WorkerState.FAILED)
                self._alert(
                    "critical",
                    f"worker {self.name} failed: {len(self._crash_times)} crashes in {RESTART_WINDOW_S:.0f} s,"
                    f" not restarted again",
                    "\n".join([self.error or ""] + list(getattr(self, "last_error_lines", []))), "failed",
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
        reaped = await asyncio.to_thread(reap_orphan, pid_path, self.spec.port)
        if reaped:
            log.warning("worker %s: %s", self.name, reaped)
        argv = launch_argv(self.cfg, self.spec, self.python)
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.spec.gpus)
        env.update(self.cfg.workers.env)
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
        self.error = None
        self.metrics = ServerMetrics()
        log.info("worker %s: launched pid %d: %s (log %s)", self.name, self.pid, shown, self.log_path)
        self._set_state(WorkerState.STARTING)

    async def _monitor(self) -> str:
        """Returns "crashed" or "manual". Kills the process itself when hung or never ready."""
        proc = self._proc
        assert proc is not None
        launched = time.monotonic()
        seen = self._log_offset
        next_health = 0.0
        next_metrics = 0.0
        health_failures = 0
        while True:
            if self._manual_restart.is_set():
                return "manual"
            if proc.returncode is not None:
                return self._crashed(proc.returncode)
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
                if ready:
                    await self._read_capacity()
                    self._set_state(WorkerState.READY)
                elif now - launched > self.cfg.workers.ready_timeout_s:
                    self.error = f"not ready after {self.cfg.workers.ready_timeout_s:.0f} s (workers.ready_timeout_s)"
                    await self._kill(STOP_GRACE_S)
                    return self._crashed(proc.returncode, reason=self.error)
            else:
                if now >= next_metrics:
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
                            self._alert("error", f"worker {self.name} hung, killing it", self.error, "hung")
                            await self._kill(2.0)
                            return self._crashed(proc.returncode, reason=self.error)
                    next_health = time.monotonic() + min(HEALTH_INTERVAL_S, timeout)
            try:
                await asyncio.wait_for(self._manual_restart.wait(), timeout=0.25)
            except asyncio.TimeoutError:
                pass  # poll tick

    def _crashed(self, returncode: int | None, reason: str | None = None) -> str:
        lines = error_lines(self.log_path, self._log_offset)
        evidence_lines = lines or log_tail(self.log_path, self._log_offset)
        code = "unknown" if returncode is None else (
            f"signal {-returncode}" if returncode < 0 else f"exit code {returncode}")
        self.error = (reason + "; " if reason else "") + f"{code}" + (f": {lines[-1]}" if lines else "")
        self.last_error_lines = evidence_lines
        self._set_state(WorkerState.CRASHED)
        self._alert("error", f"worker {self.name} crashed ({code})", "\n".join(evidence_lines), "crash")
        return "crashed"

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
        found = await read_server_info(self.session, self.url, self.headers, self.name)
        if found is not None:
            self.capacity_info = found

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

    def _alert(self, severity: str, text: str, evidence: str, key: str) -> None:
        self.emit(AlertEvent(severity=severity, text=text, evidence=redact(evidence, self.cfg.workers.api_key),
                             key=f"worker:{self.name}:{key}"))
