"""export_run: a run's committed samples -> filtered rows in the chosen format -> files + manifest.json.

Streams shard by shard (one shard's rows in memory, written before the next is read), whatever the
run's size.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from engine.export.conversations import CONVERSATION_COLUMNS, ConversationWriter
from engine.export.files import JsonlFiles, ParquetFiles, prepare_out_dir
from engine.export.filters import FILTER_COLUMNS, FilterTotals, filter_shard
from engine.export.hf import STEM as HF_STEM, HfWriter, SCHEMA as HF_SCHEMA
from engine.export.options import (DEFAULT_PARQUET_ROWS, TOKEN_FORMATS, TOKENS_JSONL, TRAINER_MIN_SUPERVISED,
                                   ExportOptions)
from engine.export.source import ExportError, Snapshot, iter_shards, open_snapshot
from engine.export.tokens import TOKEN_COLUMNS
from engine.export.tokens_jsonl import STEM as TOKENS_STEM, TokensJsonlWriter
from engine.store.manifest import Counts, FileRecord, ManifestError, build, write

SCHEMA = "regen.export/1"
# token rows are gathered and serialized this many tokens at a time: the numpy temporaries (gather indices,
# mask checks) stay ~100 MB however large a shard is; the shard's own Arrow columns are ~5 bytes a token
CHUNK_TOKENS = 2_000_000
Progress = Callable[[int, int], None]  # (samples read, samples in the snapshot)
Writer = TokensJsonlWriter | HfWriter | ConversationWriter


@dataclass
class ExportResult:
    out: str
    format: str
    run_dir: str
    parts: int
    samples: int
    kept: int
    dropped: dict[str, int]
    filters: list[str]  # what was in force, as printed
    warnings: list[str]
    rows_cut: int
    supervised_lost: int
    tokens: dict[str, int]
    files: list[FileRecord]
    manifest: str
    elapsed_s: float
    notes: list[str] = field(default_factory=list)
    # text formats: the rows re-rendered with the model's template and re-tokenized, against the stored ids
    # (engine.export.agreement.Agreement.to_dict); None for the token formats, which carry the ids
    agreement: dict[str, Any] | None = None
    agreement_lines: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **asdict(self)}


def export_run(opts: ExportOptions, progress: Progress | None = None) -> ExportResult:
    started = time.monotonic()
    snap = open_snapshot(opts.run_dir)
    thinking = snap.cfg.enable_thinking
    try:
        prepare_out_dir(opts.out)
    except OSError as exc:
        raise ExportError(str(exc)) from exc
    writer: Writer
    if opts.fmt in TOKEN_FORMATS:
        writer = (TokensJsonlWriter(JsonlFiles(opts.out, TOKENS_STEM, opts.split_rows)) if opts.fmt == TOKENS_JSONL
                  else HfWriter(ParquetFiles(opts.out, HF_STEM, HF_SCHEMA, opts.split_rows or DEFAULT_PARQUET_ROWS)))
    else:
        writer = ConversationWriter(snap, opts)
    totals = FilterTotals()
    if progress:
        progress(0, snap.rows)
    try:
        _write_rows(snap, opts, writer, totals, progress)
    except ExportError as exc:
        raise ExportError(f"{exc} ({opts.out} holds a partial export without a manifest: delete it, or give "
                          "another --out, before exporting again)") from exc
    files = writer.close()
    dropped = {k: v for k, v in totals.dropped.items() if v}
    counts = Counts(samples=totals.samples, kept=totals.kept, dropped=dropped,
                    tokens={"prompt": totals.prompt_tokens, "supervised": totals.supervised_tokens})
    manifest = build(snap.cfg, kind="export", counts=counts, files=files,
                     export={"format": opts.fmt, "options": opts.to_dict(), "parts": snap.parts,
                             "filters": filter_lines(opts, thinking)})
    manifest.run_dir = str(snap.run_dir)
    manifest.notes += list(snap.notes)
    agreement = writer.agreement.result if isinstance(writer, ConversationWriter) else None
    if agreement is not None:
        manifest.agreement = agreement.to_dict()
    try:
        path = write(manifest, opts.out)
    except ManifestError as exc:
        raise ExportError(str(exc)) from exc
    return ExportResult(
        out=str(opts.out), format=opts.fmt, run_dir=str(snap.run_dir), parts=snap.parts, samples=totals.samples,
        kept=totals.kept, dropped=dropped, filters=filter_lines(opts, thinking), warnings=_warnings(opts, totals),
        rows_cut=totals.rows_cut, supervised_lost=totals.supervised_lost, tokens=counts.tokens, files=files,
        manifest=str(path), elapsed_s=time.monotonic() - started, notes=list(snap.notes),
        agreement=agreement.to_dict() if agreement is not None else None,
        agreement_lines=agreement.lines() if agreement is not None else [])


def _write_rows(snap: Snapshot, opts: ExportOptions, writer: Writer, totals: FilterTotals,
                progress: Progress | None) -> None:
    """Shard by shard: filter on the light columns, then write the kept rows (token formats in chunks)."""
    thinking = snap.cfg.enable_thinking
    total = snap.rows
    for shard in iter_shards(snap, _columns(opts)):
        light = shard.sorted(FILTER_COLUMNS).table
        filt = filter_shard(light, opts, thinking)
        prompt_len = light.column("prompt_len").to_numpy().astype(np.int64)
        output_len = light.column("output_len").to_numpy().astype(np.int64)
        totals.add(filt, prompt_len, output_len, opts.cuts)
        if opts.fmt in TOKEN_FORMATS:
            for start, stop in token_chunks(prompt_len + output_len, CHUNK_TOKENS):
                writer.add(shard.sorted(start=start, stop=stop), filt.slice(start, stop))
        else:  # no token columns: the shard's text, whole (a conversation's turns stay together)
            writer.add(shard.sorted(), filt)
        if progress:
            progress(totals.samples, total)


def _columns(opts: ExportOptions) -> list[str]:
    wanted = TOKEN_COLUMNS if opts.fmt in TOKEN_FORMATS else CONVERSATION_COLUMNS
    return sorted(set(wanted) | set(FILTER_COLUMNS))


def token_chunks(lengths: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges of at most `limit` tokens each (a longer row is a chunk of its own)."""
    chunks, start, acc = [], 0, 0
    for i, n in enumerate(lengths.tolist()):
        if acc and acc + n > limit:
            chunks.append((start, i))
            start, acc = i, 0
        acc += n
    if start < len(lengths):
        chunks.append((start, len(lengths)))
    return chunks


def filter_lines(opts: ExportOptions, thinking_expected: bool) -> list[str]:
    """The filters in force, one line each, defaults marked: printed before the counts."""
    lines = []
    drop = opts.dropped_by_default(thinking_expected)
    names = {"aborted": "aborted (finish_reason abort)", "length": "truncated (finish_reason length)",
             "repetition": "stopped as runaway repetition (finish_reason repetition)",
             "empty": "empty answers (no reasoning, at most 3 visible tokens)",
             "thinking_missing": "reasoning block missing", "thinking_unterminated": "reasoning block unterminated"}
    for reason, text in names.items():
        if reason in drop:
            lines.append(f"drop {text} (default; --keep {reason.split('_')[0]} to keep)")
        elif reason.startswith("thinking") and not thinking_expected:
            lines.append("keep rows whatever their reasoning block (the run has enable_thinking = false)")
        else:
            lines.append(f"keep {text} (--keep)")
    lines = list(dict.fromkeys(lines))
    if opts.last_turn_only:
        lines.append("keep only each conversation's last committed turn (--last-turn-only)")
    if opts.max_length is not None:
        if opts.cuts:
            lines.append(f"cut rows to {opts.max_length} tokens (--max-length, --over-length cut)")
        else:
            lines.append(f"drop rows over {opts.max_length} tokens (--max-length"
                         + (", --over-length drop)" if opts.over_length == "drop" else
                            "; text formats are re-tokenized by the trainer, so they are dropped, not cut)"))
    if opts.min_supervised:
        lines.append(f"drop rows with fewer than {opts.min_supervised} supervised tokens"
                     + (" (default: SpecForge DFlash drops them silently)" if opts.min_supervised == 2 else
                        " (--min-supervised)"))
    else:
        lines.append("keep rows whatever their supervised tokens (--min-supervised 0)")
    return lines


def _warnings(opts: ExportOptions, t: FilterTotals) -> list[str]:
    out = []
    if t.trainer_would_drop:
        out.append(f"{t.trainer_would_drop} exported row(s) have fewer than {TRAINER_MIN_SUPERVISED} supervised "
                   "tokens: SpecForge (DFlash family) drops such rows silently; --min-supervised 2 drops them here")
    if opts.cuts and t.rows_cut:
        out.append(f"{t.rows_cut} row(s) cut at {opts.max_length} tokens: {t.supervised_lost} supervised tokens lost")
    if t.samples and not t.kept:
        out.append("no sample kept: every committed sample was dropped by a filter (counts above)")
    return out


