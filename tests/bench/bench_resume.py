"""Resume: supervisor start -> first dispatch on a run with 1,000,000 committed samples, and its peak RSS.

    .venv/bin/python -m tests.bench.bench_resume [--conversations 1000000] [--repeats 3]

The run dir (built once, copied for each repeat): a 1,000,000-row JSONL prompt file, turns = "all",
shard_size 1000 (1000 shards). Rows 0..998,999 are single-turn, the last 1,000 are two-turn; every
turn-0 sample is committed (999,000 + 1,000 = 1,000,000 samples, answers of the two-turn ones kept
for chaining), so the only work left is the 1,000 turn-1 samples at the very END of the file: the
worst case for time to first dispatch (the feed must skip every committed conversation first).

Shortcut (documented): the committed samples are written with the ShardStore API itself
(ensure_shards + commit), one part of 1,000 small samples per shard (a 6-token prompt, 4-token answer),
instead of being generated: the store, the parts and the sqlite rows are the real ones, only the
token ids are made up. Generating them would take hours; resume cost depends on the number of
committed samples and prompt rows, not on the answers' lengths.

The run dir has been started once before, as any resumed run has: its count cache
(run_dir/count_cache.json, engine.store.count_cache) is written by the product's own counting pass
(PromptCount.count_stream + finish_count) when the run dir is built; that pass's time is reported
as `count_pass_uncached_s` (what a start after the prompt files changed pays).

Measured per repeat, on a copy of the run dir: the real supervisor pinned to the engine core,
launching one simulator (own process, other core). Times from the bench's clock just before
spawning the supervisor to: the supervisor's "plan: ..." line (counting pass done), its worker
"-> ready" line, and the first admission in the simulator's log (millisecond stamps: sim_ms.py):
the first dispatch. Resume = first dispatch - spawn; also without the simulator's own startup
(launch -> ready, which a real SGLang server spends loading weights, not regen). Peak RSS of the
supervisor process (psutil, every 50 ms) over the whole run, which then generates the 1,000 samples
(the run must end with 1,001,000 committed).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from engine.config.load import Sampling
from engine.store.run_dir import prepare_run_dir
from engine.store.names import shard_id_for
from engine.store.shard_store import ShardStore
from tests.bench import bench_common as bc

TARGET_RESUME_S = 3.0
TARGET_RSS_MB = 500.0
SHARD_SIZE = 1000
TWO_TURN = 1000
PART_ROWS = 10_000  # rows generated per loop step; committed one shard (SHARD_SIZE rows) per part
SIM_ARGS = ["--max-running-requests", "64", "--sim-output-mean", "32", "--sim-output-sigma", "0.3",
            "--sim-step-ms", "2", "--sim-step-ms-per-req", "0", "--sim-tokens-per-step", "8",
            "--log-level-http", "warning"]


def write_prompts(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            cid = f"c{i:07d}"
            if i >= n - TWO_TURN:
                msgs = [{"role": "user", "content": f"first question {i}"},
                        {"role": "assistant", "content": "an old answer"},
                        {"role": "user", "content": f"second question {i}"}]
            else:
                msgs = [{"role": "user", "content": f"question number {i}"}]
            f.write(json.dumps({"id": cid, "messages": msgs}, separators=(",", ":")) + "\n")


def _row(i: int, prompts_path: str) -> dict:
    cid = f"c{i:07d}"
    return {"sample_id": f"{cid}#turn0", "conversation_id": cid, "turn": 0, "source": prompts_path,
            "origin": f"{prompts_path}:{i + 1}", "input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
            "loss_mask": [0, 0, 0, 0, 0, 0, 1, 1, 1, 1], "prompt_len": 6, "output_len": 4, "reasoning_tokens": 2, "prompt_opened": False,
            "finish_reason": "stop", "completion_tokens": 4, "cached_tokens": 0, "latency_s": 1.0,
            "worker": "gpu0", "text": "<think>\nx\n</think>\n\nA.<|im_end|>"}


def build_run(base: Path, n: int, model: Path) -> tuple[Path, float]:
    t0 = time.perf_counter()
    prompts = base / "prompts.jsonl"
    write_prompts(prompts, n)
    cfg = bc.sim_config(model, [prompts], base / "run", gpus=1, sim_args=SIM_ARGS, turns="all",
                        shard_size=SHARD_SIZE, sampling=Sampling(max_new_tokens=256))
    prepare_run_dir(cfg)
    bc.write_run_config(cfg)
    store = ShardStore(base / "run")
    totals: dict[str, int] = {}
    samples: dict[str, int] = {}
    for i in range(n):
        sid = shard_id_for(i, SHARD_SIZE)
        totals[sid] = totals.get(sid, 0) + 1
        samples[sid] = samples.get(sid, 0) + (2 if i >= n - TWO_TURN else 1)
    store.ensure_shards(totals, samples)
    for start in range(0, n, PART_ROWS):  # PART_ROWS is a multiple of SHARD_SIZE: one shard per commit
        for shard_start in range(start, min(n, start + PART_ROWS), SHARD_SIZE):
            end = min(n, shard_start + SHARD_SIZE)
            rows = [_row(i, str(prompts)) for i in range(shard_start, end)]
            history = {r["sample_id"]: "an earlier regenerated answer" for i, r in zip(range(shard_start, end), rows)
                       if i >= n - TWO_TURN}
            store.commit(shard_id_for(shard_start, SHARD_SIZE), rows, history)
    count = sum(p.done_samples for p in store.progress())
    store.close()
    if count != n:
        raise RuntimeError(f"built {count} committed samples, expected {n}")
    return base / "run", time.perf_counter() - t0


def prime_count_cache(run_dir: Path) -> float:
    """The counting pass of the product (as the supervisor runs it at a start): writes count_cache.json."""
    from engine.config.load import load_config
    from engine.store.rejects import RejectLog
    from engine.text.render import Renderer
    from engine.run.prompt_count import PromptCount

    cfg = load_config(run_dir / "run.toml").model_copy(update=dict(run_dir=str(run_dir)))
    renderer = Renderer(cfg.tokenizer_path, enable_thinking=cfg.enable_thinking, context_length=cfg.context_length)
    store = ShardStore(run_dir)
    rejects = RejectLog(run_dir)
    try:
        prompts = PromptCount(cfg, renderer, rejects)
        t0 = time.perf_counter()
        bad = prompts.count_stream()
        prompts.finish_count(bad)
        took = time.perf_counter() - t0
    finally:
        rejects.close()
        store.close()
    if not (run_dir / "count_cache.json").exists():
        raise RuntimeError(f"the counting pass wrote no count cache in {run_dir}")
    return took


def one_resume(template: Path, work: Path, n: int) -> dict:
    run_dir = work / "run"
    shutil.copytree(template, run_dir)
    from engine.config.load import load_config

    cfg = load_config(run_dir / "run.toml")
    cfg = cfg.model_copy(update=dict(run_dir=str(run_dir)))
    res = bc.run_supervisor(cfg, timeout=600)
    if res.exit_code != 0:
        tail = "\n".join(line for _, line in res.lines[-30:])
        raise RuntimeError(f"supervisor exited {res.exit_code}; {run_dir}/supervisor.log:\n{tail}")
    db = sqlite3.connect(run_dir / "state.sqlite")
    done = db.execute("SELECT count(*) FROM samples").fetchone()[0]
    db.close()
    if done != n + TWO_TURN:
        raise RuntimeError(f"after the resumed run {done} samples are committed, expected {n + TWO_TURN}")
    plan_t = bc.first_line_time(res.lines, "regen.supervisor: plan:")
    launch_t = bc.first_line_time(res.lines, ": launched pid")
    ready_t = bc.first_line_time(res.lines, "-> ready")
    sim_log = run_dir / "workers" / "gpu0" / "server.log"
    lines = bc.sim_lines(sim_log)
    ready_idx = next(i for i, (_, line) in enumerate(lines) if "fired up and ready" in line)
    first_dispatch = next(t for t, line in lines[ready_idx + 1:] if "Prefill batch" in line)
    resume = first_dispatch - res.started_at
    server_startup = ready_t - launch_t
    return {"resume_s": resume, "resume_without_server_startup_s": resume - server_startup,
            "count_pass_s": plan_t - res.started_at, "server_startup_s": server_startup,
            "ready_to_first_dispatch_s": first_dispatch - ready_t,
            "peak_rss_mb": res.peak_rss_bytes / 2**20, "committed_after": done, "supervisor_wall_s": res.wall_s}


def run(n: int, repeats: int, keep: Path | None = None) -> dict:
    model = bc.tiny_model()
    base = keep or Path(tempfile.mkdtemp(prefix="regen-bench-resume-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        template = base / "run"
        if not (template / "state.sqlite").exists():
            template, build_s = build_run(base, n, model)
            print(f"  built the run dir: {n:,} committed samples, {n:,} prompt rows in {build_s:.1f} s", flush=True)
        cached = template / "count_cache.json"
        count_s = None
        if not cached.exists():
            count_s = prime_count_cache(template)
            (base / "count_pass_s.json").write_text(json.dumps({"count_pass_uncached_s": count_s}))
            print(f"  counting pass (writes the count cache): {count_s:.1f} s", flush=True)
        elif (base / "count_pass_s.json").exists():
            count_s = json.loads((base / "count_pass_s.json").read_text())["count_pass_uncached_s"]
        runs = []
        for r in range(repeats):
            work = base / f"r{r}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            runs.append(one_resume(template, work, n))
            print(f"  resume run {r + 1}/{repeats}: first dispatch after {runs[-1]['resume_s']:.2f} s "
                  f"({runs[-1]['resume_without_server_startup_s']:.2f} s without the server's startup), "
                  f"peak RSS {runs[-1]['peak_rss_mb']:.0f} MB", flush=True)
            shutil.rmtree(work, ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    med = {k: bc.median([r[k] for r in runs]) for k in runs[0] if k != "committed_after"}
    return {"benchmark": "resume", "committed_samples": n, "prompt_rows": n, "shards": -(-n // SHARD_SIZE),
            "repeats": repeats, "median": med, "runs": runs, "count_pass_uncached_s": count_s,
            "targets": {"resume_s": TARGET_RESUME_S, "peak_rss_mb": TARGET_RSS_MB},
            "met": med["resume_s"] <= TARGET_RESUME_S and med["peak_rss_mb"] <= TARGET_RSS_MB,
            "machine": bc.machine()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", type=Path, default=None, help="build into (or reuse) this dir and keep it")
    args = ap.parse_args(argv)
    res = run(args.conversations, args.repeats, args.keep)
    out = bc.write_result("resume", res)
    m = res["median"]
    print(f"resume {m['resume_s']:.2f} s ({m['resume_without_server_startup_s']:.2f} s without the server's "
          f"startup), peak RSS {m['peak_rss_mb']:.0f} MB; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
