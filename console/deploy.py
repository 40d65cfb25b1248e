"""`regen start`: deploy the engine into the run dir and start the supervisor detached.

The engine package (engine/ and probes/, .py files only) is copied to <run_dir>/.regen/engine
(SFTP over SSH, a plain copy locally), run.toml is written into the run dir, and the supervisor
is started with setsid + nohup so it survives the SSH session. `.regen/launch.json` records the
host python and engine path so later commands (status, pause, ...) run the same engine.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import engine
import probes
from console.run_client import NoSupervisor, RunClient, RunClientError, engine_command
from console.run_dir_lookup import locate_run_dir
from console.ssh_options import SshOptions, add_ssh_options
from console.startup_failure import startup_failure_text
from console.transport import Transport, TransportError, quote_argv
from engine.config import RunConfig, dump_toml
from probes.shell import shell_path

START_WAIT_S = 180.0
LOG_TAIL_LINES = 200  # enough to find this start's first line in supervisor.log; a few of them are shown
LAUNCH_FILE = ".regen/launch.json"


class DeployError(Exception):
    """The run could not be started; the message says which step and what the host said."""


class AlreadyRunning(DeployError):
    """A supervisor already runs in the run dir (run_dir: absolute, on the host)."""

    def __init__(self, message: str, run_dir: str):
        super().__init__(message)
        self.run_dir = run_dir


@dataclass
class StartedRun:
    run_dir: str  # absolute path on the host
    pid: int
    host_python: str
    engine_path: str
    status: dict

    def client(self, transport: Transport) -> RunClient:
        return RunClient(transport, self.run_dir, host_python=self.host_python, engine_path=self.engine_path)


async def _run_checked(transport: Transport, command: str, what: str, timeout: float = 60.0) -> str:
    try:
        result = await transport.run(command, timeout=timeout)
    except TransportError as exc:
        raise DeployError(f"{what}: cannot reach {transport.name}: {exc}") from exc
    if result.exit_status != 0:
        why = (f"exit status {result.exit_status}" if result.exit_status is not None
               else ("timed out" if result.timed_out else (result.error or "no exit status")))
        raise DeployError(f"{what} failed on {transport.name} ({why}): `{command}`; stderr: "
                          f"{result.stderr.strip() or '(empty)'}")
    return result.stdout


async def resolve_run_dir(transport: Transport, run_dir: str, create: bool) -> str:
    expr = shell_path(run_dir)
    if create:
        command = f"mkdir -p -- {expr} && chmod 700 -- {expr} && cd -- {expr} && pwd -P"
    else:
        command = f"cd -- {expr} && pwd -P"
    out = await _run_checked(transport, command, f"{'create' if create else 'open'} run dir {run_dir}")
    return out.strip().splitlines()[-1]


def package_tree(dst: Path) -> Path:
    """engine/ and probes/ (.py files only) under dst; returns dst."""
    for pkg in (engine, probes):
        src = Path(pkg.__file__).parent
        for f in sorted(src.rglob("*.py")):
            if "__pycache__" in f.parts:
                continue
            target = dst / pkg.__name__ / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)
    return dst


async def client_for(transport: Transport, run_dir: str) -> RunClient:
    """A RunClient using the python and engine recorded at start (fallback: python3, no PYTHONPATH)."""
    abs_dir = await locate_run_dir(transport, run_dir)  # NoSuchRunDir names the path it looked for
    try:
        result = await transport.run(f"cat -- {shlex.quote(abs_dir + '/' + LAUNCH_FILE)}", timeout=30)
    except TransportError as exc:
        raise RunClientError(f"cannot reach {transport.name}: {exc}", kind="unreachable") from exc
    if result.exit_status == 0:
        try:
            launch = json.loads(result.stdout)
            return RunClient(transport, abs_dir, host_python=launch["host_python"], engine_path=launch["engine_path"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise RunClientError(f"{abs_dir}/{LAUNCH_FILE} is unreadable: {exc}") from exc
    # not started by `regen start` (e.g. `python -m engine.supervisor` by hand): the host's python3
    # must then import the engine itself; if it cannot, the ctl error says so
    return RunClient(transport, abs_dir)


async def start_run(transport: Transport, cfg: RunConfig, *, host_python: str | None = None,
                    wait_s: float = START_WAIT_S, progress: Callable[[str], None] = lambda s: None) -> StartedRun:
    python = host_python or cfg.host_python
    run_dir = await resolve_run_dir(transport, cfg.run_dir, create=True)
    engine_path = f"{run_dir}/.regen/engine"
    existing = RunClient(transport, run_dir, host_python=python, engine_path=engine_path)
    try:
        status = await existing.status()
    except RunClientError:
        status = None  # nothing answers there: the normal case for a start
    if status is not None:
        raise AlreadyRunning(f"a supervisor (pid {status.get('pid')}) already runs on {transport.name}:{run_dir}"
                             f" (state {status.get('state')})", run_dir)

    progress(f"deploying the engine to {transport.name}:{engine_path}")
    await _run_checked(transport, f"rm -rf -- {shlex.quote(engine_path)} && mkdir -p -- {shlex.quote(engine_path)}",
                       "clear the old engine copy")
    with tempfile.TemporaryDirectory(prefix="regen-deploy-") as tmp:
        tree = package_tree(Path(tmp) / "engine")
        try:
            for pkg in ("engine", "probes"):
                await transport.put(tree / pkg, f"{engine_path}/{pkg}")
            frozen = dataclasses.replace(cfg, run_dir=run_dir)
            (Path(tmp) / "run.toml").write_text(dump_toml(frozen))
            await transport.put(Path(tmp) / "run.toml", f"{run_dir}/run.toml")
            (Path(tmp) / "launch.json").write_text(json.dumps({"host_python": python, "engine_path": engine_path,
                                                               "run_dir": run_dir}))
            await transport.put(Path(tmp) / "launch.json", f"{run_dir}/{LAUNCH_FILE}")
        except TransportError as exc:
            raise DeployError(f"copying to {transport.name}:{run_dir} failed: {exc}") from exc

    rd = shlex.quote(run_dir)
    supervisor = engine_command(python, engine_path, ["-m", "engine.supervisor", "--run-dir", run_dir])
    supervisor = supervisor.replace(f"{quote_argv([python])} ", f"setsid nohup {quote_argv([python])} ", 1)
    command = f"cd -- {rd} && {{ {supervisor} >> supervisor.log 2>&1 < /dev/null & }} && echo $!"
    progress(f"starting the supervisor: {command}")
    out = await _run_checked(transport, command, "start the supervisor")
    try:
        pid = int(out.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise DeployError(f"starting the supervisor printed no pid: stdout {out!r}") from exc

    client = RunClient(transport, run_dir, host_python=python, engine_path=engine_path)
    deadline = time.monotonic() + wait_s
    last_error = ""
    while time.monotonic() < deadline:
        try:
            status = await client.status()
            return StartedRun(run_dir=run_dir, pid=pid, host_python=python, engine_path=engine_path, status=status)
        except RunClientError as exc:
            last_error = str(exc)
        alive = await transport.run(f"kill -0 {pid}", timeout=15)
        if alive.exit_status != 0:
            log_path = f"{run_dir}/supervisor.log"
            tail = await transport.run(f"tail -n {LOG_TAIL_LINES} -- {shlex.quote(log_path)}", timeout=15)
            raise DeployError(startup_failure_text(pid, f"{transport.name}:{run_dir}", log_path,
                                                   tail.stdout if tail.exit_status == 0 else tail.stderr))
        await asyncio.sleep(0.5)
    raise DeployError(f"the supervisor (pid {pid}) did not answer status within {wait_s:.0f} s: {last_error}")


# -- shared by the run commands (status, pause, resume, stop) ---------------------------------
EXIT_OK, EXIT_ERROR, EXIT_UNREACHABLE = 0, 1, 2


def add_host_args(parser, *, run_dir_required: bool = True) -> None:
    parser.add_argument("host", help="ssh alias, user@host[:port], or `local`")
    parser.add_argument("--run-dir", required=run_dir_required, help="the run dir on the host")
    add_ssh_options(parser)


def run_with_client(args, op) -> int:
    """Open the transport, build the RunClient from the run dir, await op(client); map errors to exit codes."""
    import sys

    from console.hints import cannot_reach
    from console.transport import open_transport

    async def main() -> int:
        try:
            transport = await open_transport(args.host, **SshOptions.from_args(args).connect_kwargs())
        except TransportError as exc:
            print(cannot_reach(args.host, exc, args), file=sys.stderr)
            return EXIT_UNREACHABLE
        try:
            client = await client_for(transport, args.run_dir)
            return await op(client)
        except NoSupervisor as exc:
            print(f"regen {args.command}: {no_supervisor_text(args, client.run_dir, exc)}", file=sys.stderr)
            return EXIT_UNREACHABLE
        except RunClientError as exc:
            print(str(exc), file=sys.stderr)
            return EXIT_UNREACHABLE if exc.kind == "unreachable" else EXIT_ERROR
        finally:
            await transport.close()

    return asyncio.run(main())


def no_supervisor_text(args, run_dir: str, exc: NoSupervisor) -> str:
    """A run whose supervisor is not running, and the `regen start` that resumes it (run_dir: absolute)."""
    from console.hints import hint_from_args

    local = args.host == "local"
    config = f"{run_dir}/run.toml" if local else "run.toml"
    text = (f"no supervisor runs in {args.host}:{run_dir} (the run is stopped or finished); "
            f"to resume it:\n  {hint_from_args(args, 'start', '--config', config)}")
    if "does not exist" not in exc.stderr:  # e.g. a socket left by a killed supervisor: what answered
        text += f"\n  (the control socket: {exc.stderr or exc})"
    if not local:
        text += (f"\n  (run.toml: the config the run was started with; {args.host} keeps a copy at "
                 f"{run_dir}/run.toml)")
    return text
