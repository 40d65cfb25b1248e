"""`regen plan`: the shard plan, the prompt tokens and the GPU-time / wall-time / disk projection, as a Plan report.
Without a pilot the projection uses the config's [plan] assumptions (printed as "assumed"); with `pilot=N` the
throughput and output lengths are measured on live servers first (engine.plan.pilot).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from engine.api.reports import (PLAN_SCHEMA, Assumptions, CutPolicyProjection, FilesProjection, GuardProjection,
                                PilotResult, Plan, Projection, PromptTokens, Range, SampledValue, ShardPlan)
from engine.api.wire import FinishReason
from engine.config.load import ConfigError, RunConfig, load_config, resolve_sampling
from engine.placement.slurm.plan import layout_of, plan_slurm
from engine.plan.disk_model import DiskModel, free_space, measure_disk
from engine.plan.pilot import PilotError, run_pilot
from engine.plan.prompts import PlanError, check_context, prompt_token_stats, renderer_of, sample_prompts, scan_prompts
from engine.run.brake import plan_of
from engine.run.committer import CHAIN_COMMIT_S
from engine.servers.tuning import RunTuning, pilot_choice, planned_choice, record_pilot
from engine.text.ingest import Conversation

LONGEST_RENDERED = 64  # the longest prompts by characters of every row read, rendered besides the sample


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
    free, free_path = free_space(cfg.run_dir)
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
        saved = sum(max(0, max_new - len(ids)) for ids, fr in zip(outputs, getattr(pilot, "_finishes", []))
                    if fr == FinishReason.REPETITION)
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
    cut = sum(pilot.finish_reasons.get(f, 0) for f in (FinishReason.LENGTH, FinishReason.REPETITION))
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
    renderer = renderer_of(cfg)
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
    # the servers' --schedule-conservativeness: a pilot runs at the run's start value and chooses the next one
    tuning = RunTuning(cfg, Path(cfg.run_dir).expanduser(), pilot=True)
    notes += tuning.notes
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
            result, pilot_notes = asyncio.run(run_pilot(cfg, renderer, prompts_for, pilot, python, tuning))
        except PilotError as exc:
            raise PlanError(str(exc)) from exc
        notes += pilot_notes
        outputs = getattr(result, "_outputs", None)
        choice = pilot_choice(tuning, result.evidence, cfg.sampling.max_new_tokens, result.answer_tail,
                              result.clip_tails)
        problem = record_pilot(tuning, choice)
        if problem:
            notes.append(problem)
    else:
        choice = planned_choice(tuning)
    projection = project(cfg, shard_plan, prompt, result, measure_disk(renderer, rendered, outputs))
    assumptions = Assumptions(cfg.plan.output_tokens_per_sample, cfg.plan.tokens_per_s_per_gpu, cfg.plan.loop_share,
                              used=result is None)
    guard = project_guard(cfg, projection, outputs if result is not None else None, result)
    return Plan(cfg.source_path, cfg.run_dir, shard_plan, prompt, result, projection, assumptions, notes,
                runaway=guard, brake=plan_of(cfg), sampling={k: SampledValue(v["value"], v["source"]) for k, v in effective.as_dict().items()}, sampling_note=effective.note,
                turns_after_cut=project_cut_policy(cfg, shard_plan, projection, result),
                slurm=None if cfg.slurm is None else plan_slurm(cfg, projection.wall_hours.high * 3600),
                context=context, warnings=warnings, tuning=choice)


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
        print(json.dumps({"schema": PLAN_SCHEMA, "error": str(exc)}))
        print(f"regen plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
