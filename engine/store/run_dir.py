"""The run dir: its paths, and preparing it for a (re)start with a given config.
It keeps a frozen copy of the config and, in state.sqlite, the content hash and fields it was started with: a restart
whose content fields differ is refused; operational fields may change (the frozen copy is rewritten with them).
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from engine.config.load import RunConfig, changed_content_fields, dump_toml
from engine.store.rejects import REJECTS_FILE
from engine.store.names import SHARDS_DIR, STATE_DB, WRITER_LOCK
from engine.store.shard_store import ShardStore

log = logging.getLogger("regen.run_dir")

META_CONTENT_HASH = "content_hash"
DEPLOY_DIR = ".regen"  # `regen start` deploys the engine (and stages the config) here before the run dir is prepared
META_CONTENT_FIELDS = "content_fields"
META_CREATED_AT = "created_at"
# `regen plan --pilot` records its choice of the servers' tuning here before any start (engine.servers.tuning_record):
# a run dir holding only it is a new one
TUNING_FILE = "tuning.json"


@dataclass(frozen=True)
class RunPaths:
    root: Path
    run_toml: Path
    state_db: Path
    shards: Path
    rejects: Path
    workers: Path
    telemetry: Path
    supervisor_pid: Path
    supervisor_log: Path
    control_sock: Path
    writer_lock: Path

    @classmethod
    def of(cls, run_dir: str | os.PathLike) -> RunPaths:
        root = Path(run_dir).expanduser()
        return cls(
            root=root,
            run_toml=root / "run.toml",
            state_db=root / STATE_DB,
            shards=root / SHARDS_DIR,
            rejects=root / REJECTS_FILE,
            workers=root / "workers",
            telemetry=root / "telemetry.jsonl",
            supervisor_pid=root / "supervisor.pid",
            supervisor_log=root / "supervisor.log",
            control_sock=root / "control.sock",
            writer_lock=root / WRITER_LOCK,
        )

    def server_log(self, name: str) -> Path:
        return self.workers / name / "server.log"

    def shard_dir(self, shard_id: str) -> Path:
        return self.shards / shard_id


class RunDirError(Exception):
    pass


class ConfigChanged(RunDirError):
    """The run dir was started with other content fields; `changes` lists (field, old, new)."""

    def __init__(self, run_dir: Path, changes: list[tuple[str, object, object]]):
        self.run_dir = run_dir
        self.changes = changes
        listed = ", ".join(f"{name} {_show(old)} -> {_show(new)}" for name, old, new in changes)
        super().__init__(
            f"run dir {run_dir} was started with another config; changed: {listed}. "
            "Its shards were generated with the old values, so it cannot be resumed with these. To proceed, "
            "either set run_dir to a new directory to start over with these values, or revert "
            + ("this field" if len(changes) == 1 else "these fields")
            + " in the config to resume (the values the run was started with are the old ones above)."
        )


def prepare_run_dir(cfg: RunConfig) -> Path:
    paths = RunPaths.of(cfg.run_dir)
    root = paths.root
    fresh = not root.exists()
    if not fresh:
        if not root.is_dir():
            raise RunDirError(f"run dir {root} exists and is not a directory")
        deployed = (root / DEPLOY_DIR).is_dir()  # `regen start` copied the engine here; run.toml comes on acceptance
        others = [p for p in root.iterdir() if p.name != TUNING_FILE]
        if not paths.state_db.exists() and not paths.run_toml.exists() and not deployed and others:
            entries = sorted(p.name for p in others)[:8]
            raise RunDirError(f"run dir {root} is not empty and is not a regen run dir (no {STATE_DB} or run.toml; it has "
                              f"{', '.join(entries)}); choose an empty or new directory")
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if fresh:
            os.chmod(root, 0o700)  # mkdir's mode is filtered by the umask
        paths.shards.mkdir(mode=0o700, exist_ok=True)
        paths.workers.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"cannot create run dir {root}: {exc}") from exc

    fields = cfg.content_fields()
    new_hash = cfg.content_hash()
    with ShardStore(root) as store:
        old_hash = store.get_meta(META_CONTENT_HASH)
        accepted = False
        if old_hash is not None and old_hash != new_hash:
            old_fields = json.loads(store.get_meta(META_CONTENT_FIELDS) or "{}")
            changes = _changes(old_fields, fields)
            if store.committed_samples() > 0:
                raise ConfigChanged(root, changes)
            # nothing was made with the old values: a corrected config is a fresh start of the same run dir
            log.warning("run dir %s has no committed sample: its config is changed (%s) and its earlier outcomes "
                        "forgotten (%d)", root, ", ".join(f"{n} {_show(o)} -> {_show(v)}" for n, o, v in changes),
                        store.forget_outcomes())
            accepted = True
        _write_atomic(paths.run_toml, dump_toml(cfg))
        if old_hash is None or accepted:
            store.set_meta(META_CONTENT_FIELDS, json.dumps(fields, sort_keys=True))
            store.set_meta(META_CREATED_AT, repr(time.time()))
            store.set_meta(META_CONTENT_HASH, new_hash)  # last: its presence means the meta is complete
    return root


def _changes(old: dict, new: dict) -> list[tuple[str, object, object]]:
    out = []
    for name in changed_content_fields(old, new):
        if "." in name and name.split(".", 1)[0] in old and isinstance(old.get(name.split(".", 1)[0]), dict):
            top, sub = name.split(".", 1)
            out.append((name, (old.get(top) or {}).get(sub), (new.get(top) or {}).get(sub)))
        else:
            out.append((name, old.get(name), new.get(name)))
    if not out:  # same fields, another hash: the hash recipe changed
        out.append(("content_hash", "(fields equal; hash recipe differs)", ""))
    return out


def _show(value: object) -> str:
    return json.dumps(value) if not isinstance(value, (int, float)) or isinstance(value, bool) else repr(value)


def write_atomic(path: Path, text: str) -> None:
    """tmp file (0600), fsync, rename, fsync the dir: the file is the old one or the new one, whole."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    try:
        write_atomic(path, text)
    except OSError as exc:
        raise RunDirError(f"cannot write {path}: {exc}") from exc
