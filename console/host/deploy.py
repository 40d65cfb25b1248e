"""`regen start`'s deploy: the engine (engine/ and probes/, .py files) copied to <run_dir>/.regen/engine, the config
staged, the supervisor started detached (setsid + nohup), and .regen/launch.json recording the python and engine path
later commands use. start_run() reports a run started only once its start checks pass; a supervisor that died during
its start raises StartFailed with its recorded cause."""
from __future__ import annotations

import asyncio
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
from console.view.cause import cause_lines
from console.host.remote_engine import engine_command
from console.host.run_client import ClientErrorKind, NoSupervisor, RunClient, RunClientError
from console.host.run_dir_lookup import locate_run_dir
from console.host.ssh_options import add_ssh_options
from console.view.startup_failure import cause_first, startup_failure_text
from console.host.transport import Transport, TransportError, quote_argv
from console.host.start_record import START_RECORD, StartRecord, read as start_record_read
from engine.api.wire import ALREADY_SETTLED, LIVE_WORKER_STATES, RunState
from engine.config.load import RunConfig, dump_toml
from engine.api.status import CheckState, FatalRecord, RunStatus, StartCheck
from probes.shell import shell_path

START_WAIT_S = 180.0
EXIT_WAIT_S = 30.0  # a supervisor that found nothing to generate: time for it to exit (it does so at once)
WORKERS_FAILED_GRACE_S = 10.0  # a failed workers check: time for the supervisor to exit with its recorded cause
LOG_TAIL_LINES = 200  # enough to find this start's first line in supervisor.log; a few of them are shown
LAUNCH_FILE = ".regen/launch.json"
# the config this start brings: the supervisor (--config) writes it to run.toml only once the run dir accepts
# it, so a refused config change leaves the run's own run.toml (the one the resume hints name) as it was
NEXT_CONFIG = ".regen/run.next.toml"


class DeployError(Exception):
    """The run could not be started; the message says which step and what the host said."""


class StartFailed(DeployError):
    """The supervisor was launched but the run did not start: it died (`fatal` is its recorded cause, or None when
    it recorded none: `log_tail`), or a start check failed while it lives (`check`)."""

    def __init__(self, message: str, *, pid: int, run_dir: str, fatal: FatalRecord | None = None,
                 log_tail: list[str] | None = None, check: StartCheck | None = None, alive: bool = False):
        super().__init__(message)
        self.pid, self.run_dir, self.fatal, self.check, self.alive = pid, run_dir, fatal, check, alive
        self.log_tail = log_tail or []

    def to_dict(self) -> dict:
        return {"started": False, "run_dir": self.run_dir, "pid": self.pid, "supervisor_alive": self.alive,
                "error": str(self), "fatal": self.fatal.to_dict() if self.fatal is not None else None,
                "failed_check": self.check.to_dict() if self.check is not None else None, "log_tail": self.log_tail}


class AlreadyFinished(DeployError):
    """The run was finished already (every sample settled): the supervisor started found nothing to generate and
    exited; nothing runs (`status`: the run dir's last status, state done)."""

    def __init__(self, message: str, run_dir: str, status: RunStatus):
        super().__init__(message)
        self.run_dir, self.status = run_dir, status

    def to_dict(self) -> dict:
        return {"started": False, "already_finished": True, "run_dir": self.run_dir, "error": str(self),
                "status": self.status.to_dict()}


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
    status: RunStatus  # its first status once its start checks passed
    warning: str = ""  # started, but not as configured: e.g. `started with 1 of 2 workers: gpu0 refused (...)`

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
        if pkg.__file__ is None:  # a namespace package: no __init__.py to find its files from
            raise RuntimeError(f"{pkg.__name__} has no __init__.py here: cannot package it for the host")
        src = Path(pkg.__file__).parent
        for f in sorted(src.rglob("*.py")):
            if "__pycache__" in f.parts:
                continue
            target = dst / pkg.__name__ / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)
    return dst


async def client_for(transport: Transport, run_dir: str, host_python: str = "python3") -> RunClient:
    """A RunClient using the python and engine recorded at start (fallback: `host_python`, no PYTHONPATH)."""
    # NoSuchRunDir names the path it looked for; NotARunDir what that directory holds instead of a run
    abs_dir = await locate_run_dir(transport, run_dir, require_run=True)
    try:
        result = await transport.run(f"cat -- {shlex.quote(abs_dir + '/' + LAUNCH_FILE)}", timeout=30)
    except TransportError as exc:
        raise RunClientError(f"cannot reach {transport.name}: {exc}", kind=ClientErrorKind.UNREACHABLE) from exc
    if result.exit_status == 0:
        try:
            launch = json.loads(result.stdout)
            return RunClient(transport, abs_dir, host_python=launch["host_python"], engine_path=launch["engine_path"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise RunClientError(f"{abs_dir}/{LAUNCH_FILE} is unreadable: {exc}") from exc
    # not started by `regen start` (e.g. `python -m engine.supervisor` by hand): the python the operator named
    # (or the host's python3) must then import the engine itself; if it cannot, the ctl error says so
    return RunClient(transport, abs_dir, host_python=host_python)


async def start_run(transport: Transport, cfg: RunConfig, *, host_python: str | None = None,
                    wait_s: float = START_WAIT_S, progress: Callable[[str], None] = lambda s: None,
                    record: StartRecord | None = None) -> StartedRun:
    python = host_python or cfg.host_python
    run_dir = await resolve_run_dir(transport, cfg.run_dir, create=True)
    engine_path = f"{run_dir}/.regen/engine"
    existing = RunClient(transport, run_dir, host_python=python, engine_path=engine_path)
    try:
        status = await existing.status()
    except RunClientError:
        status = None  # nothing answers there: the normal case for a start
    if status is not None:
        raise AlreadyRunning(f"a supervisor (pid {status.pid}) already runs on {transport.name}:{run_dir}"
                             f" (state {status.state})", run_dir)

    progress(f"deploying the engine to {transport.name}:{engine_path}")
    await _run_checked(transport, f"rm -rf -- {shlex.quote(engine_path)} && mkdir -p -- {shlex.quote(engine_path)}",
                       "clear the old engine copy")
    with tempfile.TemporaryDirectory(prefix="regen-deploy-") as tmp:
        tree = package_tree(Path(tmp) / "engine")
        try:
            for pkg in ("engine", "probes"):
                await transport.put(tree / pkg, f"{engine_path}/{pkg}")
            frozen = cfg.model_copy(update={"run_dir": run_dir})
            (Path(tmp) / "run.toml").write_text(dump_toml(frozen))
            await transport.put(Path(tmp) / "run.toml", f"{run_dir}/{NEXT_CONFIG}")
            (Path(tmp) / "launch.json").write_text(json.dumps({"host_python": python, "engine_path": engine_path,
                                                               "run_dir": run_dir}))
            await transport.put(Path(tmp) / "launch.json", f"{run_dir}/{LAUNCH_FILE}")
            if record is not None and (await start_record_read(transport, run_dir))[0] is None:
                # a first start: its hint is this command even if the start fails (an accepted start writes it again;
                # a refused change of an existing run keeps the run's own record)
                await _put_record(transport, run_dir, record)
        except TransportError as exc:
            raise DeployError(f"copying to {transport.name}:{run_dir} failed: {exc}") from exc

    rd = shlex.quote(run_dir)
    supervisor = engine_command(python, ["-m", "engine.supervisor", "--run-dir", run_dir,
                                         "--config", f"{run_dir}/{NEXT_CONFIG}"], engine_path=engine_path)
    supervisor = supervisor.replace(f"{quote_argv([python])} ", f"setsid nohup {quote_argv([python])} ", 1)
    command = f"cd -- {rd} && {{ {supervisor} >> supervisor.log 2>&1 < /dev/null & }} && echo $!"
    progress(f"starting the supervisor: {command}")
    out = await _run_checked(transport, command, "start the supervisor")
    try:
        pid = int(out.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise DeployError(f"starting the supervisor printed no pid: stdout {out!r}") from exc

    client = RunClient(transport, run_dir, host_python=python, engine_path=engine_path)
    status = await wait_started(transport, client, pid, wait_s, progress)
    if status.state == RunState.DONE:
        await _refuse_if_already_finished(transport, client, pid)
    # only a start that was accepted: a refused one must not replace the run's own record
    not_recorded = await _put_record(transport, run_dir, record) if record is not None else ""
    return StartedRun(run_dir=run_dir, pid=pid, host_python=python, engine_path=engine_path, status=status,
                      warning="; ".join(w for w in (partial_start(status), not_recorded) if w))


async def _refuse_if_already_finished(transport: Transport, client: RunClient, pid: int) -> None:
    """A start that reached `done` at once: if its supervisor found every sample already settled (its run_end cause,
    engine.api.wire.ALREADY_SETTLED), wait until it has exited and raise AlreadyFinished; a short run that generated its
    samples during the start is a start (returns)."""
    where = f"{transport.name}:{client.run_dir}"
    deadline = time.monotonic() + EXIT_WAIT_S
    while await _alive(transport, pid):
        if time.monotonic() > deadline:
            raise DeployError(f"the supervisor (pid {pid}) on {where} reported the run done but has not exited within "
                              f"{EXIT_WAIT_S:.0f} s; `regen stop` ends it")
        await asyncio.sleep(0.2)
    try:
        last = await client.last_status()
    except RunClientError as exc:
        raise DeployError(f"the supervisor (pid {pid}) on {where} ended at once (state done), and the run dir's last "
                          f"status could not be read: {exc}") from exc
    if last.run_end is None or last.run_end.cause != ALREADY_SETTLED:
        return
    d = last.dispatch
    figures = f"{d.done}/{d.total} samples, " if d is not None else ""
    raise AlreadyFinished(f"the run on {where} is already finished (state done: {figures}{ALREADY_SETTLED}); "
                          "nothing was started and no supervisor runs", client.run_dir, last)


async def _put_record(transport: Transport, run_dir: str, record: StartRecord) -> str:
    """Every later resume hint (status, the TUI) is built from this record; "" when written, else why not."""
    with tempfile.TemporaryDirectory(prefix="regen-record-") as tmp:
        path = Path(tmp) / "started.json"
        path.write_text(record.to_json())
        try:
            await transport.put(path, f"{run_dir}/{START_RECORD}")
        except TransportError as exc:
            return (f"the start record could not be written to {transport.name}:{run_dir}/{START_RECORD} ({exc}): "
                    "resume hints will be built from the frozen config")
    return ""


def partial_start(status: RunStatus) -> str:
    """`started with 1 of 2 workers: gpu0 refused (...)` when some workers did not launch, else ""."""
    if status.state == RunState.DONE:
        return ""
    workers = status.workers
    down = [w for w in workers if w.state not in LIVE_WORKER_STATES]
    if not down:
        return ""
    return (f"started with {len(workers) - len(down)} of {len(workers)} workers: "
            + "; ".join(f"{w.name} {w.state} ({w.error or 'no error text'})" for w in down))


async def wait_started(transport: Transport, client: RunClient, pid: int, wait_s: float,
                       progress: Callable[[str], None]) -> RunStatus:
    """Poll the supervisor until its start checks pass (returns its status), it died (StartFailed with the cause),
    a check failed while it lives (StartFailed), or wait_s passed (DeployError naming the checks still pending)."""
    run_dir = client.run_dir
    deadline = time.monotonic() + wait_s
    shown: dict[str, str] = {}
    last_error, status, failed_at = "", None, 0.0
    while time.monotonic() < deadline:
        try:
            status = await client.status()
        except RunClientError as exc:
            last_error, status = str(exc), None
        if status is not None:
            # an engine that does not publish start checks sends none: answering is all it says
            checks = status.startup
            for c in checks:
                if c.state == CheckState.OK and shown.get(c.check) != c.detail:
                    shown[c.check] = c.detail
                    progress(f"supervisor: {c.title or c.check}" + (f": {c.detail}" if c.detail else ""))
            failed = [c for c in checks if c.state == CheckState.FAILED]
            if failed and failed[0].check == "workers":
                failed_at = failed_at or time.monotonic()
            if failed and failed[0].check == "workers" and time.monotonic() - failed_at > WORKERS_FAILED_GRACE_S:
                # it lives on (a refused port waits for the operator, the other workers run); the start did not
                # happen as configured. (If every worker failed it exits within the grace, with its cause.)
                c = failed[0]
                if any(w.state in LIVE_WORKER_STATES for w in status.workers):
                    return status  # the run goes on with the others: a start, with a warning (partial_start)
                raise StartFailed(f"the supervisor (pid {pid}) could not launch its workers: {c.detail}; it is"
                                  f" still running on {transport.name}:{run_dir} (`regen stop` ends it)",
                                  pid=pid, run_dir=run_dir, check=c, alive=True)
            if all(c.state == CheckState.OK for c in checks):
                return status
            # a failed input check: the supervisor is about to exit with the cause; wait for its record
        elif not await _alive(transport, pid):
            try:
                last = await client.last_status()
            except RunClientError:
                last = None
            if last is not None and last.state == RunState.DONE and not last.fatal:
                return last  # a short run finished before its start checks were all seen: it started, and is done
            raise await _died(transport, client, pid)
        await asyncio.sleep(0.5)
    pending = [f"{c.check} ({c.detail or c.state})" for c in (status.startup if status is not None else [])
               if c.state != CheckState.OK]
    raise DeployError(f"the supervisor (pid {pid}) did not pass its start checks within {wait_s:.0f} s"
                      + (f"; not passed: {', '.join(pending)}" if pending else f": {last_error}")
                      + f"; it may still be running: `regen status` / `regen stop` on {transport.name}:{run_dir}")


async def _alive(transport: Transport, pid: int) -> bool:
    """A zombie is not alive: a container whose init does not reap would otherwise keep `kill -0` true forever."""
    pid = int(pid)
    command = f"if [ -r /proc/self/stat ]; then cat /proc/{pid}/stat; else kill -0 {pid} && echo alive; fi"
    try:
        result = await transport.run(command, timeout=15)
    except TransportError as exc:
        raise DeployError(f"cannot check whether the supervisor (pid {pid}) lives: {exc}") from exc
    if result.exit_status != 0:
        return False
    out = result.stdout.strip()
    if ")" in out:  # /proc/PID/stat: "pid (comm) STATE ..."
        fields = out.rsplit(")", 1)[1].split()
        return bool(fields) and fields[0] not in ("Z", "X")
    return True


async def _died(transport: Transport, client: RunClient, pid: int) -> StartFailed:
    """The supervisor exited during its start: its recorded cause (a refused config change: each changed field
    first), or, when it recorded none, the end of this start's log."""
    run_dir = client.run_dir
    where = f"{transport.name}:{run_dir}"
    read_error = ""
    try:
        last = await client.last_status()
    except RunClientError as exc:
        last, read_error = RunStatus(run_dir=run_dir, state="dead", running=False, offline=True), str(exc)
    fatal = last.fatal
    if fatal:
        lines = cause_first(fatal.message, where) if fatal.exc_type == "ConfigChanged" else None
        text = "\n".join(lines) if lines else "\n".join(cause_lines(fatal))
        return StartFailed(f"the supervisor (pid {pid}) exited during its start:\n{text}", pid=pid, run_dir=run_dir,
                           fatal=fatal)
    if last.state in (RunState.DONE, RunState.STOPPED, RunState.DRAINED):
        cause = last.run_end.cause if last.run_end is not None else ""
        return StartFailed(f"the supervisor (pid {pid}) ended during its start: {last.state}"
                           + (f" ({cause})" if cause else ""), pid=pid, run_dir=run_dir)
    log_path = f"{run_dir}/supervisor.log"
    tail = await transport.run(f"tail -n {LOG_TAIL_LINES} -- {shlex.quote(log_path)}", timeout=15)
    text = tail.stdout if tail.exit_status == 0 else tail.stderr
    why = f" (its run dir's last state could not be read: {read_error})" if read_error else ""
    return StartFailed(f"no cause recorded{why}:\n" + startup_failure_text(pid, where, log_path, text),
                       pid=pid, run_dir=run_dir, log_tail=text.splitlines()[-8:])


# -- shared by the run commands (status, pause, resume, stop) ---------------------------------
EXIT_OK, EXIT_ERROR, EXIT_UNREACHABLE = 0, 1, 2


def add_host_args(parser, *, run_dir_required: bool = True) -> None:
    parser.add_argument("host", help="ssh alias, user@host[:port], or `local`")
    parser.add_argument("--run-dir", required=run_dir_required, help="the run dir on the host")
    add_ssh_options(parser)


def run_with_client(args, op) -> int:
    """Open the transport, build the RunClient from the run dir, await op(client); map errors to exit codes."""
    import sys

    from console.host.connect import open_for_command

    async def main() -> int:
        transport = await open_for_command(args)
        if transport is None:
            return EXIT_UNREACHABLE
        try:
            client = await client_for(transport, args.run_dir)
            return await op(client)
        except NoSupervisor as exc:
            record, _ = await start_record_read(transport, client.run_dir)
            print(f"regen {args.command}: {no_supervisor_text(args, client.run_dir, exc, record)}", file=sys.stderr)
            return EXIT_UNREACHABLE
        except RunClientError as exc:
            print(str(exc), file=sys.stderr)
            return EXIT_UNREACHABLE if exc.kind == ClientErrorKind.UNREACHABLE else EXIT_ERROR
        finally:
            await transport.close()

    return asyncio.run(main())


def no_supervisor_text(args, run_dir: str, exc: NoSupervisor, record: StartRecord | None = None) -> str:
    """A run whose supervisor is not running, and the `regen start` that resumes it (run_dir: absolute): from the
    run's start record when there is one, else built from the frozen config (and said so)."""
    from console.host.hints import hint_from_args

    local = args.host == "local"
    config = f"{run_dir}/run.toml" if local else "run.toml"
    hint = record.resume_hint() if record is not None else hint_from_args(args, "start", "--config", config)
    text = (f"no supervisor runs in {args.host}:{run_dir} (the run is stopped or finished); "
            f"to resume it:\n  {hint}")
    if "does not exist" not in exc.stderr:  # e.g. a socket left by a killed supervisor: what answered
        text += f"\n  (the control socket: {exc.stderr or exc})"
    if record is not None:
        text += f"\n  ({record.where()})"
    elif not local:
        text += (f"\n  (run.toml: the config the run was started with; {args.host} keeps a copy at "
                 f"{run_dir}/run.toml)")
    return text
