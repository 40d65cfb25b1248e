"""What `regen export` was asked for: the format, the output directory and the filters, with their defaults."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TOKENS_JSONL = "tokens-jsonl"
CONVERSATIONS_JSONL = "conversations-jsonl"
MESSAGES_JSONL = "messages-jsonl"
MESSAGES_PARQUET = "messages-parquet"
HF = "hf"
FORMATS = (TOKENS_JSONL, CONVERSATIONS_JSONL, MESSAGES_JSONL, MESSAGES_PARQUET, HF)
TOKEN_FORMATS = (TOKENS_JSONL, HF)  # exact ids from the shards; the others are text a trainer re-tokenizes

# reasons a sample is dropped, in the order they are tested (a sample counts under its first reason)
ABORTED, LENGTH, EMPTY = "aborted", "length", "empty"
REPETITION = "repetition"  # stopped by the runaway guard (engine.store.names.REPETITION): degenerate, cut short
THINKING_MISSING, THINKING_UNTERMINATED = "thinking_missing", "thinking_unterminated"
NOT_LAST_TURN, OVER_MAX_LENGTH, MIN_SUPERVISED = "not_last_turn", "over_max_length", "min_supervised"
REASONS = (ABORTED, LENGTH, REPETITION, EMPTY, THINKING_MISSING, THINKING_UNTERMINATED, NOT_LAST_TURN, OVER_MAX_LENGTH,
           MIN_SUPERVISED)
KEEPABLE = {"aborted": (ABORTED,), "length": (LENGTH,), "repetition": (REPETITION,), "empty": (EMPTY,),
            "thinking": (THINKING_MISSING, THINKING_UNTERMINATED)}
DEFAULT_MIN_SUPERVISED = 2  # SpecForge (DFlash) drops rows with fewer in silence: drop them here, counted
TRAINER_MIN_SUPERVISED = 2
DEFAULT_PARQUET_ROWS = 100_000  # rows per Parquet file when --split-rows is not given
OVER_LENGTH_MODES = ("cut", "drop")


@dataclass(frozen=True)
class ExportOptions:
    run_dir: Path
    fmt: str
    out: Path  # a directory: the data files and manifest.json
    reasoning_key: str = "reasoning_content"
    keep: tuple[str, ...] = ()  # KEEPABLE names the operator keeps (dropped by default)
    max_length: int | None = None
    over_length: str = "cut"  # cut (token formats: keep the first max_length tokens) | drop
    last_turn_only: bool = False
    min_supervised: int = DEFAULT_MIN_SUPERVISED
    split_rows: int | None = None  # rows per file (JSONL: one file when None)

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"format {self.fmt!r}: must be one of {', '.join(FORMATS)}")
        unknown = sorted(set(self.keep) - set(KEEPABLE))
        if unknown:
            raise ValueError(f"--keep {','.join(unknown)}: must be among {', '.join(KEEPABLE)}")
        if self.over_length not in OVER_LENGTH_MODES:
            raise ValueError(f"--over-length {self.over_length!r}: must be cut or drop")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"--max-length {self.max_length}: must be at least 1")
        if self.split_rows is not None and self.split_rows < 1:
            raise ValueError(f"--split-rows {self.split_rows}: must be at least 1")
        if self.min_supervised < 0:
            raise ValueError(f"--min-supervised {self.min_supervised}: must be 0 or more")

    @property
    def cuts(self) -> bool:
        """Rows longer than max_length are cut (token formats only: text formats are re-tokenized by the trainer)."""
        return self.max_length is not None and self.over_length == "cut" and self.fmt in TOKEN_FORMATS

    def dropped_by_default(self, thinking_expected: bool) -> list[str]:
        reasons = [ABORTED, LENGTH, REPETITION, EMPTY] + ([THINKING_MISSING, THINKING_UNTERMINATED] if thinking_expected else [])
        kept = {r for name in self.keep for r in KEEPABLE[name]}
        return [r for r in reasons if r not in kept]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["run_dir"], d["out"] = str(self.run_dir), str(self.out)
        return d

