"""All benchmarks in one command (`make bench`): ingest ceiling, GPU occupancy, capacity discovery, work spread,
server tuning, prefix affinity, resume, stats, export, probe latency, runaway guard, console cost (tui), control-op
latency (control).

    .venv/bin/python -m tests.bench.run_all [--quick]
        [--only ingest,occupancy,capacity,spread,tuning,affinity,resume,stats,export,probe,runaway,tui,control]

Writes tests/bench/results/bench.json (every figure, every run) and prints a Markdown table
(the rows of docs/benchmarks.md). Medians of --repeats runs (3; --quick: 1). The resume
run dir (1,000,000 committed samples) and the stats data (1,000,000 samples) are built once and
cached under $TMPDIR/regen-bench-cache (the first run pays for building them).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from tests.bench import bench_common as bc

ALL = ("ingest", "occupancy", "capacity", "spread", "tuning", "affinity", "resume", "stats", "export", "probe", "runaway",
       "tui", "control")


def _sub(argv: list[str], timeout: float) -> None:
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=str(bc.REPO), timeout=timeout, text=True,
                          capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    print("\n".join("  " + line for line in proc.stdout.strip().splitlines()[-6:]), flush=True)


def run_ingest(quick: bool) -> dict:
    from tests.bench import bench_ingest

    if quick:
        res = bench_ingest.run(samples=2000, baseline_samples=500, repeats=1, gpus=2, threads=64, output_mean=4000)
    else:
        # 8,000 samples: a steady window of ~5 s (4,000 gave 2-3 s, where one slow part moved a run by a quarter)
        res = bench_ingest.run(samples=8000, baseline_samples=1500, repeats=5, gpus=2, threads=64, output_mean=4000)
    bc.write_result("ingest", res)
    return res


def run_occupancy(quick: bool) -> dict:
    from tests.bench import bench_occupancy

    res = bench_occupancy.run(requests=640 if quick else 960, gpus=4, repeats=1 if quick else 3, step_ms=6.0)
    bc.write_result("occupancy", res)
    return res


def run_capacity(quick: bool) -> dict:
    from tests.bench import bench_capacity

    res = bench_capacity.run(requests=4000 if quick else 12000, gpus=2, batch=256, repeats=1, step_ms=20.0,
                             cases=list(bench_capacity.CASES))
    bc.write_result("capacity", res)
    return res


def run_spread(quick: bool) -> dict:
    from tests.bench import bench_spread

    res = bench_spread.run(requests=1000 if quick else 1500, gpus=2, repeats=1 if quick else 3,
                           variants=list(bench_spread.VARIANTS))
    bc.write_result("spread", res)
    return res


def run_tuning(quick: bool) -> dict:
    from tests.bench import bench_tuning

    res = bench_tuning.run(list(bench_tuning.WORKLOADS), repeats=1 if quick else 2, quick=quick)
    bc.write_result("tuning", res)
    return res


def run_affinity(quick: bool) -> dict:
    from tests.bench import bench_affinity

    res = bench_affinity.run(conversations=80 if quick else 160, gpus=2 if quick else 4, repeats=1 if quick else 3)
    bc.write_result("affinity", res)
    return res


def run_resume(quick: bool) -> dict:
    from tests.bench import bench_resume

    res = bench_resume.run(1_000_000, repeats=1 if quick else 3, keep=bc.CACHE / "resume-1000000")
    bc.write_result("resume", res)
    return res


def run_stats(quick: bool) -> dict:
    _sub(["tests.bench.bench_stats", "--repeats", "1" if quick else "3", "--jsonl-samples", "5000" if quick else "20000",
          "--keep", str(bc.CACHE / "stats-1000000")], timeout=1200)
    return json.loads((bc.RESULTS_DIR / "stats.json").read_text())


def run_export(quick: bool) -> dict:
    from tests.bench import bench_export

    # 20,000 samples (1,000 a shard): the largest that runs in a few minutes on the 2-core bench box
    res = bench_export.run(samples=4000 if quick else 20000, parts=8 if quick else 40)
    bc.write_result("export", res)
    return res


def run_runaway(quick: bool) -> dict:
    from tests.bench import bench_runaway

    res = bench_runaway.run(samples=300 if quick else 1200, gpus=4, cpu_repeats=1 if quick else 3)
    bc.write_result("runaway", res)
    return res


def run_probe(quick: bool) -> dict:
    _sub(["tests.bench.bench_probe_latency", "--runs", "3" if quick else "5"], timeout=600)
    return json.loads((bc.RESULTS_DIR / "probe_latency.json").read_text())


def run_control(quick: bool) -> dict:
    from tests.bench import bench_control

    res = bench_control.run(ops=10 if quick else 50)
    bc.write_result("control", res)
    return res


def control_rows(ctl: dict) -> list[str]:
    rows = []
    for kind, label in (("pause_10_shards", "a pause of 10 shards"), ("status", "status (with the shard list)")):
        c, p = ctl["forms"]["channel"][kind], ctl["forms"]["process_per_op"][kind]
        ratio = ctl["ratio_process_over_channel"][kind]
        rows.append(f"| control over the real sshd: {label}, median of {c['ops']} ops, the console's channel vs one "
                    f"`engine.ctl` process per op | {c['median_ms']:.1f} ms | {p['median_ms']:.0f} ms | {ratio:.0f}x "
                    f"| ≥ 10x | {_yes(ratio >= 10)} |")
    return rows


def run_tui(quick: bool) -> dict:
    from tests.bench import bench_tui

    res = bench_tui.run(seconds=10 if quick else 20, latency_s=15 if quick else 30)
    bc.write_result("tui", res)
    return res


def tui_rows(tui: dict) -> list[str]:
    rows = []
    for n, r in tui["scales"].items():
        budget = tui["budget"][f"cpu_pct_{n}_shards"]
        tabs = r["tabs"]
        worst = max(tabs, key=lambda t: tabs[t]["cpu_pct"])
        per_tab = ", ".join(f"{t} {v['cpu_pct']:.1f}" for t, v in tabs.items())
        base = r.get("baseline_tabs")
        base_text = ", ".join(f"{t} {v['cpu_pct']:.1f}" for t, v in base.items()) if base else ""
        ok = r["run_state_at_end"] == "running" and tabs[worst]["cpu_pct"] <= budget
        libs = tui.get("libraries") or {}
        load = max(v.get("load_avg", [0.0])[0] for v in tabs.values())
        rows.append(f"| tui: console CPU, % of one core (CPU seconds over each tab's window; textual "
                    f"{libs.get('textual', '?')}, textual-plot {libs.get('textual-plot', '?')}; load avg up to "
                    f"{load:.1f}), {r['workers']} workers, {int(n):,} shards, per tab | {per_tab} | {base_text} | | "
                    f"≤ {budget:.0f}% every tab | {_yes(ok)} |")
        for tab in ("workers", "shards"):
            lat = r["latency"].get(tab) or {}
            if lat.get("batches"):
                rows.append(f"| tui: event → screen, {tab} tab, {int(n):,} shards: median / p95 / max of "
                            f"{lat['batches']} batches | {lat['median_ms']:.0f} / {lat['p95_ms']:.0f} / "
                            f"{lat['max_ms']:.0f} ms | | | p95 ≤ {tui['budget']['p95_ms']:.0f} ms | "
                            f"{_yes(lat['p95_ms'] <= tui['budget']['p95_ms'])} |")
        sr = r["latency"]["status_reply"]
        rows.append(f"| tui: status with its shard list (each (re)connect, every 5 min), {sr['shards']:,} shards: "
                    f"size; console fold | {sr['bytes'] / 1e6:.2f} MB; {sr['fold_ms']:.0f} ms | | | | n/a |")
        if "periodic_bytes" in sr:
            rows.append(f"| tui: periodic status (every 10 s, no shard list), {sr['shards']:,} shards: size | "
                        f"{sr['periodic_bytes'] / 1e3:.1f} kB | | | | n/a |")
    return rows


def tuning_rows(tun: dict) -> list[str]:
    """bench_tuning: regen's chosen --schedule-conservativeness vs SGLang's default, and vs the peer-like baseline."""
    rows = []
    met = tun["met"]
    for name, r in tun["workloads"].items():
        w, m = r["workload"], r["median"]
        chosen, default = m["regen_chosen"], m["regen_default"]
        what = (f"tuning, {name}: output tok/s on the cost model's clock, steady window ({w['window_steps']:,} decode "
                f"steps a server after the ratio's decay), 2 servers with a KV pool of {w['pool']:,}, answers mean "
                f"{w['output_mean']:,.0f} (max_new {w['max_new']:,}); regen at {r['chosen_source']} vs regen on "
                f"default servers (running {chosen['mean_running']:,.0f} vs {default['mean_running']:,.0f}, usage "
                f"{chosen['mean_usage']:.2f} vs {default['mean_usage']:.2f}; runs limited by admission "
                f"{chosen.get('runs_counted', '?')} and {default.get('runs_counted', '?')} of {tun['repeats']})")
        target = tun["target"]["seed" if name == "seed" else "vs_default"]
        rows.append(f"| {what} | {chosen['tokens_per_s']:,.0f} | {default['tokens_per_s']:,.0f} | "
                    f"{r['chosen_vs_default']:.3f}x | ≥ {target:.2f}x | {_yes(met.get(f'{name}_vs_default'))} |")
        sweep = [a for a in m if a.startswith("regen_") and a not in ("regen_chosen", "regen_default")]
        if sweep:
            rates = "; ".join(f"{m[a]['tokens_per_s']:,.0f} ({m[a]['tokens_per_s'] / default['tokens_per_s']:.3f}x, "
                              f"{m[a]['retractions_per_server_min']:.1f} retractions a server-minute)" for a in sweep)
            rows.append(f"| tuning, {name}: the sweep ({', '.join(sweep)}) vs default servers | {rates} | | | | n/a |")
        if r.get("servers_chosen_vs_default") is not None:
            bc_, b = m["baseline_chosen"], m["baseline"]
            rows.append(f"| tuning, {name}: the setting on the servers alone: the peer-like client (every queue full) on "
                        f"chosen vs default servers (running {bc_['mean_running']:,.0f} vs {b['mean_running']:,.0f}) | "
                        f"{bc_['tokens_per_s']:,.0f} | {b['tokens_per_s']:,.0f} | {r['servers_chosen_vs_default']:.3f}x "
                        f"| | n/a |")
        if r.get("chosen_vs_baseline") is not None:
            b = m["baseline"]
            rows.append(f"| tuning, {name}: regen chosen vs the peer-like baseline at N = 4,096 on default servers "
                        f"(running {b['mean_running']:,.0f}) | {chosen['tokens_per_s']:,.0f} | "
                        f"{b['tokens_per_s']:,.0f} | {r['chosen_vs_baseline']:.3f}x | "
                        f"≥ {tun['target']['vs_baseline']:.2f}x | "
                        f"{_yes(met.get(f'{name}_vs_baseline'))} |")
        if name == "seed":
            rows.append(f"| tuning, seed: retractions per server-minute at the chosen setting (sglang:num_retracted_"
                        f"requests; on the unscaled clock; per wall minute) | "
                        f"{chosen['retractions_per_server_min']:.2f}; {chosen['retractions_per_wall_server_min']:.2f} | "
                        f"{default['retractions_per_server_min']:.2f} | | "
                        f"≤ {tun['target']['retractions_per_server_min']:.0f} | {_yes(met.get('seed_retractions'))} |")
    return rows


def _yes(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**yes**" if ok else "**NO**")


def table(results: dict) -> str:
    rows = ["| benchmark | regen | baseline (same run) | ratio | target | met |", "|---|---:|---:|---:|---|---|"]
    ing = results.get("ingest")
    if ing:
        r, b = ing["regen"], ing["baseline"]
        cpu = bc.median([x["tokens_per_cpu_s"] for x in r["runs"]])
        share = bc.median([x["engine_cpu_share"] for x in r["runs"]])
        rows.append(f"| ingest: output tokens/s committed, wall clock (engine pinned to 1 core; got {share:.0%} of it) | "
                    f"{r['tokens_per_s_median']:,.0f} | {b['tokens_per_s_median']:,.0f} | {ing['ratio']:.1f}x | "
                    f"≥ 1,000,000 and ≥ 10x | {_yes(r['tokens_per_s_median'] >= 1e6 and ing['ratio'] >= 10)} |")
        if "ratio_cpu" in ing:  # the baseline's CPU too (its process: requests + re-tokenizing)
            rows.append(f"| ingest: output tokens per CPU-second (regen: the engine over its steady window; baseline: "
                        f"its whole client) | {r['tokens_per_cpu_s_median']:,.0f} | "
                        f"{b['tokens_per_cpu_s_median']:,.0f} | {ing['ratio_cpu']:.1f}x | ≥ 1,000,000 and ≥ 10x | "
                        f"{_yes(ing['met_cpu'])} |")
        else:
            rows.append(f"| ingest: output tokens per engine CPU-second (one core to itself) | {cpu:,.0f} | | | "
                        f"≥ 1,000,000 | {_yes(cpu >= 1e6)} |")
    occ = results.get("occupancy")
    if occ:
        m = occ["median"]
        rows.append(f"| occupancy: full-batch share, worst simulated GPU (mean) | {m['full_batch_share_min']['regen']:.1%} "
                    f"({m['full_batch_share_mean']['regen']:.1%}) | {m['full_batch_share_min']['baseline']:.1%} "
                    f"({m['full_batch_share_mean']['baseline']:.1%}) | | ≥ 98% | "
                    f"{_yes(m['full_batch_share_min']['regen'] >= 0.98)} |")
        rows.append(f"| occupancy: wall time for {occ['requests']} long-tail requests, {occ['simulators']} GPUs | "
                    f"{m['wall_s']['regen']:.1f} s | {m['wall_s']['baseline']:.1f} s | {occ['wall_ratio']:.2f}x | | n/a |")
    cap = results.get("capacity")
    if cap:
        labels = {"log": "said only in the start-up log (0.5.5)",
                  "internal_states": "said only as effective_max_running_requests_per_dp (0.5.23)",
                  "feedback": "said nowhere, found from the queue (0.5.5, log unread)"}
        for case, c in cap["cases"].items():
            m = c["median"]
            target = "≥ 98%" if c["met"] is not None else ""
            rows.append(f"| capacity: full-batch share, worst GPU, batch {cap['batch']} {labels[case]} (mean fill) | "
                        f"{m['full_batch_share_min']['regen']:.1%} ({m['mean_fill']['regen']:.1%}) | "
                        f"{m['full_batch_share_min']['old']:.1%} ({m['mean_fill']['old']:.1%}) | "
                        f"{c['wall_ratio']:.2f}x wall | {target} | {_yes(c['met'])} |")
    spr = results.get("spread")
    if spr:
        m = spr["median"]
        best = max(("baseline_64", "baseline_batch"), key=lambda n: m[n]["tokens_per_s"])
        rows.append(f"| spread: output tok/s, {spr['simulators']} servers reporting batch {spr['reported_batch']:,} with a "
                    f"KV pool of {spr['kv_pool']:,} tokens ({spr['requests']['kv']} requests); baseline: thread pool of N "
                    f"concurrent chat requests, round-robin, best N ({m[best]['tokens_per_s']:,.0f} at "
                    f"{'64' if best == 'baseline_64' else 'the reported batch'}; other "
                    f"{m['baseline_batch' if best == 'baseline_64' else 'baseline_64']['tokens_per_s']:,.0f}) | "
                    f"{m['kv']['tokens_per_s']:,.0f} | {m[best]['tokens_per_s']:,.0f} | "
                    f"{spr['speedup_vs_best_baseline']:.2f}x | ≥ 1.2x | {_yes(spr['met'].get('speedup'))} |")
        labels = {"kv": "batch reported > KV pool", "late": "servers ready 5 s apart",
                  "small": f"work < capacity ({spr['requests'].get('small', '')} requests)",
                  "restart": "a server restarted mid-run"}
        for v in ("kv", "late", "small", "restart"):
            if v in m:
                rows.append(f"| spread: {labels[v]}: worst server's full-batch share while work remains; tail (last "
                            f"server vs the servers' mean) | {m[v]['full_share_min']:.1%}; {m[v]['tail_ratio']:.2f}x | "
                            f"| | ≥ 95%; ≤ 1.2x | {_yes(spr['met'].get(v))} |")
    if results.get("tuning"):
        rows += tuning_rows(results["tuning"])
    aff = results.get("affinity")
    if aff:
        m = aff["median"]
        a, b = m["affinity"], m["baseline"]
        rows.append(f"| affinity: prompt tokens served from cache, of the reusable prefix ({aff['conversations']} "
                    f"conversations of 3-6 turns, {aff['simulators']} GPUs; dispatch.affinity vs false) | "
                    f"{a['cached_of_reusable']:.1%} | {b['cached_of_reusable']:.1%} | | ≥ 80% | "
                    f"{_yes(aff['met'])} |")
        rows.append(f"| affinity: simulated prefill time (uncached tokens x prefill cost); later turns on the same "
                    f"worker | {a['prefill_s']:.1f} s; {a['later_turns_same_worker']:.0%} | {b['prefill_s']:.1f} s; "
                    f"{b['later_turns_same_worker']:.0%} | {aff['prefill_ratio']:.2f}x less | | n/a |")
        rows.append(f"| affinity: balance (fewest / most samples a worker served); wall time | "
                    f"{a['balance_min_over_max']:.2f}; {a['wall_s']:.1f} s | {b['balance_min_over_max']:.2f}; "
                    f"{b['wall_s']:.1f} s | | | n/a |")
        for policy in ("cache_aware", "round_robin"):
            r = m.get(f"router-{policy}")
            if r:
                rows.append(f"| affinity: behind sglang-router, policy {policy}: cached of reusable; prefill | "
                            f"{r['cached_of_reusable']:.1%}; {r['prefill_s']:.1f} s | | | | n/a |")
    res = results.get("resume")
    if res:
        m = res["median"]
        rows.append(f"| resume: start -> first dispatch, 1M committed / 1M prompt rows (without server startup) | "
                    f"{m['resume_s']:.2f} s ({m['resume_without_server_startup_s']:.2f} s) | | | ≤ 3 s | "
                    f"{_yes(m['resume_s'] <= 3.0)} |")
        rows.append(f"| resume: supervisor peak RSS | {m['peak_rss_mb']:.0f} MB | | | ≤ 500 MB | "
                    f"{_yes(m['peak_rss_mb'] <= 500)} |")
    st = results.get("stats")
    if st:
        rows.append(f"| stats: 1M samples, `regen stats` vs JSONL json.loads loop | {st['compute_stats_s']['median']:.2f} s | "
                    f"{st['jsonl_loop']['extrapolated_s_for_all']:.0f} s (extrapolated) | {st['speedup_vs_jsonl']:.0f}x | | n/a |")
    ex = results.get("export")
    if ex:
        for fmt, e in ex["formats"].items():
            r, n = e["regen"], e["naive"]
            rows.append(f"| export: {ex['samples']:,} samples to {fmt}, samples/s (CPU s), vs naive to_pylist + "
                        f"{'json.dumps' if fmt == 'tokens-jsonl' else 'from_pylist'} | {r['samples_per_s']:,.0f} "
                        f"({r['cpu_s']:.1f} s) | {n['samples_per_s']:,.0f} ({n['cpu_s']:.1f} s) | {e['speedup']:.1f}x | | n/a |")
            rows.append(f"| export: {fmt} peak RSS | {r['peak_rss_mb']:.0f} MB | {n['peak_rss_mb']:.0f} MB | | ≤ 500 MB | "
                        f"{_yes(r['peak_rss_mb'] <= 500)} |")
    pr = results.get("probe")
    if pr:
        a = pr["asyncssh_one_connection_concurrent"]["connect_and_run"]["median_s"]
        s = pr["ssh_process_per_command_sequential"]["median_s"]
        rows.append(f"| probe latency: {len(pr['commands'])} probes, one asyncssh connection vs ssh per command | "
                    f"{a:.2f} s | {s:.2f} s | {pr['speedup_vs_ssh_sequential']:.1f}x | | n/a |")
    rw = results.get("runaway")
    if rw:
        g, n = rw["cases"]["guard"], rw["cases"]["no_guard"]
        # this row's own targets (rw["met"] also holds the client CPU one, on the next row)
        gpu_met = (rw["gpu_time_saving_per_kept"] >= 0.2 and (rw["loops_stopped_early_share"] or 0) >= 0.95
                   and rw["legit_stopped"] == 0)
        rows.append(f"| runaway: simulated GPU-s per kept sample, 2% loops, 1% legit repetitive, {rw['gpus']} GPUs, "
                    f"max_new_tokens {rw['max_new_tokens']:,} (loops stopped before 25%; legit stopped) | "
                    f"{g['gpu_s_per_kept']:.4f} ({rw['loops_stopped_early_share']:.0%}; {rw['legit_stopped']}) | "
                    f"{n['gpu_s_per_kept']:.4f} | {rw['gpu_time_saving_per_kept']:.0%} less | ≥ 20% less, ≥ 95%, 0 | "
                    f"{_yes(gpu_met)} |")
        c = rw.get("client_cpu")
        if c:
            rows.append(f"| runaway: client CPU s per 1M tokens received, answers streamed through the guard vs plain "
                        f"requests, the same answers (no loops; medians of {c['repeats']} pairs) | "
                        f"{c['streamed_cpu_s_per_m_tokens_median']:.3f} | {c['plain_cpu_s_per_m_tokens_median']:.3f} | "
                        f"{c['ratio']:.2f}x | ≤ 1.2x | {_yes(c['ratio'] <= 1.2 and c['same_tokens_received'])} |")
    if results.get("tui"):
        rows += tui_rows(results["tui"])
    if results.get("control"):
        rows += control_rows(results["control"])
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one run each, smaller ingest/occupancy workloads")
    ap.add_argument("--only", default=",".join(ALL), help=f"comma-separated subset of {','.join(ALL)}")
    ap.add_argument("--from-results", action="store_true",
                    help="run nothing: rebuild bench.json and the table from the per-benchmark JSON files")
    args = ap.parse_args(argv)
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = sorted(set(wanted) - set(ALL))
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(ALL)}")
    runners = {"ingest": run_ingest, "occupancy": run_occupancy, "capacity": run_capacity, "spread": run_spread,
               "tuning": run_tuning, "affinity": run_affinity,
               "resume": run_resume, "stats": run_stats, "export": run_export, "probe": run_probe,
               "runaway": run_runaway, "tui": run_tui, "control": run_control}
    out = bc.RESULTS_DIR / "bench.json"
    results: dict = {}
    failures: dict[str, str] = {}
    started = time.monotonic()
    files = {"ingest": "ingest.json", "occupancy": "occupancy.json", "capacity": "capacity.json", "spread": "spread.json",
             "tuning": "tuning.json", "affinity": "affinity.json",
             "resume": "resume.json", "stats": "stats.json", "export": "export.json",
             "probe": "probe_latency.json", "runaway": "runaway.json", "tui": "tui.json", "control": "control.json"}
    # the benchmarks not run this time keep their recorded figures, so bench.json and its table stay whole
    recorded = wanted if args.from_results else [n for n in ALL
                                                 if n not in wanted and (bc.RESULTS_DIR / files[n]).exists()]
    for name in recorded:
        path = bc.RESULTS_DIR / files[name]
        try:
            results[name] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            failures[name] = f"cannot read {path}: {exc}"
    for name in [] if args.from_results else wanted:
        t = time.monotonic()
        print(f"== {name}", flush=True)
        try:
            results[name] = runners[name](args.quick)
        except Exception as exc:  # one failing benchmark must not hide the others' figures; reported below
            failures[name] = f"{type(exc).__name__}: {exc}"
            print(f"  FAILED: {failures[name]}", file=sys.stderr, flush=True)
        print(f"   ({time.monotonic() - t:.0f} s)", flush=True)
    report = {"quick": args.quick, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "total_s": time.monotonic() - started, "machine": bc.machine(), "failures": failures,
              "results": results, "table_markdown": table(results)}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(report["table_markdown"])
    print(f"\ntotal {report['total_s']:.0f} s; wrote {out}")
    for name, why in failures.items():
        print(f"{name} FAILED: {why}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
