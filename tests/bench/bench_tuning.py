"""Regen's server tuning (issue 38): --schedule-conservativeness for the servers regen launches vs SGLang's default.

    .venv/bin/python -m tests.bench.bench_tuning [--quick] [--repeats N] [--workloads spread,spread40k,seed]
                                                 [--sweep 0.5,0.3] [--keep DIR]

Two simulated SGLang 0.5.23 servers launched without --max-running-requests, admission as SGLang's (engine.simulator
.kv_policy: a new request reserves its clipped max_new_tokens in full, the running ones are discounted by the new-token
ratio, which decays over 600 decode steps from min(0.7 x conservativeness, 1) to 0.14 x that). Workloads:
  spread40k  bench_spread's workload: its answers (lognormal mean 400, sigma 0.5, max_new_tokens 2,048), prompts ~300
             tokens, its servers' KV pool of 40,000 tokens (issue 38's targets: >= 1.15x the baseline, >= 1.10x default)
  spread     the same answers on issue 38's side-by-side pool, 281,029 tokens (a real 0.5.23 server's on an H200:
             tests/test_capacity.py)
  seed       the seed-like run: answers lognormal mean 1,500, sigma 1, max_new_tokens 32,768, pool 281,029

Before the arms, regen chooses: `regen plan --pilot` (engine.plan.projection.make_plan, what the command runs) on the
workload's servers and prompts with [workers] schedule_conservativeness = "auto" (the default); the value it records in
<run_dir>/tuning.json, and its evidence (each pilot server's token usage while requests queued, #queue-req,
retractions), is what "regen chosen" runs with. Arms, alternated in each repeat (reversed every other repeat), the same
prompts and rids (so the same answers):
  regen default   the real supervisor; its servers at SGLang's default conservativeness ("auto", no pilot record)
  regen 0.5 ...   the same with an explicit --schedule-conservativeness: the value the earlier bench gave by hand
                  (Workload.explicit) where the pilot chose another, and --sweep's
  regen chosen    the same, its run dir holding the pilot's tuning.json (as `regen run` after `regen plan --pilot`):
                  its value, its clip env and, where it chose it, --enable-mixed-chunk (a prefill batch mixed with the
                  running batch, which decodes in it)
  regen chosen unmixed  the same record with [workers] mixed_chunk = false (where the pilot chose the flag): the value
                  and the clip alone
  baseline        bench_spread's peer-like client (a thread pool of 4,096 concurrent chat requests, round-robin) on
                  default servers: N = 4,096 is its best N (bench_spread: the reported batch, 2 x 2,048, over 64)
  baseline chosen the same client on servers launched with the pilot's value (spread only): it keeps every queue full,
                  so it measures the setting on the servers alone

Each arm is boxed by steps: it stops once every server ran 600 + window_steps decode steps since its first admission
(more prompts than that serves). Figures, per server from its step log (decode-log-interval 1), summed over the
servers, all on the cost model's clock (each step's time as the simulator charges it: the step's batch from the log
lines, the same sum as its own "simulated GPU time" line, within 0.2%), so a loaded machine slows the arm but does not
move its figures: output tok/s over the steady window, from the server's 600th decode step (its new-token ratio at its
floor) to the stop; the mean running batch, token usage and the share of the window with a queue (the server, not the
client, was the limit); prefill steps per decode step and requests per prefill; the lag (wall time over the cost
model's: > 1 means the simulators' core fell behind); retractions (sglang:num_retracted_requests from each server's
/metrics, read at the stop) per server-minute; the wall-clock tok/s too. An arm's medians are over its runs limited by
admission (every server had a queue through >= ADMISSION_SHARE of the window): a run where the client starved the
servers (a loaded engine core sends in bursts, and a burst is admitted 10-30 to a prefill step instead of one, which
this cost model rewards) measures the client, not the setting; it is kept in the JSON, marked "client".

Time scaling: step costs are bench_spread's divided by TIME_SCALE (2.5 ms a step, 0.025 ms a running request, 0.5 ms
per 1,000 prompt tokens) with one token a step (as a GPU decodes without speculation: an answer of 400 tokens spans 400
steps, so the 600-step decay covers 1.5 answers, as on a GPU); ratios are those of the unscaled cost model. Retractions
per server-minute are on the unscaled model's clock (the cost model's seconds x TIME_SCALE), and per wall server-minute.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

from engine.config.load import RunConfig, Sampling
from engine.config.schema import MIXED_CHUNK_FLAG as MIXED_FLAG
from engine.servers.tuning_rule import CLIP_ENV
from tests.bench import bench_common as bc
from tests.bench.step_clock import DECAY_STEPS, StepCost, Watch, figures

TIME_SCALE = 4.0
COST = StepCost(step_ms=10 / TIME_SCALE, per_req_ms=0.1 / TIME_SCALE, prefill_ms_per_1k=2 / TIME_SCALE,
                tokens_per_step=1)
PILOT_PROMPTS = 200  # `regen plan --pilot N`: N is raised to what fills the servers' batches (engine.plan.pilot)
PROMPT_WORDS = 250  # ~300 tokens with the tiny model's chat template
BASELINE_THREADS = 4096
ARM_TIMEOUT_S = 600.0
# a run measures the servers' admission (what the setting changes) when every server had a queue through at least this
# share of the window; below it the client starved them (it then sends in bursts, admitted many to a prefill step)
ADMISSION_SHARE = 0.5
TARGET_VS_BASELINE, TARGET_VS_DEFAULT, TARGET_SEED, TARGET_RETRACT_PER_MIN = 1.15, 1.10, 1.03, 1.0


@dataclass(frozen=True)
class Workload:
    name: str
    pool: int
    output_mean: float
    output_sigma: float
    max_new: int
    requests: int  # more than the servers finish in the arm: their queues never run dry in the window
    window_steps: int  # decode steps measured per server, after the DECAY_STEPS of the ratio's decay
    baselines: tuple[str, ...]  # the peer-like client's arms: "baseline" (default servers), "baseline_chosen"
    explicit: float  # the value an explicit flag gave before the pilot chose (the earlier bench): an arm where it differs
    sweep: tuple[float, ...] = ()  # explicit conservativeness arms besides the default and the chosen one

    def sim_args(self) -> list[str]:
        return ["--sim-sglang-version", "0.5.23", "--max-total-tokens", str(self.pool),
                "--sim-output-mean", str(self.output_mean), "--sim-output-sigma", str(self.output_sigma),
                *COST.sim_args(), "--decode-log-interval", "1", "--log-level-http", "warning", "--sim-seed", "11"]


WORKLOADS = {
    "spread40k": Workload("spread40k", 40_000, 400, 0.5, 2048, requests=2000, window_steps=600,
                          baselines=("baseline",), explicit=0.3),
    "spread": Workload("spread", 281_029, 400, 0.5, 2048, requests=5000, window_steps=600,
                       baselines=("baseline", "baseline_chosen"), explicit=0.3),
    "seed": Workload("seed", 281_029, 1500, 1.0, 32768, requests=2000, window_steps=2400, baselines=(), explicit=0.5),
}


# -- the settings each arm's servers get ----------------------------------------------------------------------------
def with_conservativeness(cfg: RunConfig, value: float | None) -> RunConfig:
    """The servers launched with an explicit --schedule-conservativeness (None: SGLang's default, no flag)."""
    if value is None:
        return cfg
    extra = (*cfg.workers.extra_args, "--schedule-conservativeness", str(value))
    return cfg.model_copy(update=dict(workers=cfg.workers.model_copy(update=dict(extra_args=extra))))


@dataclass(frozen=True)
class Choice:
    """What `regen plan --pilot` chose for a workload's servers ([workers] schedule_conservativeness = "auto"), with
    its evidence; the chosen arms' run dirs start from its record (<run_dir>/tuning.json), as a run after a plan does."""
    value: float
    verdict: str
    reason: str  # the rule's sentence: token usage while requests queued, mean #queue-req, retractions
    evidence: list[str]  # each pilot server's /metrics figures, one line each
    clip: int | None
    mixed_chunk: bool  # --enable-mixed-chunk
    record: Path  # the pilot's tuning.json
    pilot_prompts: int
    pilot_wall_s: float

    def text(self) -> str:
        return (f"{self.value:g}" + (f", clip {self.clip:,}" if self.clip is not None else "")
                + (f", {MIXED_FLAG}" if self.mixed_chunk else ""))

    def as_dict(self) -> dict:
        return dict(value=self.value, verdict=self.verdict, reason=self.reason, evidence=self.evidence, clip=self.clip,
                    mixed_chunk=self.mixed_chunk, pilot_prompts=self.pilot_prompts, pilot_wall_s=self.pilot_wall_s)


def regen_config(w: Workload, model: Path, prompts: Path, run_dir: Path) -> RunConfig:
    """The run config of every regen arm (and the pilot): the same model, launch, prompts and max_new_tokens, so the
    pilot's record holds for the chosen arms' runs (engine.servers.tuning_record.config_key)."""
    return bc.sim_config(model, [prompts], run_dir, gpus=2, sim_args=w.sim_args(),
                         sampling=Sampling(max_new_tokens=w.max_new))


def pilot_choice(w: Workload, model: Path, prompts: Path, work: Path) -> Choice:
    """regen's own choice: `regen plan --pilot` (engine.plan.projection.make_plan, what the command runs) on the bench's
    servers and prompts, with [workers] schedule_conservativeness = "auto" (the default)."""
    from engine.plan.projection import make_plan
    from engine.servers.tuning_record import RECORD_FILE

    cfg = regen_config(w, model, prompts, work / "run")
    bc.write_run_config(cfg)
    plan = make_plan(cfg, pilot=PILOT_PROMPTS)
    t, result = plan.tuning, plan.pilot
    record = Path(cfg.run_dir) / RECORD_FILE
    if t is None or t.value is None or result is None or not record.exists():
        raise RuntimeError(f"regen plan --pilot {PILOT_PROMPTS} on {w.name}: no choice recorded in {record} "
                           f"(tuning: {t}; notes: {plan.notes})")
    return Choice(t.value, str(t.verdict), t.reason, [e.text() for e in t.evidence], t.clip, t.mixed_chunk, record,
                  result.prompts, result.wall_s)


class Client(StrEnum):
    REGEN = "regen"  # the real supervisor, launching its own servers
    BASELINE = "baseline"  # bench_spread's peer-like client on servers the bench launches


@dataclass(frozen=True)
class Arm:
    name: str
    client: Client
    conservativeness: float | None = None  # explicit; None: SGLang's default
    chosen: bool = False  # the pilot's choice (Choice)
    unmixed: bool = False  # the pilot's choice less its --enable-mixed-chunk ([workers] mixed_chunk = false)


def arms_for(w: Workload, quick: bool, choice: Choice) -> list[Arm]:
    arms = [Arm("regen_default", Client.REGEN)]
    if not quick:  # the earlier explicit value where the pilot chose another, and the sweep
        arms += [Arm(f"regen_{c:g}", Client.REGEN, c) for c in dict.fromkeys((w.explicit, *w.sweep))
                 if c != choice.value]
    arms.append(Arm("regen_chosen", Client.REGEN, chosen=True))
    if choice.mixed_chunk:
        arms.append(Arm("regen_chosen_unmixed", Client.REGEN, chosen=True, unmixed=True))
    if not quick:
        # the peer-like client keeps every server's queue full: on default servers it is the peer at its best N; on
        # chosen servers it measures what the setting does to the servers alone, whatever regen's client does
        arms += [Arm(name, Client.BASELINE, chosen=name == "baseline_chosen") for name in w.baselines]
    return arms


# -- the arms -------------------------------------------------------------------------------------------------------
def run_regen(w: Workload, arm: Arm, model: Path, prompts: Path, work: Path, choice: Choice) -> dict:
    cfg = regen_config(w, model, prompts, work / "run")
    source = "SGLang's default (auto, no pilot record)"
    if arm.unmixed:
        cfg = cfg.model_copy(update=dict(workers=cfg.workers.model_copy(update=dict(mixed_chunk=False))))
    if arm.chosen:  # the run starts from the pilot's record, as `regen run` after `regen plan --pilot` in its run dir
        (work / "run").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(choice.record, work / "run" / choice.record.name)
        source = f"the pilot's choice {choice.text()} (auto, {choice.record.name})"
        if arm.unmixed:
            source += f" less {MIXED_FLAG} (mixed_chunk = false)"
    elif arm.conservativeness is not None:
        cfg, source = with_conservativeness(cfg, arm.conservativeness), f"explicit {arm.conservativeness}"
    n = len(cfg.workers.gpus)
    urls = [f"http://127.0.0.1:{cfg.workers.base_port + i}" for i in range(n)]
    watch = Watch(urls, [work / "run" / "workers" / f"gpu{g}" / "server.log" for g in cfg.workers.gpus],
                  w.window_steps)
    res = bc.run_supervisor(cfg, timeout=ARM_TIMEOUT_S, stop_when=lambda _run_dir: watch.due())
    if watch.stopped_at is None:
        tail = "\n".join(line for _, line in res.lines[-30:])
        raise RuntimeError(f"regen ended (exit {res.exit_code}) before {watch.steps} decode steps on every server; "
                           f"{res.run_dir}/supervisor.log:\n{tail}")
    logs = sorted(p for wdir in (res.run_dir / "workers").iterdir() for p in wdir.glob("server*.log"))
    engine_cpu = res.cpu_at(watch.stopped_at) - res.cpu_at(watch.started or res.started_at)
    fig = figures(logs, watch.stopped_at, watch.retracted, COST, TIME_SCALE)
    mixed = arm.chosen and choice.mixed_chunk and not arm.unmixed
    if any(m != mixed for m in fig["mixed_chunk"]):
        raise RuntimeError(f"{arm.name} on {w.name}: its servers ran {'without' if mixed else 'with'} {MIXED_FLAG} "
                           f"({res.run_dir})")
    if arm.chosen and any(c != choice.value for c in fig["conservativeness"]):
        raise RuntimeError(f"regen chosen on {w.name}: its servers ran with {fig['conservativeness']}, not the pilot's "
                           f"{choice.value:g} ({res.run_dir}/supervisor.log)")
    return dict(fig, source=source, engine_cpu_share=engine_cpu / (watch.stopped_at - (watch.started or res.started_at)))


def run_baseline(w: Workload, model: Path, prompts: Path, work: Path, choice: Choice | None) -> dict:
    """bench_spread's client, in its own process pinned like the engine, stopped with the watch; its servers launched
    with regen's `choice` (its --schedule-conservativeness and clip) or SGLang's defaults (None)."""
    flags = [] if choice is None else ["--schedule-conservativeness", str(choice.value)]
    flags += [MIXED_FLAG] if choice is not None and choice.mixed_chunk else []
    env = {CLIP_ENV: str(choice.clip)} if choice is not None and choice.clip is not None else {}
    sims = bc.start_sims(2, model, [*w.sim_args(), *flags], work / "sims", env=env)
    client = None
    try:
        watch = Watch(sims.urls, sims.logs, w.window_steps)
        argv = [sys.executable, "-m", "tests.bench.bench_spread", "--baseline-client", "--urls", ",".join(sims.urls),
                "--prompts", str(prompts), "--requests", str(w.requests), "--threads", str(BASELINE_THREADS)]
        err = open(work / "client.err", "wb")
        client = subprocess.Popen(argv, cwd=str(bc.REPO), stdout=subprocess.DEVNULL, stderr=err,
                                  preexec_fn=lambda: os.sched_setaffinity(0, bc.ENGINE_CPUS))
        err.close()
        deadline = time.monotonic() + ARM_TIMEOUT_S
        while not watch.due():
            if client.poll() is not None:
                raise RuntimeError(f"baseline client exited {client.returncode} before {watch.steps} decode steps on "
                                   f"every server:\n{(work / 'client.err').read_text(errors='replace')[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"baseline on {sims.urls}: not {watch.steps} decode steps in {ARM_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
    finally:
        if client is not None and client.poll() is None:
            client.send_signal(signal.SIGKILL)  # mid-request by design: the box is over
            client.wait(timeout=30)
        sims.stop()
    assert watch.stopped_at is not None
    return dict(figures(sims.logs, watch.stopped_at, watch.retracted, COST, TIME_SCALE),
                source="SGLang's default (no flag)" if choice is None else
                f"regen's choice {choice.text()}")


# -- the runs -------------------------------------------------------------------------------------------------------
def ratio(median: dict, a: str, b: str) -> float | None:
    return median[a]["tokens_per_s"] / median[b]["tokens_per_s"] if a in median and b in median else None


def run_workload(w: Workload, repeats: int, quick: bool, model: Path, base: Path, keep: bool) -> dict:
    prompts = bc.write_prompts(base / f"prompts-{w.name}.jsonl", w.requests, words=PROMPT_WORDS)
    pilot_dir = base / f"{w.name}-pilot"
    shutil.rmtree(pilot_dir, ignore_errors=True)
    choice = pilot_choice(w, model, prompts, pilot_dir)
    print(f"  tuning {w.name}: regen plan --pilot chose {choice.text()} ({choice.verdict}; the earlier explicit "
          f"{w.explicit:g}) in {choice.pilot_wall_s:.0f} s of {choice.pilot_prompts} prompts: {choice.reason}", flush=True)
    arms = arms_for(w, quick, choice)
    runs: dict[str, list[dict]] = {}
    for r in range(repeats):
        for arm in (arms if r % 2 == 0 else arms[::-1]):  # alternated: drift weighs on every arm alike
            work = base / f"{w.name}-r{r}-{arm.name}"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            if arm.client == Client.BASELINE:
                # on chosen servers: what regen's chosen arm's servers ran with (their server_args line)
                res = run_baseline(w, model, prompts, work, choice if arm.chosen else None)
            else:
                res = run_regen(w, arm, model, prompts, work, choice)
            res["limited_by"] = "admission" if res["queued_share_min"] >= ADMISSION_SHARE else "client"
            runs.setdefault(arm.name, []).append(res)
            print(f"  tuning {w.name} {r + 1}/{repeats} {arm.name} ({res['source']}): {res['tokens_per_s']:,.0f} tok/s "
                  f"({res['tokens_per_wall_s']:,.0f} on the wall), running {res['mean_running']:.0f}, usage "
                  f"{res['mean_usage']:.2f}, queued {res['queued_share_min']:.0%}, prefills/decode "
                  f"{res['prefills_per_decode']:.2f} of {res['requests_per_prefill']:.1f}, lag {res['lag_max']:.2f}, "
                  f"retractions {res['retractions']} ({res['retractions_log']} logged); limited by {res['limited_by']}",
                  flush=True)
            if not keep:
                shutil.rmtree(work, ignore_errors=True)
    keys = ("tokens_per_s", "tokens_per_wall_s", "mean_running", "mean_usage", "queued_share_min", "lag_max",
            "prefills_per_decode", "requests_per_prefill", "retractions_per_server_min",
            "retractions_per_wall_server_min")
    median = {}
    for a, rs in runs.items():
        counted = [x for x in rs if x["limited_by"] == "admission"]
        median[a] = {k: bc.median([x[k] for x in counted or rs if x[k] is not None]) for k in keys}
        median[a]["runs_counted"] = len(counted)  # 0: every run was client-limited; the median is of them all
    best = max((a.name for a in arms if a.client == Client.REGEN), key=lambda a: median[a]["tokens_per_s"])
    return {"workload": {k: getattr(w, k) for k in ("pool", "output_mean", "output_sigma", "max_new", "requests",
                                                     "window_steps")},
            "sim_args": w.sim_args(), "chosen_source": runs["regen_chosen"][0]["source"],
            "pilot": dict(choice.as_dict(), earlier_explicit=w.explicit),
            "explicit_vs_default": ratio(median, f"regen_{w.explicit:g}", "regen_default"),
            "median": median, "runs": runs, "best_regen_arm": best,
            "chosen_vs_default": ratio(median, "regen_chosen", "regen_default"),
            "best_vs_default": ratio(median, best, "regen_default"),
            "chosen_vs_baseline": ratio(median, "regen_chosen", "baseline"),
            "unmixed_vs_baseline": ratio(median, "regen_chosen_unmixed", "baseline"),
            "chosen_vs_unmixed": ratio(median, "regen_chosen", "regen_chosen_unmixed"),
            "servers_chosen_vs_default": ratio(median, "baseline_chosen", "baseline"),
            "default_vs_baseline": ratio(median, "regen_default", "baseline")}


def run(workloads: list[str], repeats: int, quick: bool = False, keep: Path | None = None,
        sweep: tuple[float, ...] | None = None) -> dict:
    model = bc.tiny_model()
    base = keep or Path(tempfile.mkdtemp(prefix="regen-bench-tuning-"))
    out: dict = {"benchmark": "tuning", "repeats": repeats, "quick": quick, "simulators": 2, "time_scale": TIME_SCALE,
                 "workloads": {}, "machine": bc.machine(),
                 "target": {"vs_baseline": TARGET_VS_BASELINE, "vs_default": TARGET_VS_DEFAULT, "seed": TARGET_SEED,
                            "retractions_per_server_min": TARGET_RETRACT_PER_MIN}}
    try:
        for name in workloads:
            w = WORKLOADS[name] if sweep is None else replace(WORKLOADS[name], sweep=sweep)
            w = replace(w, window_steps=w.window_steps // 4) if quick else w
            out["workloads"][name] = run_workload(w, repeats, quick, model, base, keep is not None)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    out["met"] = met(out["workloads"])
    return out


def met(results: dict) -> dict:
    m: dict[str, bool | None] = {}
    for name in ("spread40k", "spread"):
        r = results.get(name)
        if r:
            vb, vd = r["chosen_vs_baseline"], r["chosen_vs_default"]
            m[f"{name}_vs_baseline"] = None if vb is None else vb >= TARGET_VS_BASELINE
            m[f"{name}_vs_default"] = None if vd is None else vd >= TARGET_VS_DEFAULT
    r = results.get("seed")
    if r:
        per_min = r["median"]["regen_chosen"]["retractions_per_server_min"]
        m["seed_vs_default"] = r["chosen_vs_default"] is not None and r["chosen_vs_default"] >= TARGET_SEED
        m["seed_retractions"] = per_min == per_min and per_min <= TARGET_RETRACT_PER_MIN  # NaN: not read
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a smoke run: regen default vs chosen, shorter boxes")
    ap.add_argument("--keep", type=Path, default=None, help="keep every run dir and server log under this folder")
    ap.add_argument("--sweep", default=None,
                    help="explicit settings for extra regen arms on every workload, e.g. 0.5,0.3 (default: its own)")
    args = ap.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        ap.error(f"--workloads {','.join(unknown)}: not a workload; known: {', '.join(WORKLOADS)}")
    sweep = None if args.sweep is None else tuple(float(x) for x in args.sweep.split(",") if x)
    res = run(names, 1 if args.quick else args.repeats, quick=args.quick, keep=args.keep, sweep=sweep)
    out = bc.write_result("tuning", res)
    for name, r in res["workloads"].items():
        for arm, m in r["median"].items():
            print(f"{name} {arm}: {m['tokens_per_s']:,.0f} tok/s, running {m['mean_running']:.0f}, usage "
                  f"{m['mean_usage']:.2f}, retractions/server-min {m['retractions_per_server_min']:.2f}")
        print(f"{name}: the pilot chose {r['pilot']['value']:g}, clip {r['pilot']['clip']}, mixed chunk "
              f"{r['pilot']['mixed_chunk']}: {r['pilot']['reason']}")
        print(f"{name}: chosen vs default {r['chosen_vs_default']:.3f}x"
              + (f", vs baseline {r['chosen_vs_baseline']:.3f}x" if r["chosen_vs_baseline"] else ""))
        if r["chosen_vs_unmixed"]:
            print(f"{name}: chosen vs chosen less {MIXED_FLAG} {r['chosen_vs_unmixed']:.3f}x"
                  + (f"; unmixed vs baseline {r['unmixed_vs_baseline']:.3f}x" if r["unmixed_vs_baseline"] else ""))
    print(f"met: {res['met']}\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
