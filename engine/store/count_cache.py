"""run_dir/count_cache.json: the counting pass's result (per-shard totals, each shard's first position, the rejected
rows), reused while the prompt files (path, size, mtime, ctime, inode, head and tail hash) and the counting config
fields are unchanged. A stale or unreadable cache is counted again, never trusted; it is written atomically after
the counting pass's rejects are in rejects.jsonl.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from engine.text.ingest import StreamStart
from engine.store.run_dir import write_atomic
from engine.store.names import shard_id_for

CACHE_FILE = "count_cache.json"
SCHEMA = "regen.count_cache/1"
SAMPLE_BYTES = 64 * 1024


class CacheUnusable(Exception):
    """The cache cannot be used; `stale` tells a changed input (normal) from a corrupt file (a warning)."""

    def __init__(self, message: str, stale: bool):
        super().__init__(message)
        self.stale = stale


@dataclass
class ShardStart:
    shard_id: str
    conversations: int
    total: int  # samples (user turns in the configured mode)
    first_index: int
    end_index: int
    start: StreamStart | None  # where its first conversation is (None: not seekable)
    first_id: str


@dataclass
class CountResult:
    shards: list[ShardStart]
    skip: dict[int, set[int]] = field(default_factory=dict)  # file number -> rejected lines / rows
    input_rejects: int = 0
    count_s: float = 0.0
    seekable: bool = True  # every reject had a position: partial streams reproduce the indices


def file_facts(files: Sequence[Path]) -> list[dict[str, Any]]:
    """What the cache is keyed on per prompt file; raises OSError for a file that cannot be read."""
    out = []
    for p in files:
        st = os.stat(p)
        h = hashlib.sha256()
        with open(p, "rb") as f:
            h.update(f.read(SAMPLE_BYTES))
            if st.st_size > 2 * SAMPLE_BYTES:
                f.seek(st.st_size - SAMPLE_BYTES)
            h.update(f.read(SAMPLE_BYTES))
        out.append({"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
                    "inode": st.st_ino, "sample_sha256": h.hexdigest()})
    return out


def config_facts(cfg) -> dict[str, Any]:
    return {"prompts": list(cfg.prompts), "prompt_format": cfg.prompt_format, "turns": cfg.turns,
            "shard_size": cfg.shard_size, "tokenizer": cfg.tokenizer_path, "enable_thinking": cfg.enable_thinking}


def _checksum(key: dict, data: dict) -> str:
    blob = json.dumps({"key": key, "data": data}, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def save(run_dir: Path, cfg, files_facts: list[dict], result: CountResult) -> Path:
    key = {"config": config_facts(cfg), "files": files_facts}
    data = {
        "shards": [[s.shard_id, s.conversations, s.total, s.first_index, s.end_index,
                    *((s.start.file_no, s.start.position, s.start.line) if s.start else (None, None, None)),
                    s.first_id] for s in result.shards],
        "skip": {str(k): sorted(v) for k, v in sorted(result.skip.items())},
        "input_rejects": result.input_rejects,
        "count_s": result.count_s,
        "seekable": result.seekable,
    }
    doc = {"schema": SCHEMA, "key": key, "data": data, "sha256": _checksum(key, data)}
    path = Path(run_dir) / CACHE_FILE
    write_atomic(path, json.dumps(doc, separators=(",", ":")))
    return path


def load(run_dir: Path, cfg, files_facts: list[dict]) -> CountResult:
    """The cached count, or CacheUnusable (stale: inputs changed; else corrupt) saying why."""
    path = Path(run_dir) / CACHE_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CacheUnusable(f"no count cache yet ({path})", stale=True) from None
    except OSError as exc:
        raise CacheUnusable(f"cannot read {path}: {exc}", stale=False) from exc
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CacheUnusable(f"{path} is not valid JSON ({exc})", stale=False) from exc
    if not isinstance(doc, dict) or not all(k in doc for k in ("schema", "key", "data", "sha256")):
        raise CacheUnusable(f"{path} is not a count cache (keys: {sorted(doc)[:8] if isinstance(doc, dict) else type(doc).__name__})",
                            stale=False)
    if doc["schema"] != SCHEMA:
        raise CacheUnusable(f"{path} has schema {doc['schema']!r}, this version writes {SCHEMA!r}", stale=True)
    key, data = doc["key"], doc["data"]
    try:
        ok = _checksum(key, data) == doc["sha256"]
    except (TypeError, ValueError) as exc:
        raise CacheUnusable(f"{path}: cannot check its checksum ({exc})", stale=False) from exc
    if not ok:
        raise CacheUnusable(f"{path}: checksum mismatch (the file was edited or damaged)", stale=False)
    if not isinstance(key, dict):
        raise CacheUnusable(f"{path}: key is not an object", stale=False)
    _check_key(path, key, config_facts(cfg), files_facts)
    try:
        return _result(data, len(files_facts), cfg.shard_size)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CacheUnusable(f"{path}: inconsistent content ({type(exc).__name__}: {exc})", stale=False) from exc


def _check_key(path: Path, key: dict, config: dict, files: list[dict]) -> None:
    old_cfg = key.get("config")
    if old_cfg != config:
        if not isinstance(old_cfg, dict):
            raise CacheUnusable(f"{path}: no config in its key", stale=False)
        changed = sorted(k for k in set(old_cfg) | set(config) if old_cfg.get(k) != config.get(k))
        raise CacheUnusable("config changed since the count: " + ", ".join(
            f"{k} {old_cfg.get(k)!r} -> {config.get(k)!r}" for k in changed), stale=True)
    old_files = key.get("files")
    if old_files == files:
        return
    if not isinstance(old_files, list) or not all(isinstance(f, dict) and "path" in f for f in old_files):
        raise CacheUnusable(f"{path}: no file list in its key", stale=False)
    old = {f["path"]: f for f in old_files}
    new = {f["path"]: f for f in files}
    lines = [f"prompt file {p} is gone" for p in sorted(set(old) - set(new))]
    lines += [f"prompt file {p} is new" for p in sorted(set(new) - set(old))]
    for p in sorted(set(old) & set(new)):
        a, b = old[p], new[p]
        diffs = [f"{k} {a.get(k)} -> {b.get(k)}" for k in ("size", "mtime_ns", "ctime_ns", "inode")
                 if a.get(k) != b.get(k)]
        if a.get("sample_sha256") != b.get("sample_sha256"):
            diffs.append("content of its first/last 64 KiB")
        if diffs:
            lines.append(f"prompt file {p} changed ({', '.join(diffs)})")
    if not lines and [f["path"] for f in old_files] != [f["path"] for f in files]:
        lines.append("prompt files in another order")
    raise CacheUnusable("; ".join(lines) or "prompt file facts differ", stale=True)


def _result(data: dict, n_files: int, shard_size: int) -> CountResult:
    shards = []
    expect_first = None
    for entry in data["shards"]:
        sid, conversations, total, first, end, file_no, position, line, first_id = entry
        for name, v in (("conversations", conversations), ("total", total), ("first_index", first),
                        ("end_index", end)):
            if type(v) is not int or v < 0:
                raise ValueError(f"shard {sid!r}: {name} {v!r} is not a non-negative int")
        if not isinstance(sid, str) or sid != shard_id_for(first, shard_size) or (
                end - 1 >= first and shard_id_for(end - 1, shard_size) != sid):
            raise ValueError(f"shard {sid!r} does not hold indices {first}..{end - 1} at shard_size {shard_size}")
        if conversations != end - first or conversations < 1:
            raise ValueError(f"shard {sid}: {conversations} conversations for indices {first}..{end - 1}")
        if expect_first is not None and first != expect_first:
            raise ValueError(f"shard {sid} starts at index {first}, the previous one ended at {expect_first}")
        expect_first = end
        if not isinstance(first_id, str):
            raise ValueError(f"shard {sid}: first conversation id {first_id!r} is not a string")
        if file_no is None:
            start = None
        else:
            if type(file_no) is not int or not 0 <= file_no < n_files or type(position) is not int or position < 0 \
                    or not (line is None or (type(line) is int and line >= 1)):
                raise ValueError(f"shard {sid}: bad start position {file_no!r}, {position!r}, {line!r}")
            start = StreamStart(file_no, position, line, first)
        shards.append(ShardStart(sid, conversations, total, first, end, start, first_id))
    skip: dict[int, set[int]] = {}
    for k, positions in data["skip"].items():
        file_no = int(k)
        if not 0 <= file_no < n_files or not all(type(p) is int and p >= 0 for p in positions):
            raise ValueError(f"skip list of file {k!r} is not a list of positions")
        skip[file_no] = set(positions)
    rejects, count_s, seekable = data["input_rejects"], data["count_s"], data["seekable"]
    if type(rejects) is not int or rejects < 0 or not isinstance(count_s, (int, float)) or type(seekable) is not bool:
        raise ValueError("input_rejects / count_s / seekable have wrong types")
    return CountResult(shards, skip, rejects, float(count_s), seekable)
