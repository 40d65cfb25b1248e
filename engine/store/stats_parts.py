"""The stats' reading of a run dir: list the committed parts (state.sqlite opened read-only, else a glob), read the
columns of each on threads, and check the loss_mask of every row or of a spread sample of the parts.
Never reads input_ids; a part compacted away between the listing and its read is reported missing (listed again).
"""
from __future__ import annotations

import glob
import math
import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engine.api.reports import IntegrityError
from engine.store.committed_view import read_committed
from engine.store.names import REPETITION, SHARD_FILE, SHARDS_DIR, STATE_DB
from engine.store.stats_columns import (FINISH_ABORT, FINISH_LENGTH, FINISH_OTHER, FINISH_REPETITION, FINISH_STOP,
                                        OPENED_COLUMN, check_mask, empty_answer_mask, np_bool, np_int, think_codes)

MASK_CHECK_FULL_ROWS = 100_000  # up to this many samples every mask is checked (mask_check="auto")
MASK_CHECK_SAMPLE_SHARE = 0.05  # otherwise this share of the parts (at least MASK_CHECK_MIN_PARTS)
MASK_CHECK_MIN_PARTS = 8
MASK_CHECK_HEAD_ROWS = 4096  # sampled parts have their first rows checked (decoding the mask is the cost)
STAT_COLUMNS = ["source", "worker", "prompt_len", "output_len", "reasoning_tokens", "finish_reason", "text"]


class StatsReadError(OSError):
    """The run dir (or a committed part in it) cannot be read; the message names the path and the OS error."""



@dataclass
class PartResult:
    path: str
    shard_id: str
    rows: int
    prompt_len: np.ndarray
    output_len: np.ndarray
    reasoning_tokens: np.ndarray
    finish: np.ndarray
    empty: np.ndarray
    think: np.ndarray
    source_values: list[str]
    source_codes: np.ndarray
    worker_values: list[str]
    worker_codes: np.ndarray
    mask_rows_checked: int
    mask_mismatches: int
    errors: list[IntegrityError]


def _dictionary(col) -> tuple[list[str], np.ndarray]:
    enc = pc.dictionary_encode(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
    return enc.dictionary.to_pylist(), enc.indices.to_numpy(zero_copy_only=False).astype(np.int32)



def _read_mask_head(path: Path, rows: int) -> pa.Array:
    """The loss_mask of the first `rows` rows: the reader decodes pages as it goes, so stopping
    early skips decoding the rest of the column."""
    with pq.ParquetFile(path) as f:
        for batch in f.iter_batches(batch_size=rows, columns=["loss_mask"], use_threads=False):
            return batch.column(0)
    return pa.array([], type=pa.list_(pa.uint8()))


def read_part(run_dir: Path, rel: str, shard_id: str, expected_rows: int | None, mask: str) -> PartResult:
    """mask: "all" (check every row's loss_mask), "head" (the first MASK_CHECK_HEAD_ROWS) or "none"."""
    path = run_dir / rel
    columns = STAT_COLUMNS + (["loss_mask"] if mask == "all" else [])
    try:
        with pq.ParquetFile(path) as f:
            if OPENED_COLUMN in f.schema_arrow.names:
                columns = columns + [OPENED_COLUMN]
            table = f.read(columns=columns, use_threads=False)
        mask_column = (table.column("loss_mask") if mask == "all"
                       else _read_mask_head(path, MASK_CHECK_HEAD_ROWS) if mask == "head" else None)
    except FileNotFoundError as exc:
        raise MissingPart(rel, str(exc)) from exc
    except (OSError, pa.ArrowException) as exc:
        raise UnreadablePart(rel, f"{type(exc).__name__}: {exc}") from exc
    text = table.column("text")
    prompt_len = np_int(table.column("prompt_len"))
    output_len = np_int(table.column("output_len"))
    fr = table.column("finish_reason")
    finish = np.full(table.num_rows, FINISH_OTHER, dtype=np.int8)
    finish[np_bool(pc.equal(fr, "stop"))] = FINISH_STOP
    finish[np_bool(pc.equal(fr, "length"))] = FINISH_LENGTH
    finish[np_bool(pc.equal(fr, "abort"))] = FINISH_ABORT
    finish[np_bool(pc.equal(fr, REPETITION))] = FINISH_REPETITION
    errors: list[IntegrityError] = []
    if expected_rows is not None and expected_rows != table.num_rows:
        errors.append(IntegrityError("rows", rel, f"state.sqlite says {expected_rows} rows, the file has {table.num_rows}"))
    mask_rows = mismatches = 0
    if mask_column is not None:
        n = len(mask_column)
        mismatches, mask_errors = check_mask(mask_column, prompt_len[:n], output_len[:n], rel)
        errors += mask_errors
        mask_rows = n
    opened = np_bool(table.column(OPENED_COLUMN)) if OPENED_COLUMN in table.column_names else None
    sources, source_codes = _dictionary(table.column("source"))
    workers, worker_codes = _dictionary(table.column("worker"))
    return PartResult(
        path=rel, shard_id=shard_id, rows=table.num_rows, prompt_len=prompt_len, output_len=output_len,
        reasoning_tokens=np_int(table.column("reasoning_tokens")), finish=finish,
        empty=np_bool(empty_answer_mask(text, opened)), think=think_codes(text, opened),
        source_values=sources, source_codes=source_codes, worker_values=workers, worker_codes=worker_codes,
        mask_rows_checked=mask_rows, mask_mismatches=mismatches, errors=errors)


class MissingPart(Exception):
    def __init__(self, rel: str, detail: str):
        super().__init__(detail)
        self.rel, self.detail = rel, detail


class UnreadablePart(MissingPart):
    pass


# --- listing parts ---------------------------------------------------------------------------


@dataclass
class Listing:
    listed_from: str
    parts: Sequence[tuple[str, str, int | None]]  # (relative path, shard_id, rows; None: not recorded, "glob")
    shards: Mapping[str, tuple[int | None, bool | None]]  # shard_id -> (total conversations, paused)
    uncommitted: int
    notes: list[str]
    # part path -> (samples, empty, truncated) as the store recorded them at commit (samples table)
    recorded: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    not_generated: dict[str, int] = field(default_factory=dict)  # engine.store.committed_view.CommittedParts.not_generated


def _part_files_on_disk(run_dir: Path) -> list[str]:
    """Part files and compacted shard files (shards/<id>/part-*.parquet, shards/<id>/shard.parquet)."""
    found = []
    for name in ("part-*.parquet", SHARD_FILE):
        found += glob.glob(str(run_dir / SHARDS_DIR / "**" / name), recursive=True)
    return sorted(Path(p).relative_to(run_dir).as_posix() for p in found)


def list_parts(run_dir: Path) -> Listing:
    try:
        entries = os.listdir(run_dir)
    except OSError as exc:
        raise StatsReadError(f"cannot read run dir {run_dir}: {exc.strerror or exc}") from exc
    if not (run_dir / SHARDS_DIR).is_dir() and STATE_DB not in entries:
        raise StatsReadError(f"{run_dir} is not a run dir: it has neither {STATE_DB} nor {SHARDS_DIR}/ "
                             f"(found: {', '.join(sorted(entries)[:10]) or 'nothing'})")
    on_disk = _part_files_on_disk(run_dir)
    db_path = run_dir / STATE_DB
    if STATE_DB not in entries:
        shard_of = {p: Path(p).parent.name for p in on_disk}
        return Listing("glob", [(p, shard_of[p], None) for p in on_disk], {}, 0,
                        [f"no {STATE_DB} in {run_dir}: read every part file found under {SHARDS_DIR}/ "
                         "(committed or not: an interrupted write could be counted)"])
    try:
        committed_parts = read_committed(run_dir)
    except sqlite3.Error as exc:
        raise StatsReadError(f"cannot read {db_path} (opened read-only): {exc}") from exc
    parts, recorded, shards = committed_parts.parts, committed_parts.recorded, committed_parts.shards
    committed = {p for p, _, _ in parts}
    uncommitted = sum(1 for p in on_disk if p not in committed)
    notes = []
    if uncommitted:
        notes.append(f"{uncommitted} part file(s) under {SHARDS_DIR}/ are not committed in {STATE_DB} "
                     "(being written, or left by a crash): ignored")
    return Listing(STATE_DB, parts, shards, uncommitted, notes, recorded, committed_parts.not_generated)


def _mask_check_mode(requested: str, total_rows: int | None) -> str:
    if requested != "auto":
        return requested
    return "full" if total_rows is not None and total_rows <= MASK_CHECK_FULL_ROWS else "sample"


def _mask_check_parts(n_parts: int, mode: str) -> set[int]:
    if mode == "off" or n_parts == 0:
        return set()
    if mode == "full":
        return set(range(n_parts))
    want = min(n_parts, max(MASK_CHECK_MIN_PARTS, math.ceil(n_parts * MASK_CHECK_SAMPLE_SHARE)))
    # spread evenly over the run (first and last part included), deterministic
    return {int(round(i)) for i in np.linspace(0, n_parts - 1, want)}



def read_listing(run_dir: Path, listing: Listing, mask_check: str, threads: int | None):
    """Read every listed part (threads): (mask mode, parts mask-checked, errors, missing parts, results)."""
    known_rows: int | None = None
    if listing.listed_from != "glob":  # the store records every committed part's rows
        known_rows = 0
        for rel, _, rows in listing.parts:
            if rows is None:
                raise RuntimeError(f"{rel}: listed from {listing.listed_from} without its row count")
            known_rows += rows
    mode = _mask_check_mode(mask_check, known_rows)
    check_idx = _mask_check_parts(len(listing.parts), mode)
    errors: list[IntegrityError] = []
    missing: list[str] = []
    results: list[PartResult] = []

    def job(i: int):
        rel, shard_id, rows = listing.parts[i]
        try:
            how = "none" if i not in check_idx else "all" if mode == "full" else "head"
            return read_part(run_dir, rel, shard_id, rows, how)
        except MissingPart as exc:
            return exc

    workers = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for outcome in pool.map(job, range(len(listing.parts))):
            if isinstance(outcome, UnreadablePart):
                errors.append(IntegrityError("unreadable_part", outcome.rel, outcome.detail))
            elif isinstance(outcome, MissingPart):
                missing.append(outcome.rel)
                errors.append(IntegrityError("missing_part", outcome.rel, f"committed in {STATE_DB} but {outcome.detail}"))
            else:
                results.append(outcome)
                errors += outcome.errors
    return mode, check_idx, errors, missing, results


def sampled_mask_note(parts_checked: int, parts: int, rows: int) -> str:
    return (f"loss_mask checked on the first {MASK_CHECK_HEAD_ROWS} rows of {parts_checked} of {parts} parts spread "
            f"over the run ({rows} samples); --mask-check full checks every row")
