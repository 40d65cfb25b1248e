"""Benchmark: engine.store.stats.compute_stats over 1,000,000 samples in 100 committed parts, against a
per-line json.loads loop over the same rows as JSONL computing the same figures.

Run: .venv/bin/python -m tests.bench.bench_stats [--samples N] [--parts P] [--jsonl-samples M] [--keep DIR]

Data (generated with numpy/pyarrow, written as real zstd parts with SHARD_SCHEMA and registered
in a state.sqlite with the store's schema):
  prompt_len ~ 200 tokens (lognormal, sigma 0.5, 16..4096); output_len lognormal with mean ~1500,
  capped at 32768; 5% empty answers (output_len 6), 4% truncated at the cap; text sampled from a
  few hundred distinct strings (short). input_ids and loss_mask have their true lengths (so the
  part files have the real column layout), but input_ids' values are a repeated random block so
  the 1M-sample run fits this box's disk: compute_stats never reads input_ids, so its values do
  not change its time.
The JSONL baseline holds full rows (input_ids and loss_mask as JSON lists). Writing and parsing
1M such lines (~15 GB) does not fit this box in time, so the baseline runs on the first
--jsonl-samples rows and its rows/s is extrapolated linearly to the full count (reported as such).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from engine.text.answer_shape import is_empty_answer, think_state
from engine.store.shard_schema import PART_COMPRESSION, SHARD_SCHEMA
from engine.store.state_db import SCHEMA_SQL
from engine.store.stats import compute_stats

RESULTS = Path(__file__).resolve().parent / "results" / "stats.json"
MAX_NEW = 32768
TRAIN_MAX = 4096


def _texts(rng: np.random.Generator) -> tuple[list[str], np.ndarray]:
    """~300 distinct output texts and their kind (0 normal, 1 empty, 2 unterminated, 3 missing)."""
    words = "the of a and to in is that it for on with as was by this are be at or from".split()
    texts, kinds = [], []
    for i in range(300):
        r = " ".join(rng.choice(words, size=int(rng.integers(10, 60))))
        a = " ".join(rng.choice(words, size=int(rng.integers(5, 30))))
        if i < 260:
            texts.append(f"<think>\n{r}\n</think>\n\n{a}.<|im_end|>"), kinds.append(0)
        elif i < 280:
            texts.append(f"<think>\n{r}"), kinds.append(2)
        else:
            texts.append(f"{a}.<|im_end|>"), kinds.append(3)
    texts.append("<think>\n\n</think>\n\nOK.<|im_end|>"), kinds.append(1)
    return texts, np.array(kinds)


def make_part(rng: np.random.Generator, n: int, start: int, texts: list[str], kinds: np.ndarray,
              block: np.ndarray) -> pa.Table:
    prompt = np.clip(rng.lognormal(np.log(200) - 0.125, 0.5, n), 16, 4096).astype(np.int32)
    sigma = 1.0
    output = np.minimum(rng.lognormal(np.log(1500) - sigma**2 / 2, sigma, n), MAX_NEW).astype(np.int32)
    output = np.maximum(output, 8)
    u = rng.random(n)
    empty = u < 0.05
    truncated = (u >= 0.05) & (u < 0.09)
    output[empty] = 6
    output[truncated] = MAX_NEW
    text_idx = rng.choice(np.flatnonzero(kinds == 0), n)
    text_idx[empty] = np.flatnonzero(kinds == 1)[0]
    text_idx[truncated] = rng.choice(np.flatnonzero(kinds == 2), int(truncated.sum()))
    missing = (u >= 0.09) & (u < 0.11)
    text_idx[missing] = rng.choice(np.flatnonzero(kinds == 3), int(missing.sum()))
    finish = np.where(truncated, "length", np.where(u > 0.995, "abort", "stop"))
    lengths = (prompt + output).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(offsets[-1])
    ids = np.resize(block, total)
    mask = np.repeat(np.tile(np.array([0, 1], dtype=np.uint8), n), np.column_stack([prompt, output]).ravel())
    sample = [f"conv{start + i:08d}#turn0" for i in range(n)]
    conv = [s[:-6] for s in sample]
    src = np.array(["nemotron.jsonl", "codealpaca.jsonl", "sharegpt.jsonl"])[rng.integers(0, 3, n)]
    worker = np.array([f"gpu{g}" for g in range(8)])[rng.integers(0, 8, n)]
    text_arr = pa.array(texts).take(pa.array(text_idx))
    cols = {
        "sample_id": pa.array(sample), "conversation_id": pa.array(conv), "turn": pa.array(np.zeros(n, np.int32)),
        "source": pa.array(src), "origin": pa.array(src), "input_ids": pa.ListArray.from_arrays(offsets, pa.array(ids)),
        "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(mask)), "prompt_len": pa.array(prompt),
        "output_len": pa.array(output), "reasoning_tokens": pa.array((output * 0.8).astype(np.int32)),
        "prompt_opened": pa.array(np.zeros(n, dtype=bool)),
        "finish_reason": pa.array(finish), "completion_tokens": pa.array(output), "cached_tokens": pa.array(np.zeros(n, np.int32)),
        "latency_s": pa.array(rng.random(n) * 100), "worker": pa.array(worker), "text": text_arr,
    }
    return pa.Table.from_arrays([cols[f.name].cast(f.type) for f in SHARD_SCHEMA], schema=SHARD_SCHEMA)


def write_run(run_dir: Path, samples: int, parts: int, jsonl: Path, jsonl_samples: int) -> float:
    rng = np.random.default_rng(1234)
    texts, kinds = _texts(rng)
    block = rng.integers(0, 151_000, 1 << 16, dtype=np.int32)
    db = sqlite3.connect(run_dir / "state.sqlite")
    db.executescript(SCHEMA_SQL)
    per = samples // parts
    started = time.perf_counter()
    written = 0
    with open(jsonl, "w") as jf:
        for p in range(parts):
            n = per if p < parts - 1 else samples - per * (parts - 1)
            shard = f"s{p // 10:05d}"
            table = make_part(rng, n, written, texts, kinds, block)
            rel = f"shards/{shard}/part-{p % 10:06d}.parquet"
            (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, run_dir / rel, compression=PART_COMPRESSION)
            db.execute("INSERT OR IGNORE INTO shards(shard_id, total) VALUES(?, ?)", (shard, per * 10))
            db.execute("INSERT INTO parts(path, shard_id, rows, committed_at, seq, bytes) VALUES(?,?,?,?,?,?)",
                       (rel, shard, n, time.time(), p % 10, (run_dir / rel).stat().st_size))
            if written < jsonl_samples:
                for row in table.slice(0, jsonl_samples - written).to_pylist():
                    jf.write(json.dumps(row) + "\n")
            written += n
    db.commit()
    db.close()
    return time.perf_counter() - started


def jsonl_baseline(path: Path, train_max: int) -> dict:
    """The same figures from full JSON rows, one json.loads per line (how a JSONL pipeline does it)."""
    out_lens, prompt_lens, reasoning, kept = [], [], [], 0
    empty = truncated = aborted = mismatches = 0
    think = {"present": 0, "missing": 0, "unterminated": 0}
    by_source: dict[str, list[int]] = {}
    by_worker: dict[str, list[int]] = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            mask = r["loss_mask"]
            s = sum(mask)
            if s != r["output_len"]:
                mismatches += 1
            kept += sum(mask[:train_max])
            out_lens.append(s)
            prompt_lens.append(r["prompt_len"])
            reasoning.append(r["reasoning_tokens"])
            e = is_empty_answer(r["text"])
            empty += e
            truncated += r["finish_reason"] == "length"
            aborted += r["finish_reason"] == "abort"
            think[think_state(r["text"])] += 1
            for key, groups in ((r["source"], by_source), (r["worker"], by_worker)):
                g = groups.setdefault(key, [0, 0, 0, 0])
                g[0] += 1
                g[1] += e
                g[2] += r["finish_reason"] == "length"
                g[3] += s
    figures = {}
    for name, values in (("output", out_lens), ("prompt", prompt_lens), ("reasoning", reasoning)):
        qs = statistics.quantiles(values, n=100, method="inclusive")
        figures[name] = (statistics.fmean(values), qs[49], qs[89], qs[98], max(values))
    return {"samples": len(out_lens), "empty": empty, "truncated": truncated, "aborted": aborted, "kept": kept,
            "think": think, "mismatches": mismatches, "figures": figures}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--parts", type=int, default=100)
    ap.add_argument("--jsonl-samples", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", default=None, help="generate into (or reuse) this dir and keep it")
    args = ap.parse_args()
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="regen-bench-stats-"))
    run_dir, jsonl = base / "run", base / "rows.jsonl"
    try:
        if not (run_dir / "state.sqlite").exists():
            run_dir.mkdir(parents=True, exist_ok=True)
            gen_s = write_run(run_dir, args.samples, args.parts, jsonl, args.jsonl_samples)
            print(f"generated {args.samples:,} samples in {args.parts} parts in {gen_s:.1f} s")
        disk = sum(p.stat().st_size for p in run_dir.rglob("*.parquet"))
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            stats = compute_stats(run_dir, train_max_length=TRAIN_MAX)
            times.append(time.perf_counter() - t)
        full = time.perf_counter()
        stats_full = compute_stats(run_dir, train_max_length=TRAIN_MAX, mask_check="full")
        full_s = time.perf_counter() - full
        t = time.perf_counter()
        base_fig = jsonl_baseline(jsonl, TRAIN_MAX)
        jsonl_s = time.perf_counter() - t
        # the same figures on the same rows, from the vectorized path
        assert stats.samples == args.samples and stats_full.mask_check.mismatches == 0
        n_j = base_fig["samples"]
        if n_j == args.samples:  # both paths over the same rows: the figures must agree
            assert (base_fig["empty"], base_fig["truncated"], base_fig["aborted"], base_fig["kept"]) == (
                stats.empty.count, stats.truncated.count, stats.aborted.count, stats.cut.supervised_tokens_kept)
            assert base_fig["think"] == {k: c.count for k, c in stats.reasoning.items()}
            for name, (mean, p50, p90, p99, mx) in base_fig["figures"].items():
                d = stats.lengths[name]
                got, want = (d.mean, d.p50, d.p90, d.p99, d.max), (mean, p50, p90, p99, mx)
                assert all(abs(a - b) <= 1e-9 * max(1.0, abs(b)) for a, b in zip(got, want)), (name, got, want)
        median = statistics.median(times)
        jsonl_rate = n_j / jsonl_s
        result = {
            "samples": args.samples, "parts": args.parts, "parquet_bytes": disk,
            "compute_stats_s": {"runs": times, "median": median, "rows_per_s": args.samples / median,
                                "mask_check": stats.mask_check.mode, "mask_rows_checked": stats.mask_check.rows_checked},
            "compute_stats_full_mask_check_s": {"seconds": full_s, "rows_per_s": args.samples / full_s},
            "jsonl_loop": {"samples_measured": n_j, "seconds": jsonl_s, "rows_per_s": jsonl_rate,
                           "extrapolated_s_for_all": args.samples / jsonl_rate,
                           "note": "full rows (input_ids + loss_mask JSON lists) on a subset; extrapolated linearly"},
            "speedup_vs_jsonl": (args.samples / jsonl_rate) / median,
            "speedup_full_mask_check_vs_jsonl": (args.samples / jsonl_rate) / full_s,
            "figures": {"empty_share": stats.empty.share, "truncated_share": stats.truncated.share,
                        "output_mean": stats.lengths["output"].mean, "output_p99": stats.lengths["output"].p99,
                        "cut_share": stats.cut.cut_share},
            "machine": {"cpus": os.cpu_count(), "load_avg_1_5_15": os.getloadavg()},
        }
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
        print(f"{'path':<38} {'seconds':>10} {'rows/s':>12} {'ratio':>8}")
        print(f"{'compute_stats (median of %d, mask %s)' % (args.repeats, stats.mask_check.mode):<38} "
              f"{median:>10.2f} {args.samples / median:>12,.0f} {result['speedup_vs_jsonl']:>7.1f}x")
        print(f"{'compute_stats (mask check full)':<38} {full_s:>10.2f} {args.samples / full_s:>12,.0f} "
              f"{result['speedup_full_mask_check_vs_jsonl']:>7.1f}x")
        print(f"{'jsonl loop (extrapolated from %d)' % n_j:<38} {args.samples / jsonl_rate:>10.2f} {jsonl_rate:>12,.0f} "
              f"{1.0:>7.1f}x")
        print(f"wrote {RESULTS}")
    finally:
        if not args.keep:
            shutil.rmtree(base)


if __name__ == "__main__":
    main()
