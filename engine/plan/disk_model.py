"""The plan's disk model: bytes per prompt and output token, measured by writing a part of rendered samples (with the
pilot's answers, else answer-like texts) the way the store writes one; and the free space at the run dir.
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from engine.store.shard_schema import PART_COMPRESSION, PART_DICTIONARY, PART_STATISTICS, SHARD_SCHEMA
from engine.text.ingest import Conversation

ASSUMED_BYTES_PER_OUTPUT_TOKEN = 5.0  # 4 B token id (PLAIN, zstd gains little on diverse ids) + ~1 B of zstd text
DISK_SAMPLE_ROWS = 500


@dataclass
class DiskModel:
    """Bytes per stored token of a zstd part written with the shard schema, apart for the prompt (ids and mask
    only) and the output (ids, mask and its decoded text): answers cost several times what prompts do."""
    bytes_per_prompt_token: float
    bytes_per_output_token: float
    basis: str  # "measured: ..." | "assumed: ..."


def answer_like(conv: Conversation, turn: int) -> str | None:
    """The dataset's own answer to user turn `turn` (the assistant message after it), if it has one."""
    users = 0
    for i, m in enumerate(conv.messages):
        if m["role"] == "user":
            if users == turn:
                nxt = conv.messages[i + 1] if i + 1 < len(conv.messages) else None
                return nxt["content"] if nxt is not None and nxt["role"] == "assistant" and nxt["content"] else None
            users += 1
    return None


def measure_disk(renderer, rendered, outputs: Sequence[Sequence[int]] | None) -> DiskModel:
    """Bytes per prompt token and per output token, from parts written with the shard schema. The outputs are
    answer-like text: the pilot's outputs when there is a pilot, else the prompt files' own assistant answers
    (the prompts themselves compress far better than answers: measured on them, the shards' disk came out
    3-4x too low), else an assumption, stated as such."""
    if outputs:
        pairs = list(zip(rendered, (list(o) for o in outputs)))[:DISK_SAMPLE_ROWS]
        what = "pilot outputs"
    else:
        pairs = []
        for conv, turn, prompt in rendered:
            text = answer_like(conv, turn)
            if text:
                pairs.append(((conv, turn, prompt), renderer.tokenizer.encode(text, add_special_tokens=False)))
            if len(pairs) >= DISK_SAMPLE_ROWS:
                break
        what = "the prompt files' own assistant answers as answer-like outputs (a pilot measures the model's)"
    prompt_only: list[tuple[Any, list[int]]] = [(r, []) for r in (rendered[:DISK_SAMPLE_ROWS] if not pairs else [r for r, _ in pairs])]
    prompt_tokens = sum(len(r[2]) for r, _ in prompt_only)
    # a file's own overhead (footer, schema: ~5 KB) is not the tokens': a part holds thousands of samples
    overhead = _part_bytes(renderer, [])
    bpt_prompt = max(0, _part_bytes(renderer, prompt_only) - overhead) / prompt_tokens if prompt_tokens else 0.0
    output_tokens = sum(len(o) for _, o in pairs)
    if not output_tokens:
        return DiskModel(bpt_prompt, ASSUMED_BYTES_PER_OUTPUT_TOKEN,
                         f"assumed (outputs): prompts measured ({len(prompt_only)} sampled), outputs "
                         f"{ASSUMED_BYTES_PER_OUTPUT_TOKEN:g} B/token (4 B id + ~1 B zstd text; no answer-like text in "
                         "the sample: --pilot N measures it)")
    # the output's share: the same rows with and without their outputs
    bpt_output = max(0.0, _part_bytes(renderer, pairs) - _part_bytes(renderer, [(r, []) for r, _ in pairs])) / output_tokens
    return DiskModel(bpt_prompt, bpt_output, f"measured: zstd parts of {len(pairs)} samples with {what}: "
                                             f"{output_tokens:,} output tokens, {prompt_tokens:,} prompt tokens")


def _part_bytes(renderer, pairs) -> int:
    rows = []
    for (conv, turn, prompt), out in pairs:
        rows.append({
            "sample_id": f"{conv.conversation_id}#turn{turn}", "conversation_id": conv.conversation_id, "turn": turn,
            "source": conv.source, "origin": conv.origin, "input_ids": list(prompt) + list(out),
            "loss_mask": [0] * len(prompt) + [1] * len(out), "prompt_len": len(prompt), "output_len": len(out),
            "reasoning_tokens": 0, "prompt_opened": False, "finish_reason": "stop", "completion_tokens": len(out),
            "cached_tokens": 0, "latency_s": 0.0, "worker": "gpu0", "text": renderer.decode(list(out)) if out else ""})
    table = pa.Table.from_pylist(rows, schema=SHARD_SCHEMA)
    with tempfile.TemporaryDirectory(prefix="regen-plan-") as tmp:
        path = Path(tmp) / "part.parquet"
        pq.write_table(table, path, compression=PART_COMPRESSION, use_dictionary=PART_DICTIONARY,
                       write_statistics=PART_STATISTICS)
        return path.stat().st_size


def free_space(run_dir: str) -> tuple[int | None, str]:
    path = Path(run_dir).expanduser()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free, str(path)
    except OSError as exc:
        return None, f"{path} ({exc})"

