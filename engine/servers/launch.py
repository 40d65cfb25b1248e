"""The launch of an SGLang server: its spec, its command line and environment, its process (own group, killed whole).

stdout+stderr go to workers/<name>/server.log; the server dies with the supervisor (PR_SET_PDEATHSIG), and a server a
dead supervisor left behind is reaped from its pid file at the next launch.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shlex
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine.config.load import RunConfig
from engine.config.schema import CONSERVATIVENESS_FLAG, MIXED_CHUNK_FLAG, operator_conservativeness
from engine.servers.identity import SERVED_NAME_FLAG, operator_served_name
from engine.servers.ranks import ServerRank, rank_argv

log = logging.getLogger("regen.workers")

PROMETHEUS_DIR_VAR = "PROMETHEUS_MULTIPROC_DIR"
SLURM_GPUS_VAR = "REGEN_SLURM_GPUS"  # set by engine.placement.slurm.step: the GPU ids Slurm gave the job step on this node


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


def launch_argv(cfg: RunConfig, spec: WorkerSpec, python: str, served_model_name: str | None = None,
                conservativeness: float | None = None, mixed_chunk: bool = False) -> list[str]:
    """The template is split first and each word formatted, so paths with spaces stay one argument.
    `served_model_name` (the per-launch identity), `conservativeness` and `mixed_chunk` (engine.servers.tuning) are
    added unless the operator's line sets its own."""
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
    if conservativeness is not None and operator_conservativeness(cfg.workers) is None:
        argv += [CONSERVATIVENESS_FLAG, f"{conservativeness:g}"]
    if mixed_chunk and MIXED_CHUNK_FLAG not in argv:
        argv.append(MIXED_CHUNK_FLAG)
    return rank_argv(argv, spec.rank) if spec.rank else argv



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


def launch_env(cfg: RunConfig, spec: WorkerSpec, worker_dir: Path,
               tuned: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: ours, its GPUs, what regen's tuning sets (engine.servers.tuning), run.toml's
    workers.env over it, its own Prometheus dir if one is used."""
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus(spec.gpus))
    env.update(tuned or {})
    env.update(cfg.workers.env)
    if env.get(PROMETHEUS_DIR_VAR):
        env[PROMETHEUS_DIR_VAR] = str(own_prometheus_dir(worker_dir))
    return env


async def spawn(argv: list[str], env: dict[str, str], shown: str, log_path: Path,
                cwd: Path) -> tuple[asyncio.subprocess.Process, int]:
    """Start the server in its own process group, its output appended to `log_path` after a launch line
    (`shown`: argv as it may be logged); returns the process and the log offset where its own output begins."""
    with open(log_path, "ab") as logf:
        logf.seek(0, os.SEEK_END)
        header = f"[regen {time.strftime('%Y-%m-%d %H:%M:%S')}] launching: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} {shown}\n"
        logf.write(header.encode())
        logf.flush()
        offset = logf.tell()
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=logf, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
            env=env, cwd=str(cwd), start_new_session=True, preexec_fn=die_with_parent,
        )
    return proc, offset


async def kill_group(proc: asyncio.subprocess.Process | None, grace_s: float, name: str) -> None:
    """SIGTERM the server's process group, SIGKILL it after `grace_s`; then SIGKILL what is left of the group."""
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
            log.warning("worker %s: pid %d still alive %.0f s after %s", name, proc.pid, wait, sig.name)
    # the group may hold children that outlived the leader
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # whole group already gone: the normal case
