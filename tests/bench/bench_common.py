"""Shared parts of the engine benchmarks (ingest, occupancy, resume): the tiny model, synthetic
prompts, CPU pinning, simulators as separate processes, the real supervisor, log timestamps.

CPU layout on a 2-core box: the engine (supervisor, or the baseline client) on ENGINE_CPUS, every
simulator on SIM_CPUS, so the engine's core is never shared with the servers it is fed by.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from engine.config.load import RunConfig, dump_toml

REPO = Path(__file__).resolve().parents[2]
SIM_MS = Path(__file__).resolve().parent / "sim_ms.py"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
CACHE = Path(tempfile.gettempdir()) / "regen-bench-cache"
# the launch template the supervisor formats per worker; sim_ms.py pins itself from the env
SIM_LAUNCH = ("{python} " + str(SIM_MS) + " --model-path {model} --host {host} --port {port} --tp-size {tp}"
              " --enable-metrics")


def cpu_layout() -> tuple[set[int], set[int]]:
    """(engine cpus, simulator cpus): the first allowed core for the engine, the rest for the servers."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print(f"warning: only {len(cpus)} CPU allowed; engine and simulators share it", file=sys.stderr)
        return {cpus[0]}, {cpus[0]}
    return {cpus[0]}, set(cpus[1:])


ENGINE_CPUS, SIM_CPUS = cpu_layout()


def cpus_env(cpus: set[int]) -> dict[str, str]:
    return {"REGEN_BENCH_CPUS": ",".join(str(c) for c in sorted(cpus))}


def tiny_model() -> Path:
    from engine.text.tiny_model import build_tiny_model

    return build_tiny_model(CACHE / "tiny-model")


def write_prompts(path: Path, n: int, *, seed: int = 0, words: int = 40) -> Path:
    """n single-turn chat rows (`id`, `messages`), ~`words` words each."""
    import random

    rng = random.Random(seed)
    vocab = "the model answer question reason step value number list function code python proof".split()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(rng.choice(vocab) for _ in range(words))
            f.write(json.dumps({"id": f"c{i:07d}", "messages": [{"role": "user", "content": f"{text} ({i})"}]}) + "\n")
    return path


def free_port_block(n: int) -> int:
    from console.commands.demo import free_port_block as block

    return block(n)


def write_result(name: str, result: dict) -> Path:
    """tests/bench/results/<name>.json, indented, one trailing newline; returns the path."""
    out = RESULTS_DIR / f"{name}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- timestamps ------------------------------------------------------------------------------------
_SUP_TS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
_SIM_TS = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.(\d{3})")


def _epoch(stamp: str, ms: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp() + int(ms) / 1000.0


def supervisor_lines(run_dir: Path) -> list[tuple[float, str]]:
    """(epoch seconds, line) of supervisor.log (logging's asctime has milliseconds)."""
    out = []
    for line in (run_dir / "supervisor.log").read_text(errors="replace").splitlines():
        m = _SUP_TS.match(line)
        if m:
            out.append((_epoch(m.group(1), m.group(2)), line))
    return out


def first_line_time(lines: list[tuple[float, str]], needle: str) -> float | None:
    return next((t for t, line in lines if needle in line), None)


def sim_lines(log_path: Path) -> list[tuple[float, str]]:
    """(epoch seconds, line) of a sim_ms.py log (millisecond stamps)."""
    out = []
    with open(log_path, errors="replace") as f:
        for line in f:
            m = _SIM_TS.match(line)
            if m:
                out.append((_epoch(m.group(1), m.group(2)), line.rstrip("\n")))
    return out


_PREFILL = re.compile(r"Prefill batch, #new-seq: (\d+), #new-token: (\d+), .*#running-req: (\d+),")


@dataclass(frozen=True)
class Prefill:
    """A simulator's (and SGLang's) Prefill log line: an admission."""
    new_seq: int
    new_token: int
    running_before: int


def prefill_of(line: str) -> Prefill | None:
    m = _PREFILL.search(line)
    return Prefill(int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def admitted_requests(line: str) -> int | None:
    """#new-seq of a simulator's Prefill line; None for any other line and for a /health probe's one-token prompt,
    which is the harness's or the engine's liveness check, not the client's work (counted, it would start a
    client's window at the probe: ~2 s before a baseline's first request, the time its process takes to start)."""
    p = prefill_of(line)
    if p is None or (p.new_seq, p.new_token) == (1, 1):
        return None
    return p.new_seq


# -- processes -------------------------------------------------------------------------------------
def _pinned(cpus: set[int]):
    def pin() -> None:
        os.sched_setaffinity(0, cpus)
    return pin


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise RuntimeError(f"simulator at {url} exited with {proc.returncode} before it was ready:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.1)
    raise RuntimeError(f"simulator at {url} not healthy after {timeout:.0f} s (last error: {last})")


@dataclass
class SimProcs:
    procs: list[subprocess.Popen]
    urls: list[str]
    logs: list[Path]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                print(f"simulator pid {p.pid} did not stop 15 s after SIGTERM: killed", file=sys.stderr)
                p.kill()
                p.wait(timeout=5)


def start_sims(n: int, model: Path, args: list[str], log_dir: Path, *, ready_timeout: float = 120,
               env: dict[str, str] | None = None) -> SimProcs:
    """n simulators (sim_ms.py) on SIM_CPUS, each in its own process, with `env` added to their environment; waits
    until all are healthy."""
    base = free_port_block(n)
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, urls, logs = [], [], []
    env = dict(os.environ, **cpus_env(SIM_CPUS), **(env or {}))
    for i in range(n):
        port = base + i
        log = log_dir / f"sim{i}.log"
        argv = [sys.executable, str(SIM_MS), "--model-path", str(model), "--host", "127.0.0.1", "--port", str(port),
                "--enable-metrics", *args]
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env, start_new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
        logs.append(log)
    sims = SimProcs(procs, urls, logs)
    try:
        for url, proc, log in zip(urls, procs, logs):
            wait_healthy(url, ready_timeout, proc, log)
    except BaseException:
        sims.stop()
        raise
    return sims


@dataclass
class SupervisorRun:
    run_dir: Path
    started_at: float  # epoch seconds just before the supervisor process was spawned
    exit_code: int
    wall_s: float
    peak_rss_bytes: int
    cpu_s: float  # user + system CPU seconds of the supervisor process itself (last sample before exit)
    cpu_trace: list[tuple[float, float]]  # (epoch, cpu_s) samples

    def cpu_at(self, when: float) -> float:
        """The supervisor's CPU seconds at epoch `when` (linear between samples)."""
        trace = self.cpu_trace
        for (t0, c0), (t1, c1) in zip(trace, trace[1:]):
            if t0 <= when <= t1:
                return c0 + (c1 - c0) * ((when - t0) / (t1 - t0) if t1 > t0 else 0.0)
        return trace[-1][1] if trace and when > trace[-1][0] else (trace[0][1] if trace else 0.0)
    lines: list[tuple[float, str]]


def write_run_config(cfg: RunConfig) -> Path:
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.toml").write_text(dump_toml(cfg))
    return run_dir


def run_supervisor(cfg: RunConfig, *, timeout: float, rss_sample_s: float = 0.05, stop_when=None,
                   profile: Path | None = None) -> SupervisorRun:
    """The real supervisor (`python -m engine.supervisor`) on ENGINE_CPUS until it exits; its peak RSS
    (psutil, sampled every rss_sample_s) is of the supervisor process itself, not its simulators.
    `stop_when(run_dir) -> bool`, polled, sends SIGTERM (stop) once true. `profile`: run it under
    cpu_profile.py (cProfile, CPU-time clock) and write the pstats file there."""
    import psutil

    run_dir = write_run_config(cfg)
    env = dict(os.environ)
    started = time.time()
    t0 = time.monotonic()
    with open(run_dir / "supervisor.log", "ab") as log:
        prefix = [sys.executable]
        if profile is not None:  # CPU-time cProfile of the main thread: profile (pstats) + .txt summary
            prefix += [str(Path(__file__).resolve().parent / "cpu_profile.py"), str(profile)]
        proc = subprocess.Popen([*prefix, "-m", "engine.supervisor", "--run-dir", str(run_dir)],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=str(REPO),
                                start_new_session=True, preexec_fn=_pinned(ENGINE_CPUS))
    ps = psutil.Process(proc.pid)
    peak = 0
    cpu = 0.0
    trace: list[tuple[float, float]] = []
    stopped = False
    try:
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"supervisor on {run_dir} still running after {timeout:.0f} s; "
                                   f"see {run_dir}/supervisor.log")
            try:
                peak = max(peak, ps.memory_info().rss)
                times = ps.cpu_times()
                cpu = times.user + times.system
                trace.append((time.time(), cpu))
            except psutil.NoSuchProcess:
                break
            if stop_when is not None and not stopped and stop_when(run_dir):
                proc.terminate()
                stopped = True
            time.sleep(rss_sample_s)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=5)
    wall = time.monotonic() - t0
    return SupervisorRun(run_dir, started, proc.returncode, wall, peak, cpu, trace, supervisor_lines(run_dir))


def sim_config(model: Path, prompts: list[Path], run_dir: Path, *, gpus: int, sim_args: list[str],
               **overrides) -> RunConfig:
    from engine.config.load import Alerts, Dispatch, Sampling, Workers

    workers = Workers(gpus=tuple(range(gpus)), base_port=free_port_block(gpus), launch=SIM_LAUNCH,
                      extra_args=tuple(sim_args), env=cpus_env(SIM_CPUS), ready_timeout_s=120.0)
    cfg = RunConfig(run_dir=str(run_dir), model=str(model), prompts=tuple(str(p) for p in prompts),
                    host_python=sys.executable, turns="last", shard_size=1_000_000,
                    sampling=Sampling(), workers=workers, dispatch=Dispatch(request_timeout_s=600.0),
                    alerts=Alerts(disk_free_min_gb=1.0))
    return cfg.model_copy(update=overrides)


def machine() -> dict:
    return {"cpus": os.cpu_count(), "engine_cpus": sorted(ENGINE_CPUS), "sim_cpus": sorted(SIM_CPUS),
            "load_avg_1m": os.getloadavg()[0], "python": sys.version.split()[0]}


# -- the peer-like baseline clients' pieces (bench_occupancy, bench_spread, bench_ingest) ---------------------------
def first_rows(prompts: Path, n: int) -> list[dict]:
    """The first n rows of a JSONL prompt file."""
    rows = []
    with open(prompts) as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) >= n:
                break
    return rows


def chat_completion(url: str, row: dict, max_tokens: int, timeout: float) -> int:
    """One blocking `/v1/chat/completions` request as a peer's regeneration client sends it; its completion tokens."""
    import http.client
    from urllib.parse import urlparse

    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    body = json.dumps({"model": "default", "messages": row["messages"], "max_tokens": max_tokens,
                       "temperature": 0.6, "top_p": 0.95, "rid": f"{row['id']}#turn0"})
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {data}")
    return data["usage"]["completion_tokens"]

