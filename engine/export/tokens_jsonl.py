"""tokens-jsonl: one pre-tokenized row per sample, for SpecForge `data.prompts_path` and speculators `prepare_data.py --data`.

Row: {"id", "primary_id", "input_ids", "loss_mask", "metadata": {...}} (speculators' own regeneration
row, which SpecForge reads too: its first record has input_ids, so the file is pre-tokenized). Every
line is parsed back after it is serialized and its ids and mask compared with the shard's.
"""
from __future__ import annotations

import numpy as np
import orjson

from engine.export.files import JsonlFiles
from engine.export.filters import ShardFilter
from engine.export.source import ExportError, ShardBatch
from engine.export.tokens import token_rows
from engine.store.manifest import FileRecord

STEM = "tokens"


class TokensJsonlWriter:
    def __init__(self, files: JsonlFiles):
        self.files = files

    def add(self, batch: ShardBatch, filt: ShardFilter) -> None:
        tr = token_rows(batch, filt)
        t = batch.table
        sample_ids = t.column("sample_id").to_pylist()
        conv_ids = t.column("conversation_id").to_pylist()
        turns = t.column("turn").to_pylist()
        sources = t.column("source").to_pylist()
        origins = t.column("origin").to_pylist()
        finish = t.column("finish_reason").to_pylist()
        reasoning = t.column("reasoning_tokens").to_pylist()
        full = (t.column("prompt_len").to_numpy().astype(np.int64) + t.column("output_len").to_numpy())
        for j, i in enumerate(tr.rows.tolist()):
            s, e = int(tr.offsets[j]), int(tr.offsets[j + 1])
            ids, mask = tr.ids[s:e], tr.mask[s:e]
            supervised = int(tr.supervised[j])
            meta = {"turn": turns[i], "source": sources[i], "origin": origins[i], "finish_reason": finish[i],
                    "prompt_len": (e - s) - supervised, "output_len": supervised, "reasoning_tokens": reasoning[i]}
            if e - s < int(full[i]):
                meta["cut_from"] = int(full[i])
            line = orjson.dumps({"id": sample_ids[i], "primary_id": conv_ids[i], "input_ids": ids, "loss_mask": mask,
                                 "metadata": meta}, option=orjson.OPT_SERIALIZE_NUMPY)
            back = orjson.loads(line)
            if back["input_ids"] != ids.tolist() or back["loss_mask"] != mask.tolist():
                raise ExportError(f"sample {sample_ids[i]!r}: its JSON line does not read back to the shard's ids "
                                  "and mask; nothing more was exported")
            self.files.write(line)

    def close(self) -> list[FileRecord]:
        return self.files.close()
