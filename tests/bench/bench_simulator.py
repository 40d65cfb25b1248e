"""Simulator benchmarks (not run by pytest): instant-mode ingest ceiling and batching throughput vs formula.

    .venv/bin/python tests/bench/bench_simulator.py [--requests 4000] [--concurrency 64]
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.simulator import SimConfig, run_simulator, throughput  # noqa: E402
from engine.simulator.simlog import SimLog  # noqa: E402
from engine.text.tiny_model import build_tiny_model  # noqa: E402


async def drive(url: str, n: int, concurrency: int, payload: dict) -> float:
    sem = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one(i: int) -> None:
            async with sem:
                async with session.post(url + "/generate", json=dict(payload, rid=f"b{i}")) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - t0


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args()
    results: dict = {"benchmark": "simulator", "cpus": os.cpu_count(), "load_avg": os.getloadavg()[0]}
    model = build_tiny_model(Path(tempfile.gettempdir()) / "regen-bench-tiny-model")
    ids = list(range(100, 1100))  # a 1000-token prompt sent as input_ids, as the dispatcher does

    quiet = SimLog("warning", "warning", err=io.StringIO(), out=io.StringIO())
    t0 = time.perf_counter()
    server = await run_simulator(SimConfig(model_path=str(model), port=0, sim_instant=True,
                                           sim_output_mean=1024, log_level="warning"), quiet)
    await server.wait_ready(60)
    results["instant_ready_s"] = time.perf_counter() - t0
    print(f"instant server ready in {results['instant_ready_s']:.2f} s (tokenizer load + pool)")
    dt = await drive(server.url, args.requests, args.concurrency,
                     {"input_ids": ids, "sampling_params": {"max_new_tokens": 32768, "skip_special_tokens": False}})
    print(f"instant: {args.requests} requests in {dt:.2f} s = {args.requests / dt:.0f} req/s "
          f"(client and server in one process, concurrency {args.concurrency})")
    results["instant"] = {"requests": args.requests, "concurrency": args.concurrency, "seconds": dt,
                          "req_per_s": args.requests / dt, "prompt_tokens": len(ids),
                          "note": "client and server share one process and event loop"}
    await server.stop()

    results["batching"] = []
    for batch in (1, 8, 32):
        log = io.StringIO()
        server = await run_simulator(SimConfig(
            model_path=str(model), port=0, max_running_requests=batch, sim_step_ms=10, sim_step_ms_per_req=0.25,
            sim_output_mean=400, sim_output_sigma=0.0, sim_prefill_ms_per_1k=0), SimLog(err=log, out=io.StringIO()))
        await server.wait_ready(60)
        await drive(server.url, batch * 3, batch * 3, {"input_ids": ids, "sampling_params": {"max_new_tokens": 4000}})
        rates = [float(m.group(1)) for m in re.finditer(
            rf"#running-req: {batch}, .*gen throughput \(token/s\): ([\d.]+)", log.getvalue())][1:]
        want = throughput(batch, step_ms=10, step_ms_per_req=0.25)
        print(f"batching B={batch}: median gen throughput {statistics.median(rates):.1f} tok/s, "
              f"formula {want:.1f} tok/s, ratio {statistics.median(rates) / want:.3f} ({len(rates)} intervals)")
        results["batching"].append({"batch": batch, "step_ms": 10, "step_ms_per_req": 0.25,
                                    "measured_tok_s": statistics.median(rates), "formula_tok_s": want})
        await server.stop()
    out = Path(__file__).parent / "results" / "simulator.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    asyncio.run(main())
