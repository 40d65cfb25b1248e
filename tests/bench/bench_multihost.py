"""Multi-host: throughput over 1, 2 and 3 simulated hosts through sglang-router, and the router's
added latency per request against direct dispatch.

Scaling: the hosts of tests/netns_hosts.py (network namespaces with their own sshd, else sshd on
loopback ports), one simulated GPU each (max running batch 16, 40 ms decode steps of 4 tokens,
~200-token answers: a fixed-rate server that needs little CPU), the real supervisor with
[[hosts]], SSH port forwards and the router (round_robin). The same prompt set for every host
count; the rate is the output tokens committed (state.sqlite) after the last server joined the
router until 80% of all tokens are committed, over that time (the tail, where the last wave of a
fixed workload fills fewer slots the more servers there are, is left out). Ratio: against the
1-host run of the same repeat.

Latency: one local simulator answering 8-token requests at once, 300 sequential /generate calls
alternating direct and through a local router to that same server; medians and p90 of each, the
difference is what the router adds.

    python -m tests.bench.bench_multihost [--repeats 3] [--conversations 240]
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.bench import bench_common as bc


def _post(url: str, body: dict) -> float:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + "/generate", data=data, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
    return time.perf_counter() - t0


def router_latency(model: Path, work: Path, requests: int = 300) -> dict:
    from engine.config.load import Router, RunConfig
    from engine.placement.router import router_argv
    from tests.sshd_fixtures import free_port

    sims = bc.start_sims(1, model, ["--sim-instant", "--sim-output-mean", "8", "--log-level-http", "warning"],
                         work / "lat-sims")
    port, prom = free_port(), free_port()
    cfg = RunConfig(run_dir=str(work), model=str(model), prompts=("x",), host_python=sys.executable,
                    router=Router(port=port, prometheus_port=prom, policy="round_robin"))
    log = open(work / "router.log", "wb")
    router = subprocess.Popen(router_argv(cfg) + ["--worker-urls", sims.urls[0]], stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    router_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(router_url + "/readiness", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or router.poll() is not None:
                    raise RuntimeError(f"router not ready: {(work / 'router.log').read_text()[-2000:]}")
                time.sleep(0.2)
        body = {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8}}
        for _ in range(20):  # warm both paths' connections
            _post(sims.urls[0], body)
            _post(router_url, body)
        direct, routed = [], []
        for i in range(requests):
            body = {"rid": f"lat{i}", "input_ids": [1, 2, 3, i % 50 + 10], "sampling_params": {"max_new_tokens": 8}}
            direct.append(_post(sims.urls[0], body))
            routed.append(_post(router_url, {**body, "rid": f"lat{i}r"}))
    finally:
        router.terminate()
        router.wait(timeout=10)
        log.close()
        sims.stop()

    def p90(v: list[float]) -> float:
        return sorted(v)[int(0.9 * (len(v) - 1))]

    return {"requests": requests, "direct_median_ms": statistics.median(direct) * 1e3,
            "router_median_ms": statistics.median(routed) * 1e3, "direct_p90_ms": p90(direct) * 1e3,
            "router_p90_ms": p90(routed) * 1e3,
            "added_median_ms": (statistics.median(routed) - statistics.median(direct)) * 1e3}


STEADY_SHARE = 0.8
SCALE_SIM = ("--max-running-requests", "16", "--sim-step-ms", "40", "--sim-step-ms-per-req", "0",
             "--sim-tokens-per-step", "4", "--sim-output-mean", "200", "--sim-output-sigma", "0.3",
             "--sim-load-s", "0.2", "--log-level-http", "warning")


def one_scale_run(hosts, n: int, model: Path, prompts: Path, work: Path) -> dict:
    from engine.config.load import Alerts, Dispatch, Host, Router, RunConfig, Sampling, SIMULATOR_LAUNCH, Workers
    from tests.sshd_fixtures import free_port

    run_dir = work / f"run-{n}h-{time.monotonic_ns()}"
    cfg = RunConfig(
        run_dir=str(run_dir), model=str(model), prompts=(str(prompts),), host_python=sys.executable, turns="all",
        shard_size=100, context_length=4096, sampling=Sampling(max_new_tokens=1024),
        workers=Workers(launch=SIMULATOR_LAUNCH, extra_args=SCALE_SIM, ready_timeout_s=120.0),
        dispatch=Dispatch(request_timeout_s=120.0), alerts=Alerts(disk_free_min_gb=0.5),
        hosts=tuple(Host(name=h.name, address=h.address, gpus=(0,), work_dir=str(h.work_dir),
                         host_python=sys.executable, base_port=h.base_port, ssh_options=("-F", str(hosts.ssh_config)))
                    for h in hosts.hosts[:n]),
        router=Router(policy="round_robin", port=free_port(), prometheus_port=free_port(), python=sys.executable))
    run = bc.run_supervisor(cfg, timeout=600)
    if run.exit_code != 0:
        raise RuntimeError(f"{n}-host run exited {run.exit_code}: {(run_dir / 'supervisor.log').read_text()[-3000:]}")
    lines = bc.supervisor_lines(run_dir)
    ready = [t for t, line in lines if "starting -> ready" in line and "regen.hosts" in line]
    if len(ready) < n:
        raise RuntimeError(f"only {len(ready)} of {n} servers became ready")
    t_all = sorted(ready)[n - 1]
    db = sqlite3.connect(run_dir / "state.sqlite")
    parts = db.execute("SELECT p.committed_at, SUM(s.output_len) FROM parts p JOIN samples s ON s.part_path = p.path"
                       " GROUP BY p.path ORDER BY p.committed_at").fetchall()
    db.close()
    total = sum(tok for _, tok in parts)
    # steady state: from the last server's join to the commit that reaches STEADY_SHARE of all tokens,
    # leaving out the tail (the last wave of a fixed workload fills fewer slots the more there are)
    done, t_end, tokens = 0, None, 0
    for t, tok in parts:
        done += tok
        if t >= t_all:
            tokens += tok
        if done >= STEADY_SHARE * total:
            t_end = t
            break
    return {"hosts": n, "tokens_per_s": tokens / max(1e-6, t_end - t_all), "output_tokens": total,
            "window_s": t_end - t_all, "to_last_commit_s": parts[-1][0] - t_all, "wall_s": run.wall_s}


def scaling(repeats: int, conversations: int, work: Path) -> dict:
    from tests.netns_hosts import start_hosts

    model = bc.tiny_model()
    prompts = bc.write_prompts(work / "prompts.jsonl", conversations, words=30)
    hosts = start_hosts(work / "hosts", 3)
    runs: list[list[dict]] = []
    try:
        for _ in range(repeats):
            runs.append([one_scale_run(hosts, n, model, prompts, work) for n in (1, 2, 3)])
    finally:
        hosts.close()
    med = {n: statistics.median(r[n - 1]["tokens_per_s"] for r in runs) for n in (1, 2, 3)}
    ratios = {n: statistics.median(r[n - 1]["tokens_per_s"] / r[0]["tokens_per_s"] for r in runs) for n in (2, 3)}
    return {"mode": hosts.mode, "why_not_netns": hosts.why_not_netns, "conversations": conversations,
            "sim_args": list(SCALE_SIM), "tokens_per_s_median": med, "scaling_ratio_median": ratios, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=360)
    ap.add_argument("--requests", type=int, default=300)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="regen-bench-mh-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        latency = router_latency(bc.tiny_model(), work, args.requests)
        scale = scaling(args.repeats, args.conversations, work)
    res = {"benchmark": "multihost", "repeats": args.repeats, "scaling": scale, "router_latency": latency,
           "machine": bc.machine()}
    out = bc.write_result("multihost", res)
    m, r = scale["tokens_per_s_median"], scale["scaling_ratio_median"]
    print(f"multihost ({scale['mode']}): {m[1]:,.0f} / {m[2]:,.0f} / {m[3]:,.0f} tok/s on 1/2/3 hosts "
          f"(x{r[2]:.2f}, x{r[3]:.2f}); router adds {latency['added_median_ms']:.2f} ms per request "
          f"(median {latency['router_median_ms']:.2f} vs {latency['direct_median_ms']:.2f} ms direct); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
