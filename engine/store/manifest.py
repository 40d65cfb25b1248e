"""manifest.json: what produced a run's data or an export (model, template, sampling, prompts, counts, files).
The supervisor writes it in the run dir, `regen export` next to every export (with its files' rows and sha256 for
`--verify`); prompt files are fingerprinted by size and the sha256 of their first and last MiB.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import __version__
from engine.config.load import RunConfig, resolve_sampling
from engine.text.ingest import resolve_prompt_files
from engine.text.row_errors import PromptFileError

MANIFEST = "manifest.json"
SCHEMA = "regen.manifest/1"
HEAD_TAIL_BYTES = 1 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json")


class ManifestError(Exception):
    """A manifest that cannot be written or read; the message names the path."""


@dataclass
class PromptFile:
    path: str
    size: int
    sha256_head_tail: str  # sha256 of the first and last HEAD_TAIL_BYTES (the whole file when smaller)


@dataclass
class FileRecord:
    path: str  # relative to the manifest's directory
    rows: int
    bytes: int
    sha256: str


@dataclass
class Counts:
    samples: int  # committed samples read
    kept: int
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> samples
    tokens: dict[str, int] = field(default_factory=dict)  # prompt | output | supervised (of what was kept)


@dataclass
class Manifest:
    kind: str  # run | export
    created_at: float
    regen_version: str
    model: str
    tokenizer: str
    tokenizer_files: dict[str, str]  # file name -> sha256
    chat_template_sha256: str | None
    enable_thinking: bool
    sampling: dict[str, Any]
    turns: str
    config_hash: str
    prompt_files: list[PromptFile]
    counts: Counts
    files: list[FileRecord] = field(default_factory=list)
    run_dir: str = ""
    export: dict[str, Any] = field(default_factory=dict)  # format and options (kind export)
    notes: list[str] = field(default_factory=list)
    sampling_sources: dict[str, str] = field(default_factory=dict)  # key -> run.toml | generation_config.json | ...
    turns_after_cut: str = "stop"  # the run's policy for later turns after a cut turn (engine.config.load)
    # text exports: rows whose text, rendered with the model's template and re-tokenized, gives the stored ids back,
    # and those that do not by kind of difference (engine.export.agreement); empty for token formats and runs
    agreement: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        data = {k: v for k, v in data.items() if k != "schema"}
        data["prompt_files"] = [PromptFile(**p) for p in data.get("prompt_files", [])]
        data["files"] = [FileRecord(**f) for f in data.get("files", [])]
        data["counts"] = Counts(**data["counts"])
        return cls(**data)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fingerprint_prompt(path: Path) -> PromptFile:
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= 2 * HEAD_TAIL_BYTES:
            h.update(f.read())
        else:
            h.update(f.read(HEAD_TAIL_BYTES))
            f.seek(size - HEAD_TAIL_BYTES)
            h.update(f.read(HEAD_TAIL_BYTES))
    return PromptFile(str(path), size, h.hexdigest())


def build(cfg: RunConfig, *, kind: str, counts: Counts, files: list[FileRecord] | None = None,
          export: dict[str, Any] | None = None) -> Manifest:
    """The manifest of a run made with `cfg`. A file that cannot be read is recorded as a note, not
    skipped in silence (the run itself reports its missing prompt files with their own errors)."""
    notes: list[str] = []
    cfg, effective = resolve_sampling(cfg)  # the values sent, and where each came from
    if effective.note:
        notes.append(effective.note)
    tok_dir = Path(cfg.tokenizer_path).expanduser()
    tokenizer_files: dict[str, str] = {}
    for name in TOKENIZER_FILES:
        path = tok_dir / name
        if path.is_file():
            try:
                tokenizer_files[name] = sha256_file(path)
            except OSError as exc:
                notes.append(f"tokenizer file {path}: not hashed ({exc})")
    prompts: list[PromptFile] = []
    try:
        for path in resolve_prompt_files(cfg.prompts):
            try:
                prompts.append(fingerprint_prompt(path))
            except OSError as exc:
                notes.append(f"prompt file {path}: not fingerprinted ({exc})")
    except PromptFileError as exc:
        notes.append(f"prompt files not fingerprinted: {exc}")
    return Manifest(
        kind=kind, created_at=time.time(), regen_version=__version__, model=cfg.model, tokenizer=str(tok_dir),
        tokenizer_files=tokenizer_files, chat_template_sha256=chat_template_sha256(tok_dir, notes),
        enable_thinking=cfg.enable_thinking, sampling=cfg.sampling.model_dump(), turns=cfg.turns,
        config_hash=cfg.content_hash(), prompt_files=prompts, counts=counts, files=list(files or []),
        run_dir=cfg.run_dir, export=dict(export or {}), notes=notes,
        sampling_sources={s.key: s.source for s in effective.sources}, turns_after_cut=cfg.turns_after_cut)


def chat_template_sha256(tok_dir: Path, notes: list[str]) -> str | None:
    """sha256 of the chat template text transformers would load: chat_template.jinja, else
    tokenizer_config.json's `chat_template` (a string, or the list of named templates as JSON)."""
    jinja = tok_dir / "chat_template.jinja"
    try:
        if jinja.is_file():
            return hashlib.sha256(jinja.read_bytes()).hexdigest()
        config = tok_dir / "tokenizer_config.json"
        if config.is_file():
            template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
            if template is not None:
                text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
                return hashlib.sha256(text.encode()).hexdigest()
    except (OSError, ValueError) as exc:
        notes.append(f"chat template in {tok_dir}: not hashed ({exc})")
        return None
    notes.append(f"{tok_dir}: no chat template found (chat_template.jinja or tokenizer_config.json)")
    return None


def write(manifest: Manifest, directory: Path) -> Path:
    """directory/manifest.json, atomically (tmp, fsync, rename)."""
    path = Path(directory) / MANIFEST
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(manifest.to_dict(), indent=2, sort_keys=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise ManifestError(f"cannot write {path}: {exc}") from exc
    return path


def read(path: Path) -> Manifest:
    """A manifest.json (or the directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ManifestError(f"{path}: no manifest ({type(exc).__name__}: {exc.strerror}); an export made by "
                            "`regen export` has one next to its files") from exc
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: cannot read the manifest: {exc}") from exc
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ManifestError(f"{path}: not a regen manifest (schema {data.get('schema') if isinstance(data, dict) else None!r}, "
                            f"expected {SCHEMA!r})")
    try:
        return Manifest.from_dict(data)
    except (TypeError, KeyError) as exc:
        raise ManifestError(f"{path}: malformed manifest: {exc}") from exc


def write_run_manifest(cfg: RunConfig, run_dir: Path) -> Path:
    """run_dir/manifest.json with the counts committed so far (called at start and at the end of a run)."""
    from engine.store.shard_store import ShardStore  # the store imports answer_shape, pyarrow: only when writing one

    with ShardStore(run_dir) as store:
        progress = store.progress()
    samples = sum(p.done_samples for p in progress)
    counts = Counts(samples=samples, kept=samples,
                    dropped={"rejected": sum(p.rejected for p in progress), "failed": sum(p.failed for p in progress),
                             # of the rejected: later turns not generated after a cut turn (turns_after_cut = "stop")
                             "after_cut": sum(p.after_cut for p in progress)},
                    tokens={"output": sum(p.output_tokens for p in progress)})
    manifest = build(cfg.model_copy(update={"run_dir": str(run_dir)}), kind="run", counts=counts)
    manifest.notes.append("the run's part files and their rows are listed in state.sqlite (table parts); "
                          "`regen export` writes a manifest with every exported file's rows and sha256")
    return write(manifest, run_dir)
