"""How a run was started, as the operator typed it (host, SSH options, --config relative to where they were), kept in
the run dir at each `regen start`, so every resume hint is built from the record, not guessed."""
from __future__ import annotations

import json
import os
import shlex
import socket
import time
from dataclasses import asdict, dataclass

from console.host.transport import Transport, TransportError

START_RECORD = ".regen/started.json"
KEPT = ("--config", "--ssh-config", "--accept-new", "--preflight", "--no-preflight", "--timeout")


@dataclass(frozen=True)
class StartRecord:
    argv: tuple[str, ...]  # `regen start ...` as typed, less the words that only shape its output (--json)
    cwd: str  # the directory it was typed in (a relative --config is relative to it)
    machine: str  # where it was typed
    at: float

    @classmethod
    def of(cls, argv: list[str]) -> StartRecord:
        kept = [a for a in argv if a != "--json"]
        return cls(tuple(kept), os.getcwd(), socket.gethostname(), time.time())

    def resume_hint(self) -> str:
        """`cd DIR && regen start HOST --config FILE ...`, shell-quoted: pasted on that machine, it starts this run."""
        return f"cd {shlex.quote(self.cwd)} && {shlex.join(['regen', *self.argv])}"

    def where(self) -> str:
        return f"as it was started on {self.machine}, {time.strftime('%Y-%m-%d %H:%M', time.localtime(self.at))}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def parse(text: str) -> StartRecord | None:
    try:
        data = json.loads(text)
        return StartRecord(tuple(str(a) for a in data["argv"]), str(data["cwd"]), str(data["machine"]),
                           float(data["at"]))
    except (ValueError, KeyError, TypeError):
        return None


async def read(transport: Transport, run_dir: str) -> tuple[StartRecord | None, str]:
    """The run dir's record, or None and why (a run started before regen kept one, an unreadable file)."""
    path = f"{run_dir.rstrip('/')}/{START_RECORD}"
    try:
        res = await transport.run(f"cat -- {shlex.quote(path)}", timeout=15)
    except TransportError as exc:
        return None, f"the start record {path} could not be read: {exc}"
    if res.exit_status != 0:
        return None, f"no start record in this run dir ({path}: {res.stderr.strip() or 'missing'})"
    record = parse(res.stdout)
    return (record, "") if record is not None else (None, f"the start record {path} is not regen's")
