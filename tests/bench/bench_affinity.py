"""Prefix affinity: prompt tokens served from the servers' radix caches, with dispatch.affinity vs without it.

    .venv/bin/python -m tests.bench.bench_affinity [--conversations 160] [--gpus 4] [--repeats 3] [--no-router]

Data: multi-turn conversations (3-6 user turns, turns = "all": each turn regenerated on the model's own
previous answers), each opening with one of a few long system prompts (~1,000 tokens). Simulators (continuous
batching, a radix cache per server as SGLang's: engine/simulator/prefix_cache.py; prefill time per uncached
token: --sim-prefill-ms-per-1k), the real supervisor.

Cases, all in one run: `affinity` (dispatch.affinity = true, the default), `baseline` (false: a free slot takes the
oldest item, the dispatch before this feature), and, unless --no-router, the same servers behind SGLang's own
router (sglang-router, one local [[hosts]] entry) with policy cache_aware and round_robin: what a multi-host run
gets.

Figures, from the committed shards: cached = the rows' cached_tokens (meta_info.cached_tokens); reusable = what
one cache seeing every request could serve: for turn k > 0 the longest common prefix with turn k-1's prompt and
answer (capped at prompt_len - 1, as SGLang computes at least one token), for a first turn the part of its system
prompt seen in an earlier first turn. Target: cached >= 80% of reusable with affinity. Simulated prefill time =
uncached prompt tokens x the simulators' prefill cost. Also: the share of later turns served by the worker of the
turn before, and the samples per worker (balance), and the wall time of each run.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

from engine.config.load import Dispatch, Host, Router, Sampling
from tests.bench import bench_common as bc

TARGET_CACHED_SHARE = 0.80
PREFILL_MS_PER_1K = 40.0
MAX_NEW = 256
SYSTEMS = 6
WORDS = ("model answer question reason step value number list function code python proof table graph "
         "vector matrix theorem lemma data set train loss batch token cache prefix server worker shard").split()


def sim_args() -> list[str]:
    return ["--max-running-requests", "16", "--context-length", "16384", "--sim-output-mean", "160",
            "--sim-output-sigma", "0.5", "--sim-step-ms", "8", "--sim-step-ms-per-req", "0.1",
            "--sim-tokens-per-step", "4", "--sim-prefill-ms-per-1k", str(PREFILL_MS_PER_1K),
            "--log-level-http", "warning", "--sim-seed", "5"]


def write_conversations(path: Path, n: int, *, seed: int = 0) -> Path:
    """n conversations: a system prompt drawn from SYSTEMS long ones (~800 tokens), then 3-6 user turns (~100 words
    each)."""
    rng = random.Random(seed)
    systems = [f"system prompt {s}: " + " ".join(rng.choice(WORDS) for _ in range(400)) for s in range(SYSTEMS)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            messages = [{"role": "system", "content": rng.choice(systems)}]
            for k in range(rng.randint(3, 6)):
                text = " ".join(rng.choice(WORDS) for _ in range(100))
                messages += [{"role": "user", "content": f"({i}.{k}) {text}?"},
                             {"role": "assistant", "content": "an earlier answer, regenerated"}]
            f.write(json.dumps({"id": f"conv{i:05d}", "messages": messages[:-1]}) + "\n")
    return path


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def figures(rows: list[dict], wall_s: float) -> dict:
    by_conv: dict[str, dict[int, dict]] = collections.defaultdict(dict)
    for r in rows:
        by_conv[r["conversation_id"]][r["turn"]] = r
    prompt = cached = reusable = 0
    later = same_worker = 0
    first_seen: dict[tuple, list[int]] = {}  # the first first-turn prompt of each opening (its system prompt)
    per_worker: collections.Counter[str] = collections.Counter()
    for r in sorted(rows, key=lambda r: r["sample_id"]):
        per_worker[r["worker"]] += 1
    for conv in by_conv.values():
        turns = sorted(conv)
        for k in turns:
            r = conv[k]
            ids = r["input_ids"][:r["prompt_len"]]
            prompt += r["prompt_len"]
            cached += r["cached_tokens"]
            prev = conv.get(turns[turns.index(k) - 1]) if turns.index(k) > 0 else None
            if prev is not None:
                share = _common(ids, prev["input_ids"][:-1])
                later += 1
                same_worker += prev["worker"] == r["worker"]
            else:
                seen = first_seen.setdefault(tuple(ids[:64]), ids)
                share = _common(ids, seen) if seen is not ids else 0
            reusable += min(share, r["prompt_len"] - 1)
    counts = sorted(per_worker.values())
    return {
        "samples": len(rows), "prompt_tokens": prompt, "cached_tokens": cached, "reusable_tokens": reusable,
        "cached_of_reusable": cached / reusable if reusable else 0.0, "cached_of_prompt": cached / prompt if prompt else 0.0,
        "uncached_tokens": prompt - cached, "prefill_s": (prompt - cached) * PREFILL_MS_PER_1K / 1e6,
        "later_turns_same_worker": same_worker / later if later else None,
        "samples_per_worker": dict(sorted(per_worker.items())),
        "balance_min_over_max": counts[0] / counts[-1] if counts else None, "wall_s": wall_s,
    }


def read_rows(run_dir: Path) -> list[dict]:
    import pyarrow.parquet as pq

    from engine.store.shard_store import ShardStore

    store = ShardStore(run_dir)
    try:
        parts = store.parts()
    finally:
        store.close()
    rows: list[dict] = []
    for part in parts:
        rows += pq.read_table(run_dir / part.path, columns=["sample_id", "conversation_id", "turn", "input_ids",
                                                            "prompt_len", "cached_tokens", "worker"]).to_pylist()
    return rows


def run_case(case: str, model: Path, prompts: Path, work: Path, gpus: int) -> dict:
    run_dir = work / case
    cfg = bc.sim_config(model, [prompts], run_dir, gpus=gpus, sim_args=sim_args(), turns="all",
                        context_length=16384, sampling=Sampling(max_new_tokens=MAX_NEW),
                        dispatch=Dispatch(request_timeout_s=600.0, affinity=case != "baseline"))
    if case.startswith("router"):
        from tests.sshd_fixtures import free_port

        port, prom = free_port(), free_port()
        cfg = cfg.model_copy(update=dict(hosts=(Host(name="h0", address="local", gpus=tuple(range(gpus)),
                                                          host_python=sys.executable),),
                                         router=Router(policy=case.split("-", 1)[1], port=port, prometheus_port=prom)))
    res = bc.run_supervisor(cfg, timeout=600)
    if res.exit_code != 0:
        raise RuntimeError(f"{case}: supervisor exited {res.exit_code}; see {run_dir}/supervisor.log")
    return {"case": case, **figures(read_rows(run_dir), res.wall_s)}


def run(conversations: int, gpus: int, repeats: int, router: bool = True, keep: Path | None = None) -> dict:
    model = bc.tiny_model()
    base = keep or Path(tempfile.mkdtemp(prefix="regen-bench-affinity-"))
    prompts = write_conversations(base / "conversations.jsonl", conversations)
    cases = ["affinity", "baseline"] + (["router-cache_aware", "router-round_robin"] if router else [])
    runs: dict[str, list[dict]] = {c: [] for c in cases}
    try:
        for r in range(repeats):
            work = base / f"r{r}"
            shutil.rmtree(work, ignore_errors=True)
            for case in cases:
                runs[case].append(run_case(case, model, prompts, work, gpus))
                x = runs[case][-1]
                print(f"  affinity run {r + 1}/{repeats} {case}: cached {x['cached_of_reusable']:.1%} of reusable "
                      f"({x['cached_tokens']:,}/{x['reusable_tokens']:,}), prefill {x['prefill_s']:.1f} s, "
                      f"same worker {x['later_turns_same_worker'] or 0:.1%}, wall {x['wall_s']:.1f} s", flush=True)
            if not keep:
                shutil.rmtree(work, ignore_errors=True)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    keys = ("cached_of_reusable", "cached_of_prompt", "prefill_s", "uncached_tokens", "later_turns_same_worker",
            "balance_min_over_max", "wall_s")
    median = {c: {k: bc.median([x[k] for x in runs[c] if x[k] is not None]) for k in keys} for c in cases}
    aff, base_m = median["affinity"], median["baseline"]
    return {
        "benchmark": "affinity", "repeats": repeats, "simulators": gpus, "conversations": conversations,
        "system_prompts": SYSTEMS, "sim_args": sim_args(), "max_new_tokens": MAX_NEW, "median": median,
        "prefill_ratio": base_m["prefill_s"] / aff["prefill_s"] if aff["prefill_s"] else None,
        "target": {"cached_of_reusable": TARGET_CACHED_SHARE},
        "met": aff["cached_of_reusable"] >= TARGET_CACHED_SHARE,
        "runs": runs, "machine": bc.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=160)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-router", action="store_true", help="leave out the sglang-router cases")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run dirs here")
    args = ap.parse_args(argv)
    res = run(args.conversations, args.gpus, args.repeats, router=not args.no_router, keep=args.keep)
    out = bc.write_result("affinity", res)
    m = res["median"]
    print(f"cached of reusable prefix tokens: affinity {m['affinity']['cached_of_reusable']:.1%}, baseline "
          f"{m['baseline']['cached_of_reusable']:.1%}; simulated prefill {m['affinity']['prefill_s']:.1f} s vs "
          f"{m['baseline']['prefill_s']:.1f} s; wrote {out}")
    return 0 if res["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
