"""Chat-message formats: conversations-jsonl (SpecForge), messages-jsonl (ModelOpt), messages-parquet (NeMo Automodel).

Each sample is the conversation as the model saw it when it generated that turn (earlier turns answered by its own
regenerated answers, as the template wrote them): rendering its history gives back the stored prompt ids.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pyarrow as pa

from engine.export.agreement import AgreementCheck
from engine.export.answers import Answer, answer_of, strip_end
from engine.export.files import JsonlFiles, ParquetFiles
from engine.export.filters import ShardFilter
from engine.export.options import CONVERSATIONS_JSONL, MESSAGES_JSONL, MESSAGES_PARQUET, ExportOptions
from engine.export.source import ExportError, ShardBatch, Snapshot, shard_range
from engine.text.ingest import Conversation, iter_prompts
from engine.text.row_errors import PromptFileError
from engine.store.manifest import FileRecord
from engine.text.render import RenderError, Renderer
from engine.store.stats_columns import OPENED_COLUMN

# input_ids and prompt_len: each row's re-rendered text is compared with them (engine.export.agreement)
CONVERSATION_COLUMNS = ["sample_id", "conversation_id", "turn", "origin", "text", OPENED_COLUMN, "input_ids",
                        "prompt_len"]
STEMS = {CONVERSATIONS_JSONL: "conversations", MESSAGES_JSONL: "messages", MESSAGES_PARQUET: "messages"}
MESSAGES_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("conversation_id", pa.string(), nullable=False),
    pa.field("turn", pa.int32(), nullable=False),
    pa.field("messages", pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])),
             nullable=False),
])


def as_seen(renderer: Renderer, end_tokens: list[str], text: str, prompt_opened: bool) -> str:
    """A committed turn as the next turn's prompt held it: its history answer (the output without its
    end-of-turn, after the think opening its prompt held), as the template writes an earlier turn."""
    answer = strip_end(text, end_tokens)
    if prompt_opened:
        answer = renderer.opened_text + answer
    try:
        return renderer.history_content(answer)
    except RenderError as exc:
        raise ExportError(f"cannot write the history as the model saw it: {exc}") from exc


class PromptCursor:
    """The run's prompt files read once, front to back: the conversations of one shard at a time."""

    def __init__(self, snap: Snapshot):
        cfg = snap.cfg
        self._entries: Iterator = iter_prompts(cfg.prompts, cfg.prompt_format)
        self._next: Conversation | None = None
        self._done = False

    def take(self, indices: range) -> dict[str, Conversation]:
        found: dict[str, Conversation] = {}
        while True:
            if self._next is None:
                if self._done:
                    return found
                try:
                    entry = next(self._entries)
                except StopIteration:
                    self._done = True
                    return found
                except PromptFileError as exc:
                    raise ExportError(f"cannot read the run's prompt files (needed for the conversation history): "
                                      f"{exc}") from exc
                if not isinstance(entry, Conversation):
                    continue  # a rejected row: it has no samples
                self._next = entry
            if self._next.index >= indices.stop:
                return found
            if self._next.index >= indices.start:
                found[self._next.conversation_id] = self._next
            self._next = None


class ConversationWriter:
    def __init__(self, snap: Snapshot, opts: ExportOptions):
        cfg = snap.cfg
        try:
            self.renderer = Renderer(cfg.tokenizer_path, enable_thinking=cfg.enable_thinking,
                                     context_length=cfg.context_length)
        except RenderError as exc:
            raise ExportError(f"the run's tokenizer is needed for the chat formats (its end-of-turn tokens and "
                              f"history rules): {exc}") from exc
        self.end_tokens = [t for t in self.renderer.tokenizer.convert_ids_to_tokens(self.renderer.eos_ids) if t]
        self.snap, self.opts, self.turns = snap, opts, cfg.turns
        self.prompts = PromptCursor(snap)
        self.agreement = AgreementCheck(self.renderer, self.end_tokens)
        stem = STEMS[opts.fmt]
        if opts.fmt == MESSAGES_PARQUET:
            self.files: JsonlFiles | ParquetFiles = ParquetFiles(opts.out, stem, MESSAGES_SCHEMA,
                                                                 opts.split_rows or 100_000)
        else:
            self.files = JsonlFiles(opts.out, stem, opts.split_rows)

    def add(self, batch: ShardBatch, filt: ShardFilter) -> None:
        convs = self.prompts.take(shard_range(batch.shard_id, self.snap.cfg.shard_size))
        t = batch.table
        sample_ids = t.column("sample_id").to_pylist()
        conv_ids = t.column("conversation_id").to_pylist()
        turns = t.column("turn").to_pylist()
        origins = t.column("origin").to_pylist()
        texts = t.column("text").to_pylist()
        opened = t.column(OPENED_COLUMN).to_pylist()
        answers: dict[str, dict[int, Answer]] = {}
        at: dict[str, dict[int, int]] = {}  # per conversation: its turns' rows
        for i, (cid, turn, text, prompt_opened) in enumerate(zip(conv_ids, turns, texts, opened)):
            answers.setdefault(cid, {})[turn] = answer_of(text, self.end_tokens, prompt_opened)
            at.setdefault(cid, {})[turn] = i
        seen: dict[str, dict[int, str]] = {}  # per conversation: each earlier turn as the later prompts held it

        def history_of(cid: str, turn: int) -> dict[int, str]:
            """The turns before `turn` as seen, each rendered once (only turns some kept row has in its history)."""
            mine = seen.setdefault(cid, {})
            for k, j in at[cid].items():
                if k < turn and k not in mine:
                    mine[k] = as_seen(self.renderer, self.end_tokens, texts[j], opened[j])
            return mine
        rows: list[dict[str, Any]] = []
        kept = filt.keep.nonzero()[0].tolist()
        for i in kept:
            conv = convs.get(conv_ids[i])
            if conv is None or conv.origin != origins[i]:
                found = "not there" if conv is None else f"at {conv.origin}"
                raise ExportError(f"sample {sample_ids[i]!r} came from {origins[i]}, but in the prompt files as they "
                                  f"are now its conversation is {found}: the prompt files changed since the run. "
                                  "Put back the files the run read (manifest.json in the run dir lists their sizes "
                                  "and hashes), or export a token format (tokens-jsonl, hf), which needs no prompts")
            try:
                history = self.renderer.build_messages(
                    conv, turns[i], history_of(conv_ids[i], turns[i]) if self.turns == "all" else {}, self.turns)
            except (KeyError, ValueError) as exc:
                raise ExportError(f"sample {sample_ids[i]!r}: cannot rebuild its history: {exc}") from exc
            rows.append(self._row(sample_ids[i], conv_ids[i], turns[i], history, answers[conv_ids[i]][turns[i]]))
        if isinstance(self.files, ParquetFiles):
            self.files.write(pa.Table.from_pylist(rows, schema=MESSAGES_SCHEMA))
        else:
            for row in rows:
                self.files.write(orjson.dumps(row))
        if kept:
            ids = t.column("input_ids").take(pa.array(kept)).to_pylist()
            plens = t.column("prompt_len").take(pa.array(kept)).to_pylist()
            self.agreement.add([sample_ids[i] for i in kept], [self._as_rendered(r) for r in rows], ids, plens)

    def _as_rendered(self, row: dict[str, Any]) -> list[dict]:
        """A written row's messages as a trainer hands them to the chat template (the reasoning key it reads is
        `reasoning_content`; --reasoning-key renames it for trainers that map it back)."""
        if self.opts.fmt != CONVERSATIONS_JSONL:
            return row["messages"]
        *history, final = row["conversations"]
        last = {"role": "assistant", "content": final["content"]}
        if self.opts.reasoning_key in final:
            last["reasoning_content"] = final[self.opts.reasoning_key]
        return [*history, last]

    def _row(self, sid: str, cid: str, turn: int, history: list[dict], answer: Answer) -> dict[str, Any]:
        history = [{"role": m["role"], "content": m["content"]} for m in history]
        if self.opts.fmt == CONVERSATIONS_JSONL:
            final: dict[str, Any] = {"role": "assistant", "content": answer.content}
            if answer.reasoning is not None:
                final[self.opts.reasoning_key] = answer.reasoning
            return {"id": sid, "conversations": history + [final]}
        messages = history + [{"role": "assistant", "content": answer.inline()}]
        if self.opts.fmt == MESSAGES_JSONL:
            # conversation_id is the conversation's (shared by its turns), sample_id the row's own
            # (`<conversation_id>#turn<k>`): one row per generated turn, as in tokens-jsonl
            return {"sample_id": sid, "conversation_id": cid, "turn": turn, "messages": messages}
        return {"id": sid, "conversation_id": cid, "turn": turn, "messages": messages}

    def close(self) -> list[FileRecord]:
        return self.files.close()
