"""Find a run dir on a host before talking to its supervisor, and say plainly when it is not there.

`locate_run_dir` resolves DIR the way the host's shell does (`~` is the remote home, a relative path is
under the login directory) and returns its absolute path; a path that does not exist, or is not a
directory, raises NoSuchRunDir naming the path looked at, on which host, and the OS error's name.
"""
from __future__ import annotations

from console.host.run_client import RunClientError
from console.host.transport import Transport, TransportError
from probes.shell import shell_path

LOOKUP_TIMEOUT_S = 30.0
_MISSING_EXIT = 66  # EX_NOINPUT


class NoSuchRunDir(RunClientError):
    """The run dir does not exist on the host (or is not a directory)."""

    def __init__(self, host: str, run_dir: str, looked_at: str, error: str, cwd: str):
        self.host, self.run_dir, self.looked_at, self.error, self.cwd = host, run_dir, looked_at, error, cwd
        where = looked_at if looked_at.startswith("/") else f"{looked_at} under {cwd}"
        what = "no such run dir" if error == "FileNotFoundError" else "not a run dir (not a directory)"
        super().__init__(f"{host}:{run_dir}: {what} ({error}); looked for {where} on {host}. Give the run dir "
                         f"`regen start` printed (started: ... on HOST:DIR)", kind="unreachable")


def lookup_command(run_dir: str) -> str:
    """Prints the absolute path, or exits 66 after printing the error name, the path as expanded, and $PWD."""
    return (f"d={shell_path(run_dir)}; "
            f"if [ ! -e \"$d\" ]; then printf '%s\\n' FileNotFoundError \"$d\" \"$PWD\"; exit {_MISSING_EXIT}; fi; "
            f"if [ ! -d \"$d\" ]; then printf '%s\\n' NotADirectoryError \"$d\" \"$PWD\"; exit {_MISSING_EXIT}; fi; "
            f"cd -- \"$d\" && pwd -P")


async def locate_run_dir(transport: Transport, run_dir: str) -> str:
    """The run dir's absolute path on the host; NoSuchRunDir if it is not there."""
    command = lookup_command(run_dir)
    try:
        result = await transport.run(command, timeout=LOOKUP_TIMEOUT_S)
    except TransportError as exc:
        raise RunClientError(f"cannot reach {transport.name}: {exc}", kind="unreachable") from exc
    lines = result.stdout.splitlines()
    if result.exit_status == _MISSING_EXIT and len(lines) >= 3:
        raise NoSuchRunDir(transport.name, run_dir, lines[-2], lines[-3], lines[-1])
    if result.exit_status != 0 or not lines:
        why = (f"exit status {result.exit_status}" if result.exit_status is not None
               else ("timed out" if result.timed_out else (result.error or "no exit status")))
        raise RunClientError(f"cannot open run dir {run_dir} on {transport.name} ({why}): `{command}`; stderr: "
                             f"{result.stderr.strip() or '(empty)'}", kind="unreachable")
    return lines[-1]
