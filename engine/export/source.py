"""The run being exported: its config, one consistent snapshot of its committed parts, its shards in input order.

The parts list is one SELECT (one read transaction): an export of a running run takes exactly what was committed then.
"""
from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from engine.config.load import ConfigError, RunConfig, load_config
from engine.text.ingest import display_names, resolve_prompt_files
from engine.text.row_errors import PromptFileError
from engine.store.committed_view import read_committed
from engine.store.names import SHARD_FILE, SHARDS_DIR, STATE_DB
from engine.store.stats_columns import OPENED_COLUMN


class ExportError(Exception):
    """The export cannot be made; the message names the path or sample and the fix."""


@dataclass(frozen=True)
class ShardParts:
    shard_id: str
    paths: tuple[str, ...]  # relative to the run dir
    rows: int


@dataclass(frozen=True)
class Snapshot:
    run_dir: Path
    cfg: RunConfig
    shards: tuple[ShardParts, ...]  # in input order
    file_rank: dict[str, int]  # origin file name -> its place in the prompt files' order
    notes: tuple[str, ...]

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def parts(self) -> int:
        return sum(len(s.paths) for s in self.shards)


@dataclass(frozen=True)
class ShardBatch:
    shard_id: str
    table: pa.Table  # committed rows, sorted by input order then turn (a shard, or a slice of one)


@dataclass(frozen=True)
class ShardRows:
    shard_id: str
    table: pa.Table  # the shard's committed rows, in commit order
    order: np.ndarray  # row indices in input order, then turn

    def sorted(self, columns: list[str] | None = None, start: int = 0, stop: int | None = None) -> ShardBatch:
        """The rows order[start:stop] (with only `columns`), in order: only that slice is copied."""
        table = self.table if columns is None else self.table.select(columns)
        return ShardBatch(self.shard_id, table.take(self.order[start:stop]))


def open_snapshot(run_dir: Path) -> Snapshot:
    run_dir = Path(run_dir).expanduser()
    if not (run_dir / STATE_DB).is_file():
        raise ExportError(f"{run_dir}: not a run dir (no {STATE_DB}: looked for {(run_dir / STATE_DB).absolute()}); "
                          "give the directory `regen start` or `regen demo` wrote the run to")
    try:
        cfg = load_config(run_dir / "run.toml")
    except (ConfigError, OSError) as exc:
        raise ExportError(f"{run_dir / 'run.toml'}: cannot read the run's config: {exc}") from exc
    try:
        committed = read_committed(run_dir)
    except sqlite3.Error as exc:
        raise ExportError(f"{run_dir / STATE_DB}: cannot read the committed parts: {exc}") from exc
    by_shard: dict[str, list[tuple[str, int]]] = {}
    for path, shard_id, rows in committed.parts:
        by_shard.setdefault(shard_id, []).append((path, rows))
    shards = tuple(ShardParts(sid, tuple(p for p, _ in parts), sum(r for _, r in parts))
                   for sid, parts in sorted(by_shard.items(), key=lambda kv: _shard_number(kv[0])))
    notes: list[str] = []
    try:
        files = resolve_prompt_files(cfg.prompts)
        file_rank = {name: rank for rank, name in enumerate(display_names(files)[f] for f in files)}
    except PromptFileError as exc:
        file_rank = {}
        notes.append(f"prompt files not found ({exc}): within a shard, samples are ordered by the file names in "
                     "their origin instead of the config's file order")
    return Snapshot(run_dir, cfg, shards, file_rank, tuple(notes))


def _shard_number(shard_id: str) -> tuple[int, str]:
    digits = shard_id.lstrip("s")
    return (int(digits), shard_id) if digits.isdigit() else (1 << 62, shard_id)


def shard_range(shard_id: str, shard_size: int) -> range:
    """The input indices of the conversations a shard holds."""
    n, _ = _shard_number(shard_id)
    return range(n * shard_size, (n + 1) * shard_size)


def iter_shards(snap: Snapshot, columns: list[str]) -> Iterator[ShardRows]:
    for shard in snap.shards:
        table = _read_shard(snap, shard, columns)
        yield ShardRows(shard.shard_id, table, input_order(table, snap.file_rank))


def _read_shard(snap: Snapshot, shard: ShardParts, columns: list[str]) -> pa.Table:
    tables = []
    for rel in shard.paths:
        try:
            tables.append(_read_part(snap.run_dir / rel, columns))
        except FileNotFoundError as exc:
            compacted = _compacted_prefix(snap, shard, columns)
            if compacted is not None:
                return compacted
            raise ExportError(f"{snap.run_dir / rel}: committed part missing ({exc.strerror}); the run dir was "
                              "changed under the export (a recover): export again") from exc
        except (OSError, pa.ArrowException) as exc:
            raise ExportError(f"{snap.run_dir / rel}: cannot read the committed part: {exc}") from exc
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def _compacted_prefix(snap: Snapshot, shard: ShardParts, columns: list[str]) -> pa.Table | None:
    """The snapshot's rows of a shard compacted after the snapshot was taken: its shard file holds every part in
    commit order, and the snapshot's parts were the first committed ones, so they are the file's first rows."""
    path = snap.run_dir / SHARDS_DIR / shard.shard_id / SHARD_FILE
    if f"{SHARDS_DIR}/{shard.shard_id}/{SHARD_FILE}" in shard.paths or not path.is_file():
        return None
    try:
        table = _read_part(path, columns)
    except (OSError, pa.ArrowException) as exc:
        raise ExportError(f"{path}: cannot read the compacted shard: {exc}") from exc
    return table.slice(0, shard.rows) if table.num_rows >= shard.rows else None


def _read_part(path: Path, columns: list[str]) -> pa.Table:
    """The part's `columns`; a part written before the prompt_opened column existed reads it as False."""
    with pq.ParquetFile(path) as f:
        has_opened = OPENED_COLUMN in f.schema_arrow.names
        wanted = columns if has_opened else [c for c in columns if c != OPENED_COLUMN]
        table = f.read(columns=wanted, use_threads=False)
    if OPENED_COLUMN in columns and not has_opened:
        table = table.append_column(OPENED_COLUMN, pa.array([False] * table.num_rows, pa.bool_()))
    return table.select(columns)


def input_order(table: pa.Table, file_rank: dict[str, int]) -> np.ndarray:
    """Row indices sorting a shard's rows by (prompt file, line or row, turn)."""
    ranks, positions = [], []
    unknown: dict[str, int] = {}
    for origin in table.column("origin").to_pylist():
        name, _, pos = origin.rpartition(":")
        rank = file_rank.get(name)
        if rank is None:  # files gone: order by name, after the known ones
            rank = unknown.setdefault(name, len(file_rank) + len(unknown))
        ranks.append(rank)
        digits = pos[3:] if pos.startswith("row") else pos
        positions.append(int(digits) if digits.isdigit() else 0)
    if unknown:  # by name among themselves
        order = {name: len(file_rank) + i for i, name in enumerate(sorted(unknown))}
        remap = {v: order[k] for k, v in unknown.items()}
        ranks = [remap.get(r, r) for r in ranks]
    turns = table.column("turn").to_numpy()
    return np.lexsort((turns, np.array(positions, dtype=np.int64), np.array(ranks, dtype=np.int64)))
