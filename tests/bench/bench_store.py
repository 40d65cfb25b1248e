"""Benchmarks of the data path (not run by pytest):

    .venv/bin/python -m tests.bench.bench_store [--parts 5] [--rows 1000] [--tokens 2048] [--prompts 100000]

commit(): rows/s for parts of `rows` samples of `tokens` tokens (prompt 25%, output 75%), in a
fresh run dir under $TMPDIR. iter_prompts(): conversations/s over a generated JSONL, JSON array and Parquet.
render: prompt_ids (chat template + tokenizer) per second with the tiny model's tokenizer.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from engine.text.ingest import Conversation, iter_prompts
from engine.store.shard_store import ShardStore


def make_rows(part: int, n: int, tokens: int, rng: random.Random) -> list[dict]:
    prompt_len = tokens // 4
    output_len = tokens - prompt_len
    rows = []
    for i in range(n):
        ids = [rng.randrange(150000) for _ in range(tokens)]
        rows.append({
            "sample_id": f"c{part}-{i}#turn0", "conversation_id": f"c{part}-{i}", "turn": 0, "source": "bench.jsonl",
            "origin": f"bench.jsonl:{part * n + i + 1}", "input_ids": ids,
            "loss_mask": [0] * prompt_len + [1] * output_len, "prompt_len": prompt_len, "output_len": output_len,
            "reasoning_tokens": output_len // 2, "prompt_opened": False, "finish_reason": "stop", "completion_tokens": output_len,
            "cached_tokens": 0, "latency_s": 12.5, "worker": "gpu0",
            "text": "<think>\n" + "reasoning words " * (output_len // 4) + "\n</think>\n\nThe answer.<|im_end|>",
        })
    return rows


def bench_commit(parts: int, rows: int, tokens: int) -> None:
    rng = random.Random(0)
    batches = [make_rows(p, rows, tokens, rng) for p in range(parts)]
    with tempfile.TemporaryDirectory() as d:
        store = ShardStore(Path(d))
        store.ensure_shards({"s00000": parts * rows})
        t0 = time.perf_counter()
        infos = [store.commit("s00000", b, {r["sample_id"]: r["text"] for r in b}) for b in batches]
        dt = time.perf_counter() - t0
        size = sum(i.bytes for i in infos)
        store.close()
    n = parts * rows
    print(f"commit: {parts} parts x {rows} rows x {tokens} tokens: {dt:.2f} s, {n / dt:.0f} rows/s, "
          f"{n * tokens / dt / 1e6:.1f} M tokens/s, {dt / parts * 1000:.0f} ms/part, {size / parts / 1e6:.1f} MB/part")


def write_prompts(d: Path, n: int) -> dict[str, Path]:
    rng = random.Random(1)
    words = "the model answer question reason step value number list function code python".split()
    rows = []
    for i in range(n):
        turns = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(20, 200)))}]
        if i % 3 == 0:
            turns += [{"role": "assistant", "content": "ok " * 50}, {"role": "user", "content": "and then?"}]
        rows.append({"id": f"row-{i}", "messages": turns} if i % 2 else
                    {"id": f"row-{i}", "conversations": [{"from": "human" if t["role"] == "user" else "gpt",
                                                          "value": t["content"]} for t in turns]})
    files = {"jsonl": d / "p.jsonl", "json": d / "p.json", "parquet": d / "p.parquet"}
    with open(files["jsonl"], "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    files["json"].write_text(json.dumps(rows, indent=1))
    pq.write_table(pa.table({"id": [r["id"] for r in rows],
                             "messages": [r.get("messages") or [{"role": "user" if t["from"] == "human" else "assistant",
                                                                 "content": t["value"]} for t in r["conversations"]]
                                          for r in rows]}), files["parquet"])
    return files


def bench_ingest(n: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        files = write_prompts(Path(d), n)
        for kind, path in files.items():
            t0 = time.perf_counter()
            good = sum(1 for x in iter_prompts([str(path)]) if isinstance(x, Conversation))
            dt = time.perf_counter() - t0
            print(f"iter_prompts {kind}: {n} rows ({path.stat().st_size / 1e6:.0f} MB): {dt:.2f} s, "
                  f"{n / dt:.0f} rows/s ({good} good)")


def bench_render(n: int) -> None:
    from engine.text.render import Renderer
    from engine.text.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as d:
        r = Renderer(str(build_tiny_model(Path(d) / "m")), enable_thinking=True)
        files = write_prompts(Path(d), n)
        convs = [c for c in iter_prompts([str(files["jsonl"])]) if isinstance(c, Conversation)]
        t0 = time.perf_counter()
        tokens = 0
        for c in convs:
            for turn in r.user_turns(c, "last"):
                tokens += len(r.prompt_ids(r.build_messages(c, turn, {}, "last")))
        dt = time.perf_counter() - t0
        print(f"render (tiny tokenizer): {n} prompts, {tokens / n:.0f} tokens avg: {dt:.2f} s, {n / dt:.0f} prompts/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", type=int, default=5)
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=100_000)
    ap.add_argument("--renders", type=int, default=5_000)
    args = ap.parse_args()
    bench_commit(args.parts, args.rows, args.tokens)
    bench_ingest(args.prompts)
    bench_render(args.renders)


if __name__ == "__main__":
    main()
