"""Find a run dir on a host before talking to its supervisor, and say plainly when it is not there: locate_run_dir
resolves DIR as the host's shell does (NoSuchRunDir names the path, host and OS error); require_run refuses a
directory that holds none of what a run leaves (NotARunDir, with what it does hold)."""
from __future__ import annotations

from console.host.run_client import ClientErrorKind, RunClientError
from console.host.transport import Transport, TransportError
from probes.shell import shell_path

LOOKUP_TIMEOUT_S = 30.0
_MISSING_EXIT = 66  # EX_NOINPUT
_NOT_A_RUN_EXIT = 65  # EX_DATAERR
_NOT_A_RUN = "regen:not-a-run-dir"  # the line before the listing of a directory that is no run dir
# what `regen start` leaves in a run dir from its first moment (.regen/: the deployed engine; supervisor.log: the
# supervisor's first line; run.toml, state.sqlite: the run itself; fatal.json: a start that failed)
RUN_MARKS = ("run.toml", "state.sqlite", "supervisor.log", "fatal.json", ".regen")
FOUND_SHOWN = 10


class NoSuchRunDir(RunClientError):
    """The run dir does not exist on the host (or is not a directory)."""

    def __init__(self, host: str, run_dir: str, looked_at: str, error: str, cwd: str):
        self.host, self.run_dir, self.looked_at, self.error, self.cwd = host, run_dir, looked_at, error, cwd
        where = looked_at if looked_at.startswith("/") else f"{looked_at} under {cwd}"
        what = "no such run dir" if error == "FileNotFoundError" else "not a run dir (not a directory)"
        super().__init__(f"{host}:{run_dir}: {what} ({error}); looked for {where} on {host}. Give the run dir "
                         f"`regen start` printed (started: ... on HOST:DIR)", kind=ClientErrorKind.UNREACHABLE)


class NotARunDir(NoSuchRunDir):
    """The directory exists but holds nothing a run leaves (RUN_MARKS): no run was ever started there."""

    def __init__(self, host: str, run_dir: str, looked_at: str, found: list[str]):
        self.host, self.run_dir, self.looked_at, self.error, self.cwd = host, run_dir, looked_at, "NotARunDir", ""
        self.found = found
        shown = ", ".join(found[:FOUND_SHOWN]) + (f", ... ({len(found)} entries)" if len(found) > FOUND_SHOWN else "")
        marks = ", ".join(m + "/" if m == ".regen" else m for m in RUN_MARKS)
        RunClientError.__init__(
            self, f"{host}:{run_dir} is not a run dir: {looked_at} on {host} holds none of {marks} (it holds: "
                  f"{shown or 'nothing'}). A run dir is the directory `regen start` made for a run (run_dir in its "
                  "run.toml): run.toml, state.sqlite, shards/, rejects.jsonl, supervisor.log. Give the run dir "
                  "`regen start` printed (started: ... on HOST:DIR)", kind=ClientErrorKind.UNREACHABLE)


def lookup_command(run_dir: str, require_run: bool = False) -> str:
    """Prints the absolute path, or exits 66 after printing the error name, the path as expanded, and $PWD.
    require_run: a directory without any of RUN_MARKS exits 65 after its path, the marker line and its entries."""
    command = (f"d={shell_path(run_dir)}; "
               f"if [ ! -e \"$d\" ]; then printf '%s\\n' FileNotFoundError \"$d\" \"$PWD\"; exit {_MISSING_EXIT}; fi; "
               f"if [ ! -d \"$d\" ]; then printf '%s\\n' NotADirectoryError \"$d\" \"$PWD\"; exit {_MISSING_EXIT}; fi; "
               f"cd -- \"$d\" && pwd -P")
    if require_run:
        marks = " || ".join(f"[ -e {m} ]" for m in RUN_MARKS)
        command += f" && {{ {marks} || {{ echo {_NOT_A_RUN}; ls -A; exit {_NOT_A_RUN_EXIT}; }}; }}"
    return command


async def locate_run_dir(transport: Transport, run_dir: str, require_run: bool = False) -> str:
    """The run dir's absolute path on the host; NoSuchRunDir if it is not there; with require_run, NotARunDir if it
    holds nothing a run leaves."""
    command = lookup_command(run_dir, require_run)
    try:
        result = await transport.run(command, timeout=LOOKUP_TIMEOUT_S)
    except TransportError as exc:
        raise RunClientError(f"cannot reach {transport.name}: {exc}", kind=ClientErrorKind.UNREACHABLE) from exc
    lines = result.stdout.splitlines()
    if result.exit_status == _MISSING_EXIT and len(lines) >= 3:
        raise NoSuchRunDir(transport.name, run_dir, lines[-2], lines[-3], lines[-1])
    if result.exit_status == _NOT_A_RUN_EXIT and _NOT_A_RUN in lines[1:]:
        at = lines.index(_NOT_A_RUN, 1)
        raise NotARunDir(transport.name, run_dir, lines[at - 1], lines[at + 1:])
    if result.exit_status != 0 or not lines:
        why = (f"exit status {result.exit_status}" if result.exit_status is not None
               else ("timed out" if result.timed_out else (result.error or "no exit status")))
        raise RunClientError(f"cannot open run dir {run_dir} on {transport.name} ({why}): `{command}`; stderr: "
                             f"{result.stderr.strip() or '(empty)'}", kind=ClientErrorKind.UNREACHABLE)
    return lines[-1]
