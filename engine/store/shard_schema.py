"""The Parquet schema of shard part files: what the stats, the console and trainers read.

A sample is `input_ids = prompt_ids + output_ids` with `loss_mask` 0 over the prompt and 1
over the output (exactly the ids SGLang returned: no re-tokenization).
"""
from __future__ import annotations

import pyarrow as pa

SHARD_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),  # "<conversation_id>#turn<k>"
        pa.field("conversation_id", pa.string(), nullable=False),
        pa.field("turn", pa.int32(), nullable=False),  # 0-based index of the regenerated user turn
        pa.field("source", pa.string(), nullable=False),  # prompt file (or dataset source field)
        pa.field("origin", pa.string(), nullable=False),  # "<file>:<line or row>" of the input row
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),
        pa.field("output_len", pa.int32(), nullable=False),
        pa.field("reasoning_tokens", pa.int32(), nullable=False),  # tokens inside <think>...</think>
        # the prompt ended inside an opened <think> (Qwen3.5/3.6-style templates): the output starts with
        # reasoning and only closes the block (engine.text.answer_shape). Parts written before it lack it: False
        pa.field("prompt_opened", pa.bool_(), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),  # stop | length | abort
        pa.field("completion_tokens", pa.int32(), nullable=False),  # meta_info.completion_tokens
        pa.field("cached_tokens", pa.int32(), nullable=False),
        pa.field("latency_s", pa.float64(), nullable=False),
        pa.field("worker", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),  # decoded output ids, for review
    ]
)

PART_COMPRESSION = "zstd"
# Parquet dictionary encoding for the scalar and string columns only: hashing the ~10^6 token ids and
# mask values of a part was ~40% of its write; PLAIN + zstd reads back the same values (the 0/1 runs
# of loss_mask compress as well either way; the ids of a large vocabulary take ~15% more bytes)
PART_DICTIONARY = [name for name in SHARD_SCHEMA.names if name not in ("input_ids", "loss_mask")]
# Column statistics (min/max in the footer) for the scalar and id columns only: over ~10^6 token ids
# and mask values, and ~4 MB of text, a part's min/max say nothing a reader can use (~7% of the write)
PART_STATISTICS = [name for name in SHARD_SCHEMA.names if name not in ("input_ids", "loss_mask", "text")]
