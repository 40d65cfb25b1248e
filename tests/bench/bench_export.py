"""Benchmark: `regen export` (engine.export.run.export_run) to tokens-jsonl and hf, against a naive export
(per part: pq.read_table(...).to_pylist(), then json.dumps per row / pa.Table.from_pylist for Parquet), in the
same run, each in its own process so its peak RSS is its own.

Run: .venv/bin/python -m tests.bench.bench_export [--samples N] [--parts P] [--keep DIR]

Data: tests/bench/bench_stats.make_part (prompt ~200 tokens, output lognormal mean ~1500, 5% empty, 4%
truncated at 32768, 2% without reasoning), origins "<file>:<line>" in a shuffled commit order, parts
registered in a state.sqlite with the store's schema, a run.toml (its prompt files and model absent: the
token formats need neither). Both exports write every row (the naive one applies no filter) and are
timed end to end, reading included; samples/s is committed samples read per second.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from engine.config.load import RunConfig, dump_toml
from engine.store.shard_schema import PART_COMPRESSION, SHARD_SCHEMA
from engine.store.state_db import SCHEMA_SQL
from tests.bench.bench_common import REPO, write_result
from tests.bench.bench_stats import _texts, make_part

PARTS_PER_SHARD = 2  # 1,000 samples a shard: the default shard_size of single-turn conversations
FORMATS = ("tokens-jsonl", "hf")


def write_run(run_dir: Path, samples: int, parts: int) -> float:
    rng = np.random.default_rng(4321)
    texts, kinds = _texts(rng)
    block = rng.integers(0, 151_000, 1 << 16, dtype=np.int32)
    run_dir.mkdir(parents=True)
    (run_dir / "run.toml").write_text(dump_toml(RunConfig(run_dir=str(run_dir), model=str(run_dir / "no-model"),
                                                          prompts=(str(run_dir / "no-prompts.jsonl"),))))
    db = sqlite3.connect(run_dir / "state.sqlite")
    db.executescript(SCHEMA_SQL)
    per = samples // parts
    started = time.perf_counter()
    written = 0
    for p in range(parts):
        n = per if p < parts - 1 else samples - per * (parts - 1)
        shard = f"s{p // PARTS_PER_SHARD:05d}"
        table = make_part(rng, n, written, texts, kinds, block)
        origin = pa.array([f"prompts.jsonl:{written + i + 1}" for i in range(n)])
        table = table.set_column(SHARD_SCHEMA.get_field_index("origin"), SHARD_SCHEMA.field("origin"), origin)
        table = table.take(rng.permutation(n))  # commit order is not input order
        rel = f"shards/{shard}/part-{p % PARTS_PER_SHARD:06d}.parquet"
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, run_dir / rel, compression=PART_COMPRESSION)
        db.execute("INSERT OR IGNORE INTO shards(shard_id, total) VALUES(?, ?)", (shard, per * PARTS_PER_SHARD))
        db.execute("INSERT INTO parts(path, shard_id, rows, committed_at, seq, bytes) VALUES(?,?,?,?,?,?)",
                   (rel, shard, n, time.time(), p % PARTS_PER_SHARD, (run_dir / rel).stat().st_size))
        written += n
    db.commit()
    db.close()
    return time.perf_counter() - started


def one(mode: str, fmt: str, run_dir: Path, out: Path) -> dict:
    """One export in this process: {"seconds", "samples", "rows", "peak_rss_mb"}."""
    t = time.perf_counter()
    if mode == "regen":
        from engine.export.options import ExportOptions
        from engine.export.run import export_run

        # every row written, like the naive export (the filters' cost is the vectorized masks only)
        opts = ExportOptions(run_dir=run_dir, fmt=fmt, out=out, keep=("aborted", "length", "empty", "thinking"),
                             min_supervised=0)
        res = export_run(opts)
        samples, rows = res.samples, res.kept
    else:
        samples, rows = naive(fmt, run_dir, out)
    seconds = time.perf_counter() - t
    usage = resource.getrusage(resource.RUSAGE_SELF)
    # CPU seconds too: on a shared box the wall clock counts other processes' turns
    return {"seconds": seconds, "cpu_s": usage.ru_utime + usage.ru_stime, "samples": samples, "rows": rows,
            "peak_rss_mb": usage.ru_maxrss / 1024}


def naive(fmt: str, run_dir: Path, out: Path) -> tuple[int, int]:
    """What glue code does: every part to Python rows, then one json.dumps per row (or from_pylist per part)."""
    out.mkdir(parents=True)
    db = sqlite3.connect(run_dir / "state.sqlite")
    paths = [r[0] for r in db.execute("SELECT path FROM parts ORDER BY shard_id, path")]
    db.close()
    n = 0
    if fmt == "tokens-jsonl":
        with open(out / "tokens.jsonl", "w") as f:
            for rel in paths:
                for r in pq.read_table(run_dir / rel).to_pylist():
                    f.write(json.dumps({"id": r["sample_id"], "primary_id": r["conversation_id"],
                                        "input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}) + "\n")
                    n += 1
    else:
        for i, rel in enumerate(paths):
            rows = pq.read_table(run_dir / rel).to_pylist()
            table = pa.Table.from_pylist([{"id": r["sample_id"], "input_ids": r["input_ids"], "loss_mask": r["loss_mask"],
                                           "labels": [-100 if m == 0 else t for t, m in zip(r["input_ids"], r["loss_mask"])]}
                                          for r in rows])
            pq.write_table(table, out / f"train-{i:05d}.parquet", compression="zstd")
            n += len(rows)
    return n, n


def _child(mode: str, fmt: str, run_dir: Path, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.bench.bench_export", "--one", mode, "--format", fmt,
                           "--run-dir", str(run_dir), "--out", str(out)], cwd=str(REPO), capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} {fmt} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(samples: int, parts: int, keep: str | None = None) -> dict:
    base = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="regen-bench-export-"))
    run_dir = base / "run"
    try:
        gen_s = None
        if not (run_dir / "state.sqlite").exists():
            gen_s = write_run(run_dir, samples, parts)
        tokens = sum(pq.ParquetFile(p).metadata.num_rows for p in run_dir.rglob("*.parquet"))
        result: dict = {"samples": samples, "parts": parts, "generated_s": gen_s, "committed_rows": tokens,
                        "parquet_bytes": sum(p.stat().st_size for p in run_dir.rglob("*.parquet")), "formats": {}}
        for fmt in FORMATS:
            entry = {}
            for mode in ("regen", "naive"):
                out = base / f"out-{mode}-{fmt}"
                shutil.rmtree(out, ignore_errors=True)
                r = _child(mode, fmt, run_dir, out)
                r["samples_per_s"] = r["samples"] / r["seconds"]
                r["out_bytes"] = sum(p.stat().st_size for p in out.iterdir())
                entry[mode] = r
                shutil.rmtree(out, ignore_errors=True)
            entry["speedup"] = entry["naive"]["seconds"] / entry["regen"]["seconds"]
            entry["speedup_cpu"] = entry["naive"]["cpu_s"] / entry["regen"]["cpu_s"]
            result["formats"][fmt] = entry
        result["machine"] = {"cpus": os.cpu_count(), "load_avg_1_5_15": os.getloadavg()}
        return result
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--parts", type=int, default=40)
    ap.add_argument("--keep", default=None, help="generate into (or reuse) this dir and keep it")
    ap.add_argument("--one", choices=("regen", "naive"), help=argparse.SUPPRESS)
    ap.add_argument("--format", choices=FORMATS, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.format, Path(args.run_dir), Path(args.out))))
        return
    res = run(args.samples, args.parts, args.keep)
    path = write_result("export", res)
    print(f"{'export':<28} {'seconds':>9} {'cpu s':>8} {'samples/s':>11} {'peak RSS MB':>12}")
    for fmt, e in res["formats"].items():
        for mode in ("regen", "naive"):
            r = e[mode]
            print(f"{fmt + ' ' + mode:<28} {r['seconds']:>9.2f} {r['cpu_s']:>8.2f} {r['samples_per_s']:>11,.0f} "
                  f"{r['peak_rss_mb']:>12,.0f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
