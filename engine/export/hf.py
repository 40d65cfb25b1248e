"""hf: Parquet files HF datasets and TRL read as pre-tokenized data: input_ids, loss_mask, and labels (-100 on the prompt).

`datasets.load_dataset("parquet", data_files="OUT/*.parquet", split="train")`; TRL's SFT trainer takes
input_ids plus labels as given (unshifted: the model shifts).
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from engine.export.files import ParquetFiles
from engine.export.filters import ShardFilter
from engine.export.source import ShardBatch
from engine.export.tokens import token_rows
from engine.store.manifest import FileRecord

STEM = "train"
SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("primary_id", pa.string(), nullable=False),
    pa.field("turn", pa.int32(), nullable=False),
    pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
    pa.field("labels", pa.list_(pa.int32()), nullable=False),
])


class HfWriter:
    def __init__(self, files: ParquetFiles):
        self.files = files

    def add(self, batch: ShardBatch, filt: ShardFilter) -> None:
        tr = token_rows(batch, filt)
        t = batch.table
        rows = pa.array(tr.rows, type=pa.int64())
        offsets = pa.array(tr.offsets.astype(np.int32), type=pa.int32())

        def lists(values: np.ndarray, typ: pa.DataType) -> pa.ListArray:
            return pa.ListArray.from_arrays(offsets, pa.array(values, type=typ))

        table = pa.Table.from_arrays([
            t.column("sample_id").take(rows), t.column("conversation_id").take(rows), t.column("turn").take(rows),
            lists(tr.ids, pa.int32()), lists(tr.mask, pa.uint8()), lists(tr.labels(), pa.int32()),
        ], schema=SCHEMA)
        self.files.write(table)

    def close(self) -> list[FileRecord]:
        return self.files.close()
