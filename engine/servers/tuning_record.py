"""The run's record of its --schedule-conservativeness, <run_dir>/tuning.json: the pilot's choice (`regen plan --pilot`
writes it) and each server's value since (the supervisor writes it at a change), so a resumed run starts each server
where the last start left it. Written whole (temp file, rename); a record measured on another config is not used."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.api.tuning import TuningChoice, TuningSource
from engine.api.wire import WireError, decode
from engine.config.load import RunConfig
from engine.servers.tuning_rule import CLIP_ENV
from engine.store.run_dir import TUNING_FILE

RECORD_FILE = TUNING_FILE


@dataclass
class ServerRecord:
    """One server's value as the run last launched it."""
    name: str
    value: float
    source: TuningSource
    reason: str
    changed_at: float
    floor: float | None = None  # the highest value it retracted too often at: never lowered to it again
    clip: int | None = None


@dataclass
class TuningRecord:
    config_key: str = ""
    pilot: TuningChoice | None = None
    servers: list[ServerRecord] = field(default_factory=list)

    def server(self, name: str) -> ServerRecord | None:
        return next((s for s in self.servers if s.name == name), None)


def config_key(cfg: RunConfig) -> str:
    """What a measurement holds for: the model, the servers' launch line, size and environment, the prompts and
    max_new_tokens (the ports and the tuning keys themselves are not part of it)."""
    w = cfg.workers
    env = {k: v for k, v in w.env.items() if k != CLIP_ENV}
    blob = json.dumps([cfg.model, w.launch, list(w.extra_args), env, w.tp_size, list(cfg.prompts),
                       cfg.sampling.max_new_tokens, cfg.context_length], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_record(path: Path) -> tuple[TuningRecord | None, str | None]:
    """(the record, None); (None, None) when there is none; (None, why) when it cannot be read."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"cannot read {path}: {exc}"
    try:
        return decode(TuningRecord, json.loads(text), str(path)), None
    except (ValueError, WireError) as exc:
        return None, f"{path} is not a tuning record ({exc}); remove it, or run `regen plan --pilot N` again"


def record_json(record: TuningRecord) -> str:
    """The record as the file holds it (a host's copy goes over ssh as this text)."""
    return json.dumps(asdict(record), indent=2) + "\n"


def write_record(path: Path, record: TuningRecord) -> None:
    """Replace the record whole; OSError when the run dir cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(record_json(record))
    os.replace(tmp, path)
