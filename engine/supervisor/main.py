"""The supervisor process: `python -m engine.supervisor --run-dir D` (engine/supervisor/__main__.py): logging, the
pid file, the config and run dir, then the Supervisor; a fatal error is recorded (fatal.json, a `fatal` event) and
every exit ends with one `run_end` event. The exit codes: EXIT_CODES_HELP."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

import psutil

from engine import safe_log
from engine.api.events import RunEndEvent
from engine.api.wire import RunState
from engine.config.load import ConfigError, RunConfig, load_config, resolve_sampling
from engine.fatal import PREVIOUS_FILE, FatalWriteError, SpaceReserve, WorkersFailed, archive_previous, fallback_path, is_disk_full, record_for, write_fatal
from engine.api.status import FatalRecord
from engine.notify import Notifier
from engine.servers.startup import StartupChecks
from engine.store.manifest import ManifestError, write_run_manifest
from engine.store.run_dir import ConfigChanged, RunDirError, prepare_run_dir
from engine.supervisor.lifecycle import EXIT_CHANGED, EXIT_CONFIG, EXIT_FAILED, EXIT_INPUT, EXIT_LOCKED, EndHow
from engine.supervisor.supervisor import Supervisor
from engine.telemetry import Telemetry
from engine.text.row_errors import PromptFileError
from engine.text.render import RenderError

log = logging.getLogger("regen.supervisor")

DESCRIPTION = "The supervisor process on the training host: `python -m engine.supervisor --run-dir D`."
EXIT_CODES_HELP = """Exit codes:
  0  done, drained or stopped
  1  the run failed: every worker failed, an OS error (a full disk), an internal error (fatal.json)
  2  unusable run config or run dir (ConfigError, RunDirError)
  3  the content config changed: refused to resume (ConfigChanged)
  4  another supervisor holds the run dir (nothing written: the run dir is that supervisor's)
  5  the run's input cannot be read: prompt files (PromptFileError) or tokenizer / model dir (RenderError)
"""
# the exit code of a fatal exception (first match in its MRO); anything else is EXIT_FAILED
EXIT_FOR = ((ConfigChanged, EXIT_CHANGED), (ConfigError, EXIT_CONFIG), (RunDirError, EXIT_CONFIG),
            (PromptFileError, EXIT_INPUT), (RenderError, EXIT_INPUT))


def setup_logging(run_dir: Path) -> None:
    """INFO to stderr and supervisor.log (one handler when the starter made stderr that file); both degrade on a
    full disk instead of printing a `--- Logging error ---` block per record (engine.safe_log)."""
    log_path = run_dir / "supervisor.log"
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    stderr_handler = safe_log.ResilientHandler(2, str(log_path) if _stderr_is(log_path) else "stderr")
    stderr_handler.setFormatter(fmt)
    root.addHandler(stderr_handler)
    if not _stderr_is(log_path):
        file_handler = safe_log.ResilientHandler(safe_log.open_log_fd(str(log_path)), str(log_path))
        file_handler.setFormatter(fmt)
        root.addHandler(file_handler)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _stderr_is(path: Path) -> bool:
    """The starter redirects stderr into supervisor.log; then one handler is enough."""
    try:
        a, b = os.fstat(2), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class PidFile:
    def __init__(self, path: Path):
        self.path = path

    def acquire(self) -> str | None:
        """Take the pid file; returns a refusal message if a live supervisor holds it."""
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            text = ""
        if text:
            holder = _live_supervisor(text)
            if holder:
                return f"another supervisor (pid {text}) runs on this run dir: {holder}"
            log.info("replacing stale pid file %s (pid %s is not a live supervisor)", self.path, text)
        tmp = self.path.with_suffix(".pid.tmp")
        tmp.write_text(f"{os.getpid()}\n")
        os.replace(tmp, self.path)
        return None

    def release(self) -> None:
        try:
            if self.path.read_text().strip() == str(os.getpid()):
                self.path.unlink()
        except FileNotFoundError:
            log.warning("pid file %s was already removed", self.path)


def _live_supervisor(pid_text: str) -> str | None:
    try:
        pid = int(pid_text)
    except ValueError:
        return None
    if pid == os.getpid():
        return None
    try:
        cmdline = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return f"pid {pid} (cmdline not readable: access denied)"
    joined = " ".join(cmdline)
    return joined if "engine.supervisor" in joined else None


def _exit_code_for(exc: BaseException) -> int:
    for cls, code in EXIT_FOR:
        if isinstance(exc, cls):
            return code
    return EXIT_FAILED


def _log_failure(exc: BaseException) -> None:
    """Known causes in one line (their text says what and where); anything else with its traceback."""
    if isinstance(exc, ConfigChanged):
        log.error("refusing to resume: %s", exc)
    elif isinstance(exc, (ConfigError, RunDirError, PromptFileError, RenderError, WorkersFailed, OSError)) \
            or is_disk_full(exc):
        log.error("%s: %s", type(exc).__name__, exc)
    else:
        log.error("supervisor failed: %s: %s", type(exc).__name__, exc, exc_info=exc)


def say_fatal(record: FatalRecord, run_dir: Path, reserve: SpaceReserve | None,
              telemetry: Telemetry | None) -> None:
    """The last words: fatal.json (room made by giving up the reserve), the `fatal` event, a log line on stderr."""
    if reserve is not None:
        why = reserve.release()
        if why:
            log.error("%s", why)
    try:
        where = str(write_fatal(run_dir, record))
    except FatalWriteError as exc:
        where = f"nowhere: {exc}"
    log.error("FATAL (%s, exit %d): %s\n  path: %s\n  remedy: %s\n  recorded in %s", record.phase,
              record.exit_code, record.headline, record.path or "-", record.remedy, where)
    if telemetry is not None:
        telemetry.emit(record.event())


async def _load_and_run(run_dir: Path, config_path: Path) -> int:
    """Everything after the pid file, inside the event loop (listeners of the `fatal` and `run_end` events, such as
    a notifier, may still use it): load the config, prepare the run dir, supervise; a fatal error is recorded,
    and one `run_end` event emitted, before the return."""
    reserve = SpaceReserve(run_dir)
    startup = StartupChecks()
    telemetry: Telemetry | None = None
    notifier: Notifier | None = None
    sup: Supervisor | None = None
    failure: tuple[BaseException, str] | None = None
    code = EXIT_FAILED
    try:
        previous = archive_previous(run_dir)
        if previous is not None:
            log.info("the previous supervisor on this run dir ended with %s (kept in %s)", previous.headline,
                     PREVIOUS_FILE)
        why = reserve.take()
        if why:
            log.warning("%s; a fatal record would go to %s", why, fallback_path(run_dir))
        telemetry = Telemetry(run_dir)
        cfg, effective = resolve_sampling(load_config(config_path))
        startup.ok("config", str(config_path))
        log.info("sampling: %s%s", ", ".join(f"{s.key} {s.value!r} ({s.source})" for s in effective.sources),
                 f"; {effective.note}" if effective.note else "")
        if cfg.notify.enabled:  # from here on a death or the run's end reaches an operator who is not looking
            notifier = Notifier(cfg.notify, run_dir, telemetry.emit)
            telemetry.listeners.append(notifier.on_event)
            notifier.start()
        cfg = cfg.model_copy(update={"run_dir": str(run_dir)})
        prepare_run_dir(cfg)
        startup.ok("run_dir", str(run_dir))
        _write_manifest(cfg, run_dir)
        _single_cpu_tokenizer()
        sup = Supervisor(cfg, run_dir, telemetry, startup, notifier)
        code = await sup.run()
        _write_manifest(cfg, run_dir)
        if sup.fatal_exc is not None:
            failure = (sup.fatal_exc, sup.fatal_phase)
            code = code or EXIT_FAILED
    except Exception as exc:  # every fatal error ends here, recorded below: never a silent exit
        failure = (exc, sup.phase if sup is not None else "start")
        code = _exit_code_for(exc)
        _log_failure(exc)
    record = None
    if failure is not None:
        failed, phase = failure
        startup.fail_pending(f"{type(failed).__name__}: {failed}")
        record = record_for(failed, run_dir=run_dir, phase=phase, exit_code=code,
                            default_path=str(config_path) if isinstance(failed, ConfigError) else None)
        say_fatal(record, run_dir, reserve, telemetry)
    else:
        why = reserve.release()
        if why:
            log.error("%s", why)
    if telemetry is not None:
        ledger = sup.ledger if sup is not None else None
        if record is not None:
            state, cause = RunState.FAILED, record.headline
        else:
            how = sup.end_how if sup is not None else None
            state = RunState.DRAINED if how == EndHow.DRAIN else (sup.mode if sup is not None else RunState.FAILED)
            cause = sup.end_cause if sup is not None else ""
        telemetry.emit(RunEndEvent(state=state, exit_code=code, cause=cause, done=ledger.done if ledger else 0,
                                   total=ledger.to_generate if ledger else 0))
        if notifier is not None:
            await notifier.aclose()  # bounded: notify.flush_timeout_s
        telemetry.close()
    return code


def _write_manifest(cfg: RunConfig, run_dir: Path) -> None:
    """run_dir/manifest.json; a failure to write it is logged and does not stop the run (the shards are the data)."""
    try:
        write_run_manifest(cfg, run_dir)
    except (ManifestError, OSError) as exc:
        log.warning("manifest not written: %s", exc)


def _single_cpu_tokenizer() -> None:
    """On one CPU the Rust tokenizer's thread pool only adds hand-offs (~10% of a prompt's encode):
    turn it off there, unless the operator set TOKENIZERS_PARALLELISM."""
    try:
        one_cpu = len(os.sched_getaffinity(0)) == 1
    except (AttributeError, OSError):
        one_cpu = os.cpu_count() == 1
    if one_cpu:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.supervisor", description=DESCRIPTION,
                                     epilog=EXIT_CODES_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--config", default=None,
                        help="the config to run with (default: RUN_DIR/run.toml); written to RUN_DIR/run.toml once the "
                             "run dir accepts it (`regen start` passes RUN_DIR/.regen/run.next.toml)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir).expanduser().resolve()
    config_path = Path(args.config).expanduser().resolve() if args.config else run_dir / "run.toml"
    if not run_dir.is_dir():
        print(f"regen supervisor: run dir {run_dir} does not exist (FileNotFoundError)", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(run_dir)
    log.info("supervisor pid %d starting on %s (python %s)", os.getpid(), run_dir, sys.executable)
    pidfile = PidFile(run_dir / "supervisor.pid")
    try:
        refusal = pidfile.acquire()
    except OSError as exc:  # e.g. a full disk: no live supervisor holds the run dir (checked first), so say why here
        _log_failure(exc)
        say_fatal(record_for(exc, run_dir=run_dir, phase="start", exit_code=EXIT_FAILED), run_dir, None, None)
        return EXIT_FAILED
    if refusal:
        log.error("refusing to start: %s", refusal)
        return EXIT_LOCKED  # the run dir, its fatal record and telemetry are the live supervisor's: nothing written
    try:
        code = asyncio.run(_load_and_run(run_dir, config_path))
    except Exception as exc:  # a failure of the recording itself: still said, on stderr and in the log
        log.error("supervisor failed while recording its end: %s: %s", type(exc).__name__, exc, exc_info=exc)
        code = EXIT_FAILED
    finally:
        pidfile.release()
    log.info("supervisor exits with %d", code)
    logging.shutdown()  # the resilient handlers write what they kept, if they can
    return code
