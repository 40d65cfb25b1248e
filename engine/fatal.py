"""The supervisor's last word: a fatal error as an engine.api.status.FatalRecord (with a remedy from REMEDIES) written
to <run_dir>/fatal.json, where `regen status` and `regen start` look first. A full disk must not eat it: a reserve
file is freed to make room, else it goes to a fallback file read_fatal() checks too; a new supervisor moves the
previous record to fatal.previous.json. Read by engine.ctl on every `status`: it imports nothing heavy."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import pwd
import shlex
import tempfile
from pathlib import Path
from typing import Iterator

from engine.api.status import FatalRecord

FATAL_FILE = "fatal.json"
PREVIOUS_FILE = "fatal.previous.json"
RESERVE_FILE = "fatal.reserve"
RESERVE_BYTES = 1 << 20  # room for the record, the fatal/run_end telemetry lines and the last log lines
LOG_FILE = "supervisor.log"
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_TEXTS = ("No space left on device", "database or disk is full", "Disk quota exceeded")


class RunRefused(Exception):
    """The servers refuse the run's requests run-wide (engine.run.refusals), or a run ended with no sample made: a
    config mistake, not bad samples. `path` is the run config the key is in."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


class WorkersFailed(Exception):
    """Every worker failed (crash loops, launch errors): the run cannot go on. `path` is the workers dir."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


class HostsFailed(WorkersFailed):
    """Every server of every [[hosts]] entry failed; `path` is the first host's workers dir (address:path)."""


# -- what went wrong, where, and what to do ------------------------------------------------------
def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_disk_full(exc: BaseException) -> bool:
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        if any(t in str(e) for t in DISK_FULL_TEXTS):  # sqlite3.OperationalError, WorkersFailed evidence
            return True
    return False


def path_of(exc: BaseException) -> str | None:
    """The file or dir the error is about: OSError.filename, or the exception's own `path` / `run_dir`."""
    for e in _chain(exc):
        for attr in ("filename", "path", "run_dir"):
            value = getattr(e, attr, None)
            if value and isinstance(value, (str, os.PathLike)):
                return str(value)
    return None


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


AGAIN = "then `regen start HOST --config run.toml` again (a run with committed shards resumes from them)"

# exception type name (any class in its MRO) -> remedy; {path}, {qpath}, {run_dir}, {user}, {log} are filled in
REMEDIES: dict[str, str] = {
    "PromptFileError": "fix `prompts` in run.toml: the file must exist and be readable by user {user}, who runs the"
                       " supervisor (`ls -l {qpath}`; `regen probe HOST --config run.toml --only prompts` looks for"
                       " it); " + AGAIN,
    "RenderError": "set `model` (or `tokenizer`) in run.toml to a local model dir with the tokenizer files and a chat"
                   " template (`regen probe HOST --config run.toml --only model.dir`); " + AGAIN,
    "ConfigChanged": "set run_dir to a new directory for a new run, or revert the changed fields above to resume",
    "ConfigError": "fix the field named above in your run.toml; then `regen start HOST --config run.toml` again",
    "RunRefused": "fix the run.toml key named above (the server's own words say which value it refuses; `regen probe HOST"
                  " --config run.toml` checks the file), then `regen start HOST --config run.toml` again: a run dir"
                  " with nothing committed takes the corrected config, and the refused samples are generated again",
    "RunDirError": "fix the run dir {path} as said above; " + AGAIN,
    "WorkersFailed": "read the server logs ({run_dir}/workers/<name>/server.log) for the cause; fix the launch (model"
                     " path, GPUs, ports, workers.launch / extra_args); " + AGAIN,
    "HostsFailed": "read each host's server logs (named above, on the host: <work_dir>/workers/<name>/server.log) for"
                   " the cause; fix the launch for those hosts (model path, GPUs and tp_size, ports, workers.launch /"
                   " extra_args); " + AGAIN,
    "PermissionError": "give user {user}, who runs the supervisor, access to {path} (`ls -ld {qpath}`); " + AGAIN,
    "OSError": "check {path}: the error above is the operating system's; " + AGAIN,
}
DISK_FULL_REMEDY = ("free space on the filesystem of {path} (`df -h {qpath}`; the disk guard pauses dispatch below"
                    " alerts.disk_free_min_gb, so something else filled it); " + AGAIN)
INTERNAL_REMEDY = ("an internal error of the supervisor: its traceback is in {log}; `regen start HOST --config run.toml`"
                   " again resumes the run; report the traceback if it happens again")


def remedy_for(exc: BaseException, path: str | None, run_dir: Path) -> str:
    fill = {"path": path or str(run_dir), "qpath": shlex.quote(path or str(run_dir)), "run_dir": str(run_dir),
            "user": _user(), "log": str(run_dir / LOG_FILE)}
    if is_disk_full(exc):
        return DISK_FULL_REMEDY.format(**fill)
    for cls in type(exc).__mro__:
        if cls.__name__ in REMEDIES:
            return REMEDIES[cls.__name__].format(**fill)
    return INTERNAL_REMEDY.format(**fill)


def record_for(exc: BaseException, *, run_dir: Path, phase: str, exit_code: int,
               default_path: str | None = None) -> FatalRecord:
    path = path_of(exc) or default_path or (str(run_dir) if is_disk_full(exc) else None)  # a write names no file
    message = str(exc) or repr(exc)
    return FatalRecord(exc_type=type(exc).__name__, message=message, path=path,
                       remedy=remedy_for(exc, path, run_dir), phase=phase, exit_code=exit_code, pid=os.getpid(),
                       log=str(run_dir / LOG_FILE))


# -- keeping it -----------------------------------------------------------------------------------
def fallback_path(run_dir: Path) -> Path:
    """Where the record goes when the run dir cannot take it (its disk is full): per user, per run dir."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"regen-fatal-{os.geteuid()}" / f"{digest}.json"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass  # never created
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # some filesystems refuse fsync on a directory: the rename stands
            raise


class FatalWriteError(Exception):
    pass


def write_fatal(run_dir: Path, record: FatalRecord) -> Path:
    """fatal.json in the run dir, else the fallback file; the path written. Raises FatalWriteError (both failed)."""
    data = (json.dumps(record.to_dict(), indent=2) + "\n").encode()
    target = Path(run_dir) / FATAL_FILE
    try:
        _atomic_write(target, data)
        return target
    except OSError as exc:
        first = f"{target}: {exc}"
    fallback = fallback_path(run_dir)
    try:
        fallback.parent.mkdir(mode=0o700, exist_ok=True)
        _atomic_write(fallback, data)
        return fallback
    except OSError as exc:
        raise FatalWriteError(f"cannot write the fatal record: {first}; fallback {fallback}: {exc}") from exc


def _load(path: Path) -> FatalRecord | None:
    try:
        st = path.stat()
        if st.st_uid != os.geteuid():
            return None  # a shared temp dir: only our own fallback counts
        return FatalRecord.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        return FatalRecord(exc_type="UnreadableFatalRecord", message=f"{path}: {type(exc).__name__}: {exc}",
                           path=str(path), remedy=f"read {path} and the supervisor log by hand", phase="",
                           exit_code=1, pid=0, log="", ts=0.0)


def read_fatal(run_dir: Path) -> FatalRecord | None:
    """The last supervisor's fatal record (run dir or fallback, the newer), or None if it recorded none."""
    found = [r for r in (_load(Path(run_dir) / FATAL_FILE), _load(fallback_path(run_dir))) if r is not None]
    return max(found, key=lambda r: r.ts) if found else None


def archive_previous(run_dir: Path) -> FatalRecord | None:
    """A new supervisor takes the run dir: the previous record becomes fatal.previous.json (returned, to be logged)."""
    previous = read_fatal(run_dir)
    if previous is None:
        return None
    data = (json.dumps(previous.to_dict(), indent=2) + "\n").encode()
    _atomic_write(Path(run_dir) / PREVIOUS_FILE, data)
    for path in (Path(run_dir) / FATAL_FILE, fallback_path(run_dir)):
        try:
            path.unlink()
        except FileNotFoundError:
            continue
    return previous


class SpaceReserve:
    """A file of RESERVE_BYTES in the run dir, deleted to make room for the last words on a full disk."""

    def __init__(self, run_dir: Path, size: int = RESERVE_BYTES):
        self.path = Path(run_dir) / RESERVE_FILE
        self.size = size
        self.held = False

    def take(self) -> str | None:
        """Returns why the reserve could not be taken (then the fallback file is the safety net), or None."""
        try:
            with open(self.path, "wb") as f:
                f.write(b"\0" * self.size)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            self.release()
            return f"cannot reserve {self.size >> 10} KiB for the fatal record at {self.path}: {exc}"
        self.held = True
        return None

    def release(self) -> str | None:
        """Delete the reserve; returns why it could not be deleted, or None."""
        self.held = False
        try:
            self.path.unlink()
        except FileNotFoundError:
            return None  # never written, or released already
        except OSError as exc:
            return f"cannot delete {self.path}: {exc}"
        return None
