"""workers/<name>/identity.json: what a host agent's worker launched and how it went, read by the dispatch host."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.api.tuning import LaunchTuning
from engine.api.wire import WireError, decode

IDENTITY_FILE = "identity.json"

log = logging.getLogger("regen.hosts")


@dataclass(frozen=True)
class IdentityRecord:
    """workers/<name>/identity.json: the server this worker launched and whether it proved its
    identity. A multi-host run's dispatch host reads it (over ssh) before a remote server may join
    the router: the name the server must answer with, and the host agent's verdict."""
    name: str
    state: str
    served_model_name: str | None
    pid: int | None
    port: int
    error: str | None = None
    # the per-DP-rank batch size in this launch's start-up log line, read where the log is (the dispatch
    # host cannot read it): one of the sources of the server's batch size (engine/servers/capacity.py)
    startup_batch: int | None = None
    # the process that wrote it (a host agent): a record of an agent that has gone since is stale
    agent_pid: int | None = None
    restarts: int = 0
    last_words: tuple[str, ...] = ()  # its last crash's fatal lines (or its log's tail), kept after a relaunch
    # every crash of this agent's launches, counted: a reader that polls (the dispatch host) tells each crash once
    # even when the agent relaunched the server before the reader saw it crashed
    crashes: int = 0
    last_crash: str | None = None  # the last crash's error
    # the --schedule-conservativeness this launch runs with and where it came from (its agent's tuner); None: an agent
    # from before the field (shown N/A)
    tuning: LaunchTuning | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "IdentityRecord":
        data = json.loads(text)
        words = data.get("last_words")
        return cls(name=str(data["name"]), state=str(data["state"]), served_model_name=data.get("served_model_name"),
                   pid=data.get("pid"), port=int(data["port"]), error=data.get("error"),
                   startup_batch=_int_or_none(data.get("startup_batch")), agent_pid=_int_or_none(data.get("agent_pid")),
                   restarts=_int_or_none(data.get("restarts")) or 0,
                   last_words=tuple(str(w) for w in words) if isinstance(words, list) else (),
                   crashes=_int_or_none(data.get("crashes")) or 0,
                   last_crash=str(data["last_crash"]) if data.get("last_crash") is not None else None,
                   tuning=_tuning_or_none(data.get("tuning")))


def _tuning_or_none(value: object) -> LaunchTuning | None:
    """The launch's tuning; None where the record has none (an older agent) or one this version cannot read: the
    value is then N/A, the record still admits its server."""
    if value is None:
        return None
    try:
        return decode(LaunchTuning, value, "the identity record's tuning")
    except WireError as exc:
        log.warning("%s: shown as N/A", exc)
        return None


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def write_identity(path: Path, record: IdentityRecord) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(record.to_json() + "\n")
    os.replace(tmp, path)

