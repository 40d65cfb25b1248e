"""Control-op latency over SSH: an attached console's one control channel (`engine.ctl serve`, engine.api.protocol) versus
one `python -m engine.ctl` process per op (the form before the channel, and the CLI's one-shot commands).

Starts its own throwaway OpenSSH sshd on loopback (tests.sshd_fixtures.start_sshd) and a real simulated run through
it (`regen start`'s start_run: the engine deployed into the run dir, the supervisor detached), then times, on one
asyncssh connection, `--ops` pauses of 10 shards and `--ops` status ops (full status, with the shard list) each way,
in the same run, alternating the two forms in rounds so that the machine's load falls on both alike. Run:

    .venv/bin/python -m tests.bench.bench_control [--ops 50] [--out tests/bench/results/control.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from console.commands.demo import demo_config, write_prompts
from console.host.deploy import start_run
from console.host.run_client import RunClient
from console.host.connect import open_transport
from engine.api.protocol import PROTOCOL_VERSION
from tests.bench import bench_common as bc
from tests.sshd_fixtures import start_sshd, stop_sshd

# a run that keeps going (and keeps pending shards) for the whole measurement
SLOW_SIM = ["--sim-step-ms", "200", "--sim-tokens-per-step", "1", "--sim-output-mean", "500",
            "--max-running-requests", "2"]
ROUND = 10  # ops of one kind per form before switching to the other form


async def _timed(op) -> float:
    started = time.perf_counter()
    await op()
    return time.perf_counter() - started


async def _measure(ops: int, workdir: Path) -> dict:
    sshd = start_sshd(workdir / "sshd")
    transport = None
    try:
        transport = await open_transport(sshd.alias, ssh_config=str(sshd.ssh_config_path))
        run_dir = workdir / "run"
        run_dir.mkdir()
        prompts = write_prompts(run_dir.parent / "prompts", 400, 0)
        cfg = demo_config(run_dir, bc.tiny_model(), prompts, 1, SLOW_SIM, shard_size=10)
        started = await start_run(transport, cfg, host_python=sys.executable)
        channel = started.client(transport)
        await channel.open_channel()
        assert channel.channel is not None, channel.protocol_note
        one_process = started.client(transport)
        status = await channel.status()
        shard_ids = [s.id for s in status.shards][-10:]
        assert len(shard_ids) == 10, f"the run has {len(status.shards)} shards; 10 needed"
        forms = {"channel": channel, "process_per_op": one_process}
        kinds = {"pause_10_shards": lambda c: c.pause(shard_ids), "status": lambda c: c.status()}
        times: dict[str, dict[str, list[float]]] = {f: {k: [] for k in kinds} for f in forms}
        for form, client in forms.items():  # one warm-up op each (the channel's first op, the python's page cache)
            for op in kinds.values():
                await op(client)
        while any(len(times[f][k]) < ops for f in forms for k in kinds):
            for form, client in forms.items():
                for kind, op in kinds.items():
                    for _ in range(min(ROUND, ops - len(times[form][kind]))):
                        times[form][kind].append(await _timed(lambda: op(client)))
        final = await channel.status(shards=False)
        await channel.stop()
        await channel.close_channel()
        return {"times": times, "shards": len(status.shards), "run_state_at_end": final.state,
                "hello": {"engine": channel_hello(channel), "protocol": PROTOCOL_VERSION}}
    finally:
        if transport is not None:
            await transport.close()
        stop_sshd(sshd)


def channel_hello(client: RunClient) -> str:
    return client.channel.hello.engine_version if client.channel and client.channel.hello else ""


def run(ops: int = 50) -> dict:
    with tempfile.TemporaryDirectory(prefix="regen-bench-control-") as tmp:
        load_before = os.getloadavg()[0]
        started = time.monotonic()
        raw = asyncio.run(_measure(ops, Path(tmp)))
        wall = time.monotonic() - started
    times = raw.pop("times")
    forms = {}
    for form, kinds in times.items():
        forms[form] = {kind: {"median_ms": 1000 * statistics.median(v), "p90_ms": 1000 * _p90(v),
                              "min_ms": 1000 * min(v), "ops": len(v)} for kind, v in kinds.items()}
    ratio = {kind: forms["process_per_op"][kind]["median_ms"] / forms["channel"][kind]["median_ms"]
             for kind in forms["channel"]}
    return {"ops_per_kind": ops, "forms": forms, "ratio_process_over_channel": ratio,
            "met_10x": all(r >= 10 for r in ratio.values()), "wall_s": wall, **raw,
            "machine": {**bc.machine(), "load_avg_1m_before": load_before, "platform": platform.platform()},
            "transport": "asyncssh over loopback to OpenSSH sshd (tests.sshd_fixtures)",
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=50, help="ops of each kind, each form (the medians are of these)")
    ap.add_argument("--out", type=Path, default=bc.RESULTS_DIR / "control.json")
    args = ap.parse_args(argv)
    res = run(args.ops)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    for kind, r in res["ratio_process_over_channel"].items():
        c, p = res["forms"]["channel"][kind], res["forms"]["process_per_op"][kind]
        print(f"{kind}: channel {c['median_ms']:.1f} ms (p90 {c['p90_ms']:.1f}), one process per op "
              f"{p['median_ms']:.1f} ms (p90 {p['p90_ms']:.1f}): {r:.1f}x; median of {c['ops']} ops")
    print(f"load average {res['machine']['load_avg_1m']:.1f}; wrote {args.out}")
    return 0 if res["met_10x"] else 1


if __name__ == "__main__":
    sys.exit(main())
