"""Data-quality statistics of a run's committed shards (`regen stats`): counts, distributions, the training cut,
groups by source / worker / shard, the quality flags and their alerts, vectorized over whole columns.
sum(loss_mask) == output_len is validated at commit, so the mask distribution is output_len's, and checked again
(engine.store.stats_parts); empty answers and reasoning follow engine.store.stats_columns.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from engine.api.events import AlertEvent
from engine.api.reports import (STATS_SCHEMA, Count, CutStats, Distribution, Flag, GroupStats, HistogramBin,
                                IntegrityError, LossMaskStats, MaskCheck, PartsRead, RunStats, ShardStats, Thresholds)
from engine.api.wire import AlertKind, Severity
from engine.store.names import STATE_DB
from engine.store.stats_columns import FINISH_ABORT, FINISH_LENGTH, FINISH_REPETITION, THINK_NAMES
from engine.store.stats_parts import PartResult, StatsReadError, list_parts, read_listing, sampled_mask_note

DEFAULT_TRAIN_MAX_LENGTH = 4096
DEFAULT_EMPTY_THRESHOLD = 0.05
DEFAULT_TRUNCATED_THRESHOLD = 0.10
DEFAULT_REPETITION_THRESHOLD = 0.05  # as runaway.alert_share (engine.config.load.Runaway)
MAX_ERROR_EXAMPLES = 20
LIST_ATTEMPTS = 5  # listings read again when parts vanished under the reader (each time: a shard compacted)


# --- aggregation -----------------------------------------------------------------------------


def _count(n: int, of: int) -> Count:
    return Count(int(n), (n / of) if of else 0.0)


def distribution(values: np.ndarray) -> Distribution:
    """Percentiles with numpy's default (linear interpolation; = statistics.quantiles(method='inclusive'))."""
    if values.size == 0:
        return Distribution(0, None, None, None, None, None, None)
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return Distribution(int(values.size), float(values.mean()), int(values.min()), float(p50), float(p90),
                        float(p99), int(values.max()))


def log2_histogram(values: np.ndarray) -> list[HistogramBin]:
    """Bins 0, 1, 2-3, 4-7, ..., [2^k, 2^(k+1)-1] up to the bin holding the max."""
    if values.size == 0:
        return []
    v = values.astype(np.int64)
    _, exponent = np.frexp(np.maximum(v, 1).astype(np.float64))  # v = m * 2^e, m in [0.5, 1): floor(log2 v) = e-1
    index = np.where(v <= 0, 0, exponent)  # 0 -> bin 0, [2^(e-1), 2^e - 1] -> bin e
    counts = np.bincount(index, minlength=int(index.max()) + 1)
    bins = []
    total = int(v.size)
    for i, c in enumerate(counts):
        low, high = (0, 0) if i == 0 else (1 << (i - 1), (1 << i) - 1)
        label = str(low) if low == high else f"{low}-{high}"
        bins.append(HistogramBin(label, low, high, int(c), int(c) / total))
    return bins


def _groups(names: list[str], codes: np.ndarray, empty, finish, output_len, thresholds) -> list[GroupStats]:
    n = len(names)
    samples = np.bincount(codes, minlength=n)
    empties = np.bincount(codes, weights=empty, minlength=n)
    truncated = np.bincount(codes, weights=finish == FINISH_LENGTH, minlength=n)
    aborted = np.bincount(codes, weights=finish == FINISH_ABORT, minlength=n)
    repetition = np.bincount(codes, weights=finish == FINISH_REPETITION, minlength=n)
    tokens = np.bincount(codes, weights=output_len, minlength=n)
    out = []
    for i, name in enumerate(names):
        s = int(samples[i])
        if s == 0:
            continue
        g = GroupStats(name, s, _count(int(empties[i]), s), _count(int(truncated[i]), s),
                       _count(int(aborted[i]), s), float(tokens[i]) / s, int(tokens[i]),
                       repetition=_count(int(repetition[i]), s))
        g.flagged = _group_flags(g, thresholds)
        out.append(g)
    return out


def _group_flags(g: GroupStats, thresholds: Thresholds) -> list[str]:
    flags = []
    if g.empty.share > thresholds.empty_share:
        flags.append("empty")
    if g.truncated.share > thresholds.truncated_share:
        flags.append("truncated")
    if thresholds.repetition_share is not None and g.repetition.share > thresholds.repetition_share:
        flags.append("repetition")
    return flags


def _merge_codes(parts: list[PartResult], attr: str) -> tuple[list[str], np.ndarray]:
    names: dict[str, int] = {}
    chunks = []
    for p in parts:
        local = getattr(p, f"{attr}_values")
        mapping = np.array([names.setdefault(v, len(names)) for v in local], dtype=np.int32)
        codes = getattr(p, f"{attr}_codes")
        chunks.append(mapping[codes] if codes.size else codes)
    codes = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    ordered = sorted(names, key=names.__getitem__)
    return ordered, codes


def compute_stats(run_dir: Path, *, train_max_length: int = DEFAULT_TRAIN_MAX_LENGTH,
                  empty_threshold: float = DEFAULT_EMPTY_THRESHOLD,
                  truncated_threshold: float = DEFAULT_TRUNCATED_THRESHOLD,
                  repetition_threshold: float = DEFAULT_REPETITION_THRESHOLD,
                  mask_check: str = "auto", threads: int | None = None) -> RunStats:
    """Statistics of the committed shards of `run_dir`. Raises StatsReadError when the run dir
    cannot be read; a committed part that is missing or unreadable is an integrity error."""
    if mask_check not in ("auto", "full", "sample", "off"):
        raise ValueError(f"mask_check={mask_check!r}: must be auto, full, sample or off")
    if train_max_length < 1:
        raise ValueError(f"train_max_length={train_max_length}: must be >= 1")
    started = time.perf_counter()
    run_dir = Path(run_dir).expanduser()
    for attempt in range(LIST_ATTEMPTS):
        listing = list_parts(run_dir)
        mode, check_idx, errors, missing, results = read_listing(run_dir, listing, mask_check, threads)
        if not missing or listing.listed_from == "glob" or attempt == LIST_ATTEMPTS - 1:
            break
        # a part listed, then gone: compacted into its shard's file in between (engine.store.shard_store), unless
        # it is still committed (then it is missing for real, an integrity error): read a fresh listing
        if set(missing) <= {p for p, _, _ in list_parts(run_dir).parts}:
            break

    if listing.recorded:
        # the store counted empties with engine.text.answer_shape at commit; the vectorized rule must agree
        for p in results:
            rec = listing.recorded.get(p.path)
            got = (p.rows, int(p.empty.sum()), int(np.count_nonzero(p.finish == FINISH_LENGTH)))
            if rec is None:
                errors.append(IntegrityError("sqlite_counts", p.path, f"no samples of this part in {STATE_DB}"))
            elif rec != got:
                errors.append(IntegrityError(
                    "sqlite_counts", p.path, f"{STATE_DB} samples table says (samples, empty, truncated) = {rec}, "
                    f"the part file gives {got}"))

    cat = (lambda attr, dtype: np.concatenate([getattr(p, attr) for p in results]).astype(dtype, copy=False)
           if results else np.zeros(0, dtype=dtype))
    prompt_len = cat("prompt_len", np.int64)
    output_len = cat("output_len", np.int64)
    reasoning = cat("reasoning_tokens", np.int64)
    finish = cat("finish", np.int8)
    empty = cat("empty", bool)
    think = cat("think", np.int8)
    n = int(output_len.size)

    thresholds = Thresholds(float(empty_threshold), float(truncated_threshold), float(repetition_threshold))
    mask_rows = sum(p.mask_rows_checked for p in results)
    mismatches = sum(p.mask_mismatches for p in results)
    mask = MaskCheck(mode, sum(1 for p in results if p.mask_rows_checked), mask_rows, mismatches)

    kept = np.clip(train_max_length - prompt_len, 0, output_len)
    total_sup = int(output_len.sum())
    kept_sum = int(kept.sum())
    samples_cut = int(np.count_nonzero(prompt_len + output_len > train_max_length))
    unsupervised = int(np.count_nonzero(prompt_len >= train_max_length))
    cut = CutStats(train_max_length, total_sup, kept_sum, total_sup - kept_sum,
                   (total_sup - kept_sum) / total_sup if total_sup else 0.0,
                   samples_cut, samples_cut / n if n else 0.0, unsupervised, unsupervised / n if n else 0.0)

    sources, source_codes = _merge_codes(results, "source")
    worker_names, worker_codes = _merge_codes(results, "worker")
    shard_ids = sorted({s for _, s, _ in listing.parts} | set(listing.shards))
    shard_index = {s: i for i, s in enumerate(shard_ids)}
    shard_codes = (np.concatenate([np.full(p.rows, shard_index[p.shard_id], dtype=np.int32) for p in results])
                   if results else np.zeros(0, dtype=np.int32))
    by_source = _groups(sources, source_codes, empty, finish, output_len, thresholds)
    by_worker = _groups(worker_names, worker_codes, empty, finish, output_len, thresholds)
    shard_groups = {g.name: g for g in _groups(shard_ids, shard_codes, empty, finish, output_len, thresholds)}
    parts_per_shard: dict[str, int] = {}
    for p in results:
        parts_per_shard[p.shard_id] = parts_per_shard.get(p.shard_id, 0) + 1
    by_shard = []
    for sid in shard_ids:
        g = shard_groups.get(sid) or GroupStats(sid, 0, _count(0, 0), _count(0, 0), _count(0, 0), None, 0)
        total, paused = listing.shards.get(sid, (None, None))
        by_shard.append(ShardStats(g.name, g.samples, g.empty, g.truncated, g.aborted, g.mean_output, g.output_tokens,
                                   g.flagged, repetition=g.repetition, parts=parts_per_shard.get(sid, 0), total_conversations=total,
                                   paused=paused))

    stats = RunStats(
        run_dir=str(run_dir), generated_at=time.time(), elapsed_s=0.0,
        parts=PartsRead(listing.listed_from, len(listing.parts), len(results), n, listing.uncommitted, missing),
        notes=list(listing.notes), thresholds=thresholds, samples=n,
        empty=_count(int(empty.sum()), n),
        truncated=_count(int(np.count_nonzero(finish == FINISH_LENGTH)), n),
        aborted=_count(int(np.count_nonzero(finish == FINISH_ABORT)), n),
        repetition=_count(int(np.count_nonzero(finish == FINISH_REPETITION)), n),
        reasoning={name: _count(int(np.count_nonzero(think == code)), n) for code, name in enumerate(THINK_NAMES)},
        loss_mask=LossMaskStats(distribution(output_len), log2_histogram(output_len),
                                "output_len, checked against loss_mask (see mask_check)"),
        lengths={"output": distribution(output_len), "reasoning": distribution(reasoning), "prompt": distribution(prompt_len)},
        cut=cut, by_source=by_source, by_worker=by_worker, by_shard=by_shard, mask_check=mask,
        integrity_errors=errors[:MAX_ERROR_EXAMPLES], integrity_error_count=len(errors), flags=[],
        not_generated=dict(listing.not_generated))
    if mode == "sample":
        stats.notes.append(sampled_mask_note(mask.parts_checked, len(listing.parts), mask_rows))
    stats.flags = _flags(stats)
    stats.elapsed_s = time.perf_counter() - started
    return stats

def _flags(s: RunStats) -> list[Flag]:
    flags: list[Flag] = []
    t = s.thresholds
    if s.empty.share > t.empty_share:
        flags.append(Flag("empty_share", Severity.ERROR,
                          f"{s.empty.count} of {s.samples} samples ({s.empty.share:.1%}) are empty answers "
                          f"(only the template boilerplate); threshold {t.empty_share:.1%}",
                          s.empty.share, t.empty_share))
    if s.truncated.share > t.truncated_share:
        flags.append(Flag("truncated_share", Severity.WARNING,
                          f"{s.truncated.count} of {s.samples} samples ({s.truncated.share:.1%}) hit max_new_tokens "
                          f"(finish_reason=length); threshold {t.truncated_share:.1%}",
                          s.truncated.share, t.truncated_share))
    if t.repetition_share is not None and s.repetition.share > t.repetition_share:
        flags.append(Flag("repetition_share", Severity.WARNING,
                          f"{s.repetition.count} of {s.samples} samples ({s.repetition.share:.1%}) were stopped as "
                          f"runaway repetition (finish_reason=repetition); threshold {t.repetition_share:.1%}",
                          s.repetition.share, t.repetition_share))
    for kind, groups in (("worker", s.by_worker), ("source", s.by_source)):
        if len(groups) < 2 or s.empty.share > t.empty_share:
            continue  # the run-wide flag already says it; a group is flagged when it stands out
        for g in groups:
            if "empty" in g.flagged:
                flags.append(Flag(f"{kind}:{g.name}:empty_share", Severity.WARNING,
                                  f"{kind} {g.name}: {g.empty.count} of {g.samples} samples ({g.empty.share:.1%}) "
                                  "are empty answers", g.empty.share, t.empty_share))
    if s.integrity_error_count or s.mask_check.mismatches:
        kinds = sorted({e.kind for e in s.integrity_errors})
        flags.append(Flag("integrity", Severity.ERROR,
                          f"{s.integrity_error_count} integrity error(s) ({', '.join(kinds)}); "
                          f"{s.mask_check.mismatches} sample(s) whose loss_mask disagrees with prompt_len/output_len",
                          float(s.integrity_error_count), None))
    return flags


STATS_ALERT_PREFIX = "stats."


def stats_alerts(stats: RunStats, raised: Iterable[str] = ()) -> list[AlertEvent]:
    """The quality flags as telemetry alerts: each flag a condition raised under a stable key (`stats.<flag key>`:
    telemetry's record of raised alerts says it once, engine.store.alert_record), and, for each key of `raised` (the alerts
    raised now) of a flag these stats no longer have, its `cleared` alert."""
    alerts = []
    for f in stats.flags:
        evidence: dict[str, Any] = {"value": f.value, "threshold": f.threshold, "samples": stats.samples, "run_dir": stats.run_dir}
        if f.key == "integrity":
            evidence["errors"] = [asdict(e) for e in stats.integrity_errors[:5]]
        alerts.append(AlertEvent(severity=Severity(f.severity), text=f.text, evidence=json.dumps(evidence),
                                 key=f"{STATS_ALERT_PREFIX}{f.key}", kind=AlertKind.RAISED))
    flagged = {a.key for a in alerts}
    for key in raised:
        if key.startswith(STATS_ALERT_PREFIX) and key not in flagged:
            alerts.append(AlertEvent(severity=Severity.INFO, key=key, kind=AlertKind.CLEARED,
                                     text=f"cleared: {key[len(STATS_ALERT_PREFIX):]}: not flagged by the stats of "
                                          f"{stats.samples} samples",
                                     evidence=json.dumps({"samples": stats.samples, "run_dir": stats.run_dir})))
    return alerts


# --- command line (host side) ----------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.store.stats", description="shard statistics of a run dir (JSON)")
    parser.add_argument("run_dir")
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format; kept for symmetry)")
    parser.add_argument("--train-max-length", type=int, default=DEFAULT_TRAIN_MAX_LENGTH)
    parser.add_argument("--empty-threshold", type=float, default=DEFAULT_EMPTY_THRESHOLD)
    parser.add_argument("--truncated-threshold", type=float, default=DEFAULT_TRUNCATED_THRESHOLD)
    parser.add_argument("--repetition-threshold", type=float, default=DEFAULT_REPETITION_THRESHOLD)
    parser.add_argument("--mask-check", choices=("auto", "full", "sample", "off"), default="auto")
    args = parser.parse_args(argv)
    try:
        stats = compute_stats(Path(args.run_dir), train_max_length=args.train_max_length,
                              empty_threshold=args.empty_threshold, truncated_threshold=args.truncated_threshold,
                              repetition_threshold=args.repetition_threshold, mask_check=args.mask_check)
    except StatsReadError as exc:
        print(json.dumps({"schema": STATS_SCHEMA, "error": str(exc), "run_dir": args.run_dir}))
        print(f"regen stats: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(stats.to_dict()))
    return 1 if stats.quality_flagged else 0


if __name__ == "__main__":
    sys.exit(main())