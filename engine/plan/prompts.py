"""The plan's prompt side: read every prompt row into the shard plan, render a sample (and the longest prompts) with
the model's chat template for the prompt-token figures, and check the rendered prompts against the context.
"""
from __future__ import annotations

import heapq
import math
import random
from typing import Sequence

import numpy as np

from engine.api.reports import ContextCheck, PromptExample, PromptTokens, ShardPlan
from engine.config.load import RunConfig
from engine.text.ingest import Conversation, iter_prompts
from engine.text.row_errors import PromptFileError, Reject

EXAMPLES_LISTED = 10


class PlanError(Exception):
    """The plan cannot be made (prompts unreadable, tokenizer unusable, workers failed); the message says why."""


# --- shard plan and prompt tokens ------------------------------------------------------------


def _user_messages(conv: Conversation) -> int:
    return sum(1 for m in conv.messages if m["role"] == "user")


def prompt_chars(conv: Conversation, turns: str) -> int:
    """Characters of the longest prompt a conversation gives: its history up to its last user turn (its first with
    turns = "first"): what finds the longest prompts in tokens without rendering every row."""
    total = upto = 0
    for m in conv.messages:
        content = m["content"]
        total += len(content) if isinstance(content, str) else 0
        if m["role"] == "user":
            upto = total
            if turns == "first":
                break
    return upto


def scan_prompts(cfg: RunConfig, sample_size: int, seed: int = 0, longest: int = 0
                 ) -> tuple[ShardPlan, list[Conversation], list[Conversation]]:
    """One streaming pass over every row: counts per turn mode, a uniform reservoir sample of conversations, and the
    `longest` conversations by prompt characters (longest first)."""
    rng = random.Random(seed)
    heap: list[tuple[int, int, Conversation]] = []  # (chars, -index, conversation): the smallest of them on top
    conversations = rejects = 0
    by_reason: dict[str, int] = {}
    samples = {"all": 0, "last": 0, "first": 0}
    user_turns: dict[int, int] = {}
    sources: dict[str, int] = {}
    reservoir: list[Conversation] = []
    try:
        for item in iter_prompts(cfg.prompts, cfg.prompt_format):
            if isinstance(item, Reject):
                rejects += 1
                kind = getattr(item, "category", None)
                key = (kind() if callable(kind) else kind) or item.reason
                by_reason[key] = by_reason.get(key, 0) + 1
                continue
            n = _user_messages(item)
            samples["all"] += n
            samples["last"] += 1 if n else 0
            samples["first"] += 1 if n else 0
            user_turns[n] = user_turns.get(n, 0) + 1
            sources[item.source] = sources.get(item.source, 0) + 1
            if longest:
                chars = prompt_chars(item, cfg.turns)
                if len(heap) < longest:
                    heapq.heappush(heap, (chars, -item.index, item))
                elif chars > heap[0][0]:  # ties keep the earlier row
                    heapq.heapreplace(heap, (chars, -item.index, item))
            if len(reservoir) < sample_size:
                reservoir.append(item)
            else:
                j = rng.randrange(conversations + 1)
                if j < sample_size:
                    reservoir[j] = item
            conversations += 1
    except PromptFileError as exc:
        raise PlanError(f"prompts: {exc}") from exc
    shards = math.ceil(conversations / cfg.shard_size) if conversations else 0
    last = conversations - (shards - 1) * cfg.shard_size if shards else 0
    plan = ShardPlan(conversations, rejects, by_reason, samples, cfg.turns, samples[cfg.turns], cfg.shard_size,
                     shards, last, dict(sorted(sources.items())), dict(sorted(user_turns.items())))
    reservoir.sort(key=lambda c: c.index)
    return plan, reservoir, [c for _, _, c in sorted(heap, key=lambda e: e[:2], reverse=True)]


def renderer_of(cfg: RunConfig):
    from engine.text.render import RenderError, Renderer

    try:
        return Renderer(cfg.tokenizer_path, enable_thinking=cfg.enable_thinking, context_length=cfg.context_length)
    except RenderError as exc:
        raise PlanError(str(exc)) from exc


def sample_prompts(renderer, cfg: RunConfig, convs: Sequence[Conversation]) -> list[tuple[Conversation, int, list[int]]]:
    """(conversation, turn, prompt ids) of every planned turn of the sampled conversations. Earlier
    turns use the dataset's own answers (the regenerated ones do not exist yet)."""
    items = []
    for conv in convs:
        for turn in renderer.user_turns(conv, cfg.turns):
            items.append((conv, turn, renderer.build_messages(conv, turn, {}, "last")))
    ids = renderer.prompt_ids_many([m for _, _, m in items])
    return [(c, t, i) for (c, t, _), i in zip(items, ids)]


def prompt_token_stats(rendered: list[tuple[Conversation, int, list[int]]], n_convs: int, mode: str) -> PromptTokens:
    lens = np.array([len(ids) for _, _, ids in rendered], dtype=np.int64)
    note = ("rendered with the model's chat template" + (
        "; later turns with the dataset's own earlier answers (the regenerated ones differ)" if mode == "all" else ""))
    if lens.size == 0:
        return PromptTokens(n_convs, 0, None, None, None, None, None, note)
    p50, p90, p99 = np.percentile(lens, [50, 90, 99])
    return PromptTokens(n_convs, int(lens.size), float(lens.mean()), float(p50), float(p90), float(p99),
                        int(lens.max()), note)


def _where(conv: Conversation) -> str:
    if conv.line is not None:
        return f"{conv.file}:{conv.line}"
    return f"{conv.file}:row{conv.row}" if conv.row is not None else conv.origin


def check_context(cfg: RunConfig, renderer, rendered: list[tuple[Conversation, int, list[int]]], rows_read: int,
                  how: str, longest_asked: int, longest_ids: set[int]) -> tuple[ContextCheck, list[str]]:
    """The rendered prompts against SGLang's input limit and the room for max_new_tokens; the WARN lines."""
    from engine.run.prompt_limit import from_context

    where = "run.toml context_length" if cfg.context_length else "the model's config / tokenizer"
    limit = from_context(renderer.context_length, where)
    max_new = cfg.sampling.max_new_tokens
    lens = [(conv, turn, len(ids)) for conv, turn, ids in rendered]
    lens.sort(key=lambda x: -x[2])
    over = [x for x in lens if not limit.fits(x[2])]
    capped = [x for x in lens if limit.fits(x[2]) and limit.room(x[2]) < max_new]
    long_over = [x for x in over if x[0].index in longest_ids]
    at_least = bool(longest_asked) and len({x[0].index for x in long_over}) >= longest_asked

    def examples(items) -> list[PromptExample]:
        return [PromptExample(_where(c), f"{c.conversation_id}#turn{t}", n) for c, t, n in items[:EXAMPLES_LISTED]]

    check = ContextCheck(renderer.context_length, where, limit.max_input_len, max_new, rows_read, len(lens), how,
                         len(over), at_least, examples(over), len(capped), examples(capped),
                         lens[0][2] if lens else None)
    warnings = []
    if over:
        shown = ", ".join(f"{e.where} {e.sample_id} ({e.tokens:,} tokens)" for e in check.over_examples[:3])
        warnings.append(
            f"{'at least ' if at_least else ''}{len(over):,} prompt(s) at or over SGLang's input limit of "
            f"{limit.max_input_len:,} tokens (context_length {renderer.context_length:,} from {where}, minus 6): "
            f"those turns are rejected, not generated (each to rejects.jsonl); e.g. {shown}. Found among {len(lens):,}"
            f" prompts rendered ({how}); filter those rows out of the prompt files, or raise context_length where "
            "the model allows it")
    if capped:
        shown = ", ".join(f"{e.sample_id} ({e.tokens:,} tokens)" for e in check.capped_examples[:3])
        warnings.append(
            f"{len(capped):,} of {len(lens):,} rendered prompts leave less than max_new_tokens {max_new:,} for the "
            f"answer (context {renderer.context_length:,}): their answers are cut at the context (finish_reason "
            f"length; the export drops those by default), e.g. {shown}; lower max_new_tokens or raise context_length "
            "to keep them whole")
    return check, warnings

