"""The export's command-line options and their ExportOptions: shared by `regen export` and `python -m engine.export`."""
from __future__ import annotations

import argparse
from pathlib import Path

from engine.export.options import DEFAULT_MIN_SUPERVISED, FORMATS, KEEPABLE, OVER_LENGTH_MODES, ExportOptions


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    """The export's own options (shared with `regen export`)."""
    p.add_argument("--format", choices=FORMATS, help="tokens-jsonl (SpecForge prompts_path, speculators), "
                   "conversations-jsonl (SpecForge train_data_path), messages-parquet (NeMo Automodel), "
                   "messages-jsonl (ModelOpt: reasoning inline), hf (HF datasets / TRL Parquet with labels)")
    p.add_argument("--out", metavar="DIR", help="a new or empty directory for the files and manifest.json")
    p.add_argument("--reasoning-key", default="reasoning_content", metavar="KEY",
                   help="conversations-jsonl: the key of the final turn's reasoning (default reasoning_content)")
    p.add_argument("--keep", default="", metavar="WHAT",
                   help=f"comma list among {','.join(KEEPABLE)}: keep samples dropped by default")
    p.add_argument("--max-length", type=int, default=None, metavar="N", help="longest row in tokens")
    p.add_argument("--over-length", choices=OVER_LENGTH_MODES, default="cut",
                   help="rows over --max-length: cut (token formats; default) or drop")
    p.add_argument("--last-turn-only", action="store_true", help="keep only each conversation's last turn")
    p.add_argument("--min-supervised", type=int, default=DEFAULT_MIN_SUPERVISED, metavar="N",
                   help=f"drop rows with fewer supervised tokens (default {DEFAULT_MIN_SUPERVISED}, SpecForge's rule)")
    p.add_argument("--split-rows", type=int, default=None, metavar="N",
                   help="rows per file (JSONL: one file by default; Parquet: 100,000)")
    p.add_argument("--verify", metavar="PATH", default=None,
                   help="re-check an export directory against its manifest.json instead of exporting")


def options_from(args: argparse.Namespace, run_dir: str) -> ExportOptions:
    """Raises ValueError with the option's name on a bad value."""
    if not args.format:
        raise ValueError("--format is required (one of " + ", ".join(FORMATS) + ")")
    if not args.out:
        raise ValueError("--out DIR is required: a new or empty directory for the export")
    keep = tuple(k for k in args.keep.split(",") if k)
    return ExportOptions(run_dir=Path(run_dir).expanduser(), fmt=args.format, out=Path(args.out).expanduser(),
                         reasoning_key=args.reasoning_key, keep=keep, max_length=args.max_length,
                         over_length=args.over_length, last_turn_only=args.last_turn_only,
                         min_supervised=args.min_supervised, split_rows=args.split_rows)
