"""`regen plan`: the shard plan, prompt token counts, and the GPU-time / wall-time / disk projection.

Every prompt row is read (the shard plan counts them all). The token figures render a uniform sample of the
conversations plus the LONGEST_RENDERED longest prompts by characters of every row read, so a prompt too long for the
context is found wherever it is in the files; `context` says how many rendered prompts are over SGLang's input limit
(context - 6 tokens: their turns are rejected, not generated) and how many leave less room than max_new_tokens (their
answers are cut at the context), and each is a WARN line (`warnings` in --json), with or without a pilot.

Without a pilot the projection uses the config's [plan] assumptions (printed as "assumed").
With `pilot=N` the throughput and output lengths are measured on live servers first (engine/plan/pilot.py: each
server kept at the batch the run will give it, N raised to what fills it).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import heapq
import json
import math
import random
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from engine.config.load import ConfigError, RunConfig, load_config, resolve_sampling
from engine.run.brake import BrakePlan, plan_of
from engine.text.ingest import Conversation, iter_prompts
from engine.text.row_errors import PromptFileError, Reject
from engine.plan.pilot import PilotError, PilotResult, run_pilot
from engine.run.committer import CHAIN_COMMIT_S
from engine.placement.slurm.plan import SlurmPlan, layout_of, plan_slurm
from engine.store.shard_schema import PART_COMPRESSION, PART_DICTIONARY, PART_STATISTICS, SHARD_SCHEMA

SCHEMA = "regen.plan/1"
LONGEST_RENDERED = 64  # the longest prompts by characters of every row read, rendered besides the sample
EXAMPLES_LISTED = 10


class PlanError(Exception):
    """The plan cannot be made (prompts unreadable, tokenizer unusable, workers failed); the message says why."""


@dataclass
class Range:
    value: float
    low: float
    high: float
    basis: str  # "assumed" | "pilot: ..." | "measured"


@dataclass
class ShardPlan:
    conversations: int
    rejects: int
    rejects_by_reason: dict[str, int]
    samples_by_mode: dict[str, int]  # all | last | first
    turn_mode: str
    samples: int
    shard_size: int
    shards: int
    last_shard_conversations: int
    sources: dict[str, int]  # conversations per source
    user_turns: dict[int, int] = field(default_factory=dict)  # conversations by their number of user turns


@dataclass
class PromptTokens:
    conversations_sampled: int
    samples_sampled: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: int | None
    note: str


@dataclass
class ContextCheck:
    """The planned prompts against the context, before any server starts. Decided: a prompt at or over SGLang's
    input limit (context - 6 tokens, engine.run.prompt_limit) is a WARN (its turn is rejected, not generated); a
    prompt that leaves less room than max_new_tokens is a WARN too (its answer is cut at the context, finish_reason
    length, which the export drops by default). The servers may lower the limit (their KV pool): the run's feed
    applies the tightest figure they report."""
    context_length: int
    context_source: str  # where the context length was read
    input_limit: int  # prompts of this many tokens or more are refused
    max_new_tokens: int
    rows_read: int  # conversations read (every row of every prompt file)
    rendered: int  # prompts rendered for this check (a conversation's every planned turn)
    how: str  # which conversations were rendered
    over_limit: int  # rendered prompts at or over input_limit
    over_limit_at_least: bool  # the longest-by-characters rows were all over: more rows than those may be
    over_examples: list[dict[str, Any]]  # {where, sample_id, tokens}, the longest first
    capped: int  # rendered prompts under the limit whose room for the answer is below max_new_tokens
    capped_examples: list[dict[str, Any]]
    longest: int | None  # the longest rendered prompt, in tokens


@dataclass
class FilesProjection:
    """The files the shards take: parts while a shard is generated, one file per shard once it is compacted."""
    shards: int  # files the run leaves: one per shard (shards/<id>/shard.parquet)
    samples_per_shard: float
    rows_per_part: Range  # at the projected rate: a part is cut every `cut_s` (or at part_max_rows)
    parts_per_shard: Range  # part files a shard has while it is generated, before its compaction
    cut_s: float
    basis: str


@dataclass
class Projection:
    output_tokens_per_sample: Range
    tokens_per_s_per_worker: Range
    total_output_tokens: Range
    gpu_hours: Range
    wall_hours: Range
    disk_bytes: Range
    bytes_per_prompt_token: float
    bytes_per_output_token: float
    bytes_per_token_basis: str
    disk_free_bytes: int | None
    disk_free_path: str
    disk_headroom_bytes: Range | None
    workers: int
    gpus_per_worker: int
    files: FilesProjection


@dataclass
class GuardProjection:
    """What the runaway guard ([runaway]) is expected to save: the output tokens (hence GPU time, at a full batch)
    that answers looping until max_new_tokens would have cost past the point where the guard stops them."""
    enabled: bool
    settings: str
    basis: str  # "pilot: ..." (the pilot's answers run through the detector) | "assumed: ..."
    answers: int  # judged (pilot answers; 0 when assumed)
    would_stop: int  # of them, stopped by the guard
    loop_share: float  # the share of answers looping (measured or assumed)
    tokens_saved_share: float  # of the output tokens generated without the guard
    gpu_hours_saved: Range


@dataclass
class CutPolicyProjection:
    """What turns_after_cut = "stop" saves: a conversation's turns after a cut one (length, or a runaway the guard
    stops) are not generated. With a cut share p per turn, a conversation of n turns skips
    sum_{k=1}^{n-1} (1 - (1 - p)^k) turns; GPU time saved in proportion to the samples (mean output per sample)."""
    policy: str  # the config's turns_after_cut
    basis: str  # "pilot: ..." | "no pilot: ..." | "turns = ...: no later turns are generated"
    cut_share: float | None  # of the pilot's answers: ended at max_new_tokens or a runaway (None: no pilot)
    later_turns: int  # samples after a conversation's first turn (what the policy can skip)
    skipped: float  # expected samples not generated under "stop" (0 when not estimated)
    skipped_share: float  # of the planned samples
    gpu_hours_saved: Range  # under "stop" (with "continue": what "stop" would save)


@dataclass
class Plan:
    config: str | None
    run_dir: str
    shard_plan: ShardPlan
    prompt_tokens: PromptTokens
    pilot: PilotResult | None
    projection: Projection
    assumptions: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    runaway: GuardProjection | None = None
    brake: BrakePlan | None = None  # the data-quality brake's settings ([brake])
    sampling: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> {value, source}
    sampling_note: str = ""
    turns_after_cut: CutPolicyProjection | None = None
    slurm: SlurmPlan | None = None  # with [slurm]: the jobs regen submits and the allocations the run needs
    context: ContextCheck | None = None  # the prompts against the context (every row read)
    warnings: list[str] = field(default_factory=list)  # what the operator must see before starting (WARN lines)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **asdict(self)}


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


def _renderer(cfg: RunConfig):
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

    def examples(items) -> list[dict[str, Any]]:
        return [{"where": _where(c), "sample_id": f"{c.conversation_id}#turn{t}", "tokens": n}
                for c, t, n in items[:EXAMPLES_LISTED]]

    check = ContextCheck(renderer.context_length, where, limit.max_input_len, max_new, rows_read, len(lens), how,
                         len(over), at_least, examples(over), len(capped), examples(capped),
                         lens[0][2] if lens else None)
    warnings = []
    if over:
        shown = ", ".join(f"{e['where']} {e['sample_id']} ({e['tokens']:,} tokens)" for e in check.over_examples[:3])
        warnings.append(
            f"{'at least ' if at_least else ''}{len(over):,} prompt(s) at or over SGLang's input limit of "
            f"{limit.max_input_len:,} tokens (context_length {renderer.context_length:,} from {where}, minus 6): "
            f"those turns are rejected, not generated (each to rejects.jsonl); e.g. {shown}. Found among {len(lens):,}"
            f" prompts rendered ({how}); filter those rows out of the prompt files, or raise context_length where "
            "the model allows it")
    if capped:
        shown = ", ".join(f"{e['sample_id']} ({e['tokens']:,} tokens)" for e in check.capped_examples[:3])
        warnings.append(
            f"{len(capped):,} of {len(lens):,} rendered prompts leave less than max_new_tokens {max_new:,} for the "
            f"answer (context {renderer.context_length:,}): their answers are cut at the context (finish_reason "
            f"length; the export drops those by default), e.g. {shown}; lower max_new_tokens or raise context_length "
            "to keep them whole")
    return check, warnings


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


def _free_space(run_dir: str) -> tuple[int | None, str]:
    path = Path(run_dir).expanduser()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free, str(path)
    except OSError as exc:
        return None, f"{path} ({exc})"


# --- projection ------------------------------------------------------------------------------


def project(cfg: RunConfig, shard_plan: ShardPlan, prompt: PromptTokens, pilot: PilotResult | None,
            disk_model: DiskModel) -> Projection:
    a = cfg.plan
    n_workers, tp = len(cfg.workers.groups()), cfg.workers.tp_size
    if cfg.slurm is not None:  # the servers of the fewest nodes Slurm may give, not [workers] gpus
        n_workers = layout_of(cfg).servers_counted
    if pilot:
        out = Range(pilot.output_mean, pilot.output_mean_ci[0], pilot.output_mean_ci[1],
                    f"pilot: mean of {pilot.prompts} outputs, bootstrap 95% CI")
        rates = np.array([w.tokens_per_s for w in pilot.workers if w.tokens_per_s > 0])
        if rates.size == 0:
            raise PlanError("pilot: no worker had a saturated window to measure throughput (more prompts needed)")
        q25, q75 = np.percentile(rates, [25, 75])
        tps = Range(float(rates.mean()), float(q25), float(q75),
                    f"pilot: mean over {rates.size} workers, p25-p75 of per-worker throughput")
    else:
        out = Range(a.output_tokens_per_sample, a.output_tokens_per_sample, a.output_tokens_per_sample, "assumed")
        per_worker = a.tokens_per_s_per_gpu * tp
        tps = Range(per_worker, per_worker, per_worker, "assumed")
    n = shard_plan.samples
    total = Range(n * out.value, n * out.low, n * out.high, out.basis)
    # more tokens at less throughput bounds the high end
    rate_all = [tps.value * n_workers, tps.low * n_workers, tps.high * n_workers]
    wall_h = Range(total.value / rate_all[0] / 3600, total.low / rate_all[2] / 3600,
                   total.high / rate_all[1] / 3600,
                   out.basis if out.basis == tps.basis else f"output: {out.basis}; throughput: {tps.basis}")
    gpu_h = Range(wall_h.value * n_workers * tp, wall_h.low * n_workers * tp, wall_h.high * n_workers * tp, wall_h.basis)
    prompt_bytes = (prompt.mean or 0.0) * disk_model.bytes_per_prompt_token
    per_out = disk_model.bytes_per_output_token
    disk = Range(n * (prompt_bytes + out.value * per_out), n * (prompt_bytes + out.low * per_out),
                 n * (prompt_bytes + out.high * per_out),
                 f"{disk_model.basis.split(':')[0]}: samples x (mean prompt tokens x B/prompt token + output "
                 "tokens x B/output token)")
    free, free_path = _free_space(cfg.run_dir)
    headroom = (Range(free - disk.value, free - disk.high, free - disk.low, "free space minus the shards")
                if free is not None else None)
    files = project_files(cfg, shard_plan, out, tps, n_workers)
    return Projection(out, tps, total, gpu_h, wall_h, disk, disk_model.bytes_per_prompt_token, per_out,
                      disk_model.basis, free, free_path, headroom, n_workers, tp, files)


def project_files(cfg: RunConfig, shard_plan: ShardPlan, out: Range, tps: Range, n_workers: int) -> FilesProjection:
    """Parts per shard while it is generated, at the projected rate: the committer cuts a shard's part every
    part_max_age_s (within CHAIN_COMMIT_S when a later turn waits on it: turns = "all" with multi-turn
    conversations), or at part_max_rows. Counted as if one shard took every answer at a time (the feed walks
    the shards in order): the most rows a part can get. Compaction leaves one file per shard."""
    chained = cfg.turns == "all" and shard_plan.samples > shard_plan.conversations
    cut_s = CHAIN_COMMIT_S if chained else cfg.store.part_max_age_s
    per_shard = shard_plan.samples / shard_plan.shards if shard_plan.shards else 0.0

    def rows(rate_tokens: float, out_tokens: float) -> float:
        samples_per_s = rate_tokens * n_workers / out_tokens if out_tokens > 0 else 0.0
        return float(min(cfg.store.part_max_rows, max(1.0, samples_per_s * cut_s)))

    # fewer rows per part at less throughput or longer answers: the high end of the parts
    rpp = Range(rows(tps.value, out.value), rows(tps.low, out.high), rows(tps.high, out.low), "")
    parts = Range(math.ceil(per_shard / rpp.value) if per_shard else 0, math.ceil(per_shard / rpp.high) if per_shard else 0,
                  math.ceil(per_shard / rpp.low) if per_shard else 0, "")
    basis = (f"a part every {cut_s:g} s" + (" (a later turn waits on it)" if chained else " (part_max_age_s)")
             + f" or {cfg.store.part_max_rows} rows, at the projected rate")
    rpp.basis = parts.basis = basis
    return FilesProjection(shard_plan.shards, per_shard, rpp, parts, cut_s, basis)


def project_guard(cfg: RunConfig, projection: Projection, outputs: list | None,
                  pilot: PilotResult | None = None) -> GuardProjection:
    """From a pilot's answers, or from plan.loop_share. A pilot with the guard on streamed its answers through it, so
    its runaways were stopped as the run stops them (finish_reason repetition): each would have run to
    max_new_tokens without it. A pilot without the guard: each answer is run through the detector as it would have
    streamed (a chunk every runaway.stream_interval tokens). Assumed: a looping answer runs to max_new_tokens and is
    stopped where its cycle covers the guard's span, about min_span tokens after it began half-way through a normal
    answer. GPU time saved is taken in proportion to the output tokens saved (decode at a full batch)."""
    from engine.run.runaway import RunawayDetector

    r, max_new = cfg.runaway, cfg.sampling.max_new_tokens
    settings = (f"cycles of period <= {r.max_period} repeated >= {r.min_repeats}x over >= {r.min_span} tokens; "
                f"n-gram ({r.ngram}) repeat share >= {r.ngram_share:.0%} over {r.ngram_window} tokens"
                + ("" if r.enabled else " (off: runaway.enabled = false)"))
    gpu = projection.gpu_hours
    stopped_in_pilot = pilot is not None and pilot.finish_reasons.get("repetition", 0) > 0
    if outputs and pilot is not None and stopped_in_pilot:
        kept = sum(len(ids) for ids in outputs)
        stopped = pilot.finish_reasons["repetition"]
        saved = sum(max(0, max_new - len(ids)) for ids, fr in zip(outputs, getattr(pilot, "_finishes", [])) if fr == "repetition")
        share = saved / (kept + saved) if kept + saved else 0.0
        basis = (f"pilot: its {len(outputs)} answers streamed through the guard ({stopped} stopped, each taken to "
                 "have run to max_new_tokens without it); GPU time in proportion to the output tokens")
        loops, n = stopped / len(outputs), len(outputs)
        # the projection's GPU time is already the guarded run's: what the guard saves is on top of it
        hours_share = saved / kept if kept else 0.0
        if not r.enabled:
            share = hours_share = 0.0
        hours = Range(gpu.value * hours_share, gpu.low * hours_share, gpu.high * hours_share, basis)
        return GuardProjection(r.enabled, settings, basis, n, stopped, loops, share, hours)
    if outputs:
        total = saved = stopped = 0
        for ids in outputs:
            total += len(ids)
            det = RunawayDetector(r)
            for start in range(0, len(ids), r.stream_interval):
                verdict = det.feed(ids[: start + r.stream_interval], start)
                if verdict is not None:
                    stopped += 1
                    saved += len(ids) - verdict.at
                    break
        share = saved / total if total else 0.0
        basis = (f"pilot: its {len(outputs)} answers run through the detector ({stopped} stopped); GPU time in "
                 "proportion to the output tokens")
        loops = stopped / len(outputs)
        n = len(outputs)
    else:
        loops, n, stopped = cfg.plan.loop_share, 0, 0
        normal = projection.output_tokens_per_sample.value
        stop_at = normal / 2 + r.min_span + r.stream_interval
        per_sample = (1 - loops) * normal + loops * max_new  # the loops cost max_new_tokens each without it
        share = loops * max(0.0, max_new - stop_at) / per_sample if per_sample else 0.0
        basis = (f"assumed: an estimate, plan.loop_share = {loops:.1%} of answers looping to max_new_tokens "
                 f"{max_new:,}, stopped at ~{stop_at:,.0f} tokens (--pilot N measures it)")
    if not r.enabled:
        share = 0.0
    hours = Range(gpu.value * share, gpu.low * share, gpu.high * share, basis)
    return GuardProjection(r.enabled, settings, basis, n, stopped, loops, share, hours)


def project_cut_policy(cfg: RunConfig, shard_plan: ShardPlan, projection: Projection,
                       pilot: PilotResult | None) -> CutPolicyProjection:
    """turns_after_cut: the later turns "stop" does not generate, from the pilot's share of cut answers."""
    later = sum((n - 1) * c for n, c in shard_plan.user_turns.items() if n > 1) if cfg.turns == "all" else 0
    none = Range(0.0, 0.0, 0.0, "")
    if not later:
        why = (f"turns = {cfg.turns!r}: no turn is built on an earlier answer" if cfg.turns != "all"
               else "no conversation has more than one user turn")
        return CutPolicyProjection(cfg.turns_after_cut, why, None, 0, 0.0, 0.0, dataclasses.replace(none, basis=why))
    if pilot is None or not pilot.prompts:
        why = "no pilot: --pilot N measures the share of answers cut at max_new_tokens"
        return CutPolicyProjection(cfg.turns_after_cut, why, None, later, 0.0, 0.0, dataclasses.replace(none, basis=why))
    cut = sum(pilot.finish_reasons.get(f, 0) for f in ("length", "repetition"))
    p = cut / pilot.prompts
    skipped = sum(c * sum(1 - (1 - p) ** k for k in range(1, n)) for n, c in shard_plan.user_turns.items() if n > 1)
    share = skipped / shard_plan.samples if shard_plan.samples else 0.0
    basis = (f"pilot: {cut} of {pilot.prompts} answers cut (max_new_tokens {cfg.sampling.max_new_tokens:,}); each "
             "turn after a cut one not generated; GPU time in proportion to the samples")
    gpu = projection.gpu_hours
    return CutPolicyProjection(cfg.turns_after_cut, basis, p, later, skipped, share,
                               Range(gpu.value * share, gpu.low * share, gpu.high * share, basis))


# --- entry points ----------------------------------------------------------------------------


def make_plan(cfg: RunConfig, *, pilot: int = 0, sample_conversations: int | None = None,
              python: str | None = None) -> Plan:
    cfg, effective = resolve_sampling(cfg)  # what the run would send: run.toml, else the model's, else regen's
    sample_size = sample_conversations or cfg.plan.sample_conversations
    shard_plan, sample, longest = scan_prompts(cfg, sample_size, longest=LONGEST_RENDERED)
    renderer = _renderer(cfg)
    rendered = sample_prompts(renderer, cfg, sample)
    prompt = prompt_token_stats(rendered, len(sample), cfg.turns)
    sampled = {c.index for c in sample}
    extra = [c for c in longest if c.index not in sampled]
    rendered_long = sample_prompts(renderer, cfg, extra)
    rows_read = shard_plan.conversations
    how = (f"{len(sample):,} conversations sampled uniformly and the {len(longest):,} longest by prompt characters of "
           f"all {rows_read:,} read")
    context, warnings = check_context(cfg, renderer, rendered + rendered_long, rows_read, how,
                                      LONGEST_RENDERED if len(longest) >= LONGEST_RENDERED else 0,
                                      {c.index for c in longest})
    if context.longest is not None and (prompt.max is None or context.longest > prompt.max):
        prompt.max = context.longest
        prompt.note += f"; max over the sample and the {len(longest):,} longest prompts by characters"
    notes: list[str] = []
    result = None
    outputs = None
    if pilot and cfg.slurm is not None:
        raise PlanError("--pilot with [slurm] is not supported: the pilot starts servers where `regen plan` runs, "
                        "and a login node has no GPUs; plan without --pilot (the [plan] assumptions), or pilot "
                        "the same model on a GPU node with [workers] alone")
    if pilot:
        def prompts_for(k: int) -> list[tuple[Conversation, int, list[int]]]:
            if k <= len(rendered):
                return rendered
            _, more, _ = scan_prompts(cfg, k)  # a second pass with a sample the size the pilot needs
            return sample_prompts(renderer, cfg, more)

        try:
            result, pilot_notes = asyncio.run(run_pilot(cfg, renderer, prompts_for, pilot, python))
        except PilotError as exc:
            raise PlanError(str(exc)) from exc
        notes += pilot_notes
        outputs = getattr(result, "_outputs", None)
    projection = project(cfg, shard_plan, prompt, result, measure_disk(renderer, rendered, outputs))
    assumptions = {"output_tokens_per_sample": cfg.plan.output_tokens_per_sample,
                   "tokens_per_s_per_gpu": cfg.plan.tokens_per_s_per_gpu,
                   "loop_share": cfg.plan.loop_share,
                   "used": result is None}
    guard = project_guard(cfg, projection, outputs if result is not None else None, result)
    return Plan(cfg.source_path, cfg.run_dir, shard_plan, prompt, result, projection, assumptions, notes,
                runaway=guard, brake=plan_of(cfg), sampling=effective.as_dict(), sampling_note=effective.note,
                turns_after_cut=project_cut_policy(cfg, shard_plan, projection, result),
                slurm=None if cfg.slurm is None else plan_slurm(cfg, projection.wall_hours.high * 3600),
                context=context, warnings=warnings)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.plan.projection", description="shard plan and GPU-time projection (JSON)")
    ap.add_argument("--config", required=True)
    ap.add_argument("--pilot", type=int, default=0, metavar="N")
    ap.add_argument("--sample", type=int, default=None, metavar="N", help="conversations tokenized (default [plan])")
    ap.add_argument("--json", action="store_true", help="JSON output (the only format; kept for symmetry)")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config)
        plan = make_plan(cfg, pilot=args.pilot, sample_conversations=args.sample)
    except (ConfigError, PlanError) as exc:
        print(json.dumps({"schema": SCHEMA, "error": str(exc)}))
        print(f"regen plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
