"""The runaway guard end to end: simulated servers whose answers loop or are legitimately repetitive, streamed and
stopped through /abort_request, committed with exact ids; and a SIGKILL of the supervisor while streams are open."""
from __future__ import annotations

import random
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.config.load import RunConfig
from engine.simulator.generator import OutputGenerator, request_key
from engine.store.stats import compute_stats
from tests.run_helpers import (check_rows, events, make_config, quick_state, read_rows, sample_accounting, status,
                               wait_for)
from tests.run_helpers import renderer_for, supervisors  # noqa: F401  (fixtures)

MAX_NEW = 6000
SIM = ("--sim-output-mean", "600", "--sim-loop-share", "0.25", "--sim-repetitive-share", "0.2",
       "--sim-tokens-per-step", "16", "--sim-seed", "7")


def config(run_dir: Path, model: Path, sim: tuple = (), **changes) -> RunConfig:
    cfg = make_config(run_dir, model, sim=SIM + sim, **changes)
    return cfg.model_copy(update=dict(sampling=cfg.sampling.model_copy(update=dict(max_new_tokens=MAX_NEW))))


def generator(model: Path, cfg: RunConfig) -> OutputGenerator:
    """The simulator's own planner with the run's --sim-* values: what each rid was going to generate."""
    args = list(cfg.workers.extra_args)
    flag = lambda name, default: type(default)(args[len(args) - 1 - args[::-1].index(name) + 1]) \
        if name in args else default  # noqa: E731  (the last value given wins, as argparse does)
    return OutputGenerator(AutoTokenizer.from_pretrained(str(model)), seed=flag("--sim-seed", 0),
                           mean=flag("--sim-output-mean", 1024.0), sigma=flag("--sim-output-sigma", 1.0),
                           empty_share=0.0, abort_rate=0.0, loop_share=flag("--sim-loop-share", 0.0),
                           repetitive_share=flag("--sim-repetitive-share", 0.0))


def check_exact(rows: list[dict], gen: OutputGenerator, seed: int) -> dict[str, int]:
    """Every stored answer is what the simulator generated for its rid: whole when it finished, a prefix when the
    guard stopped it; loops are stopped (and early), nothing else is."""
    kinds = {"loop": 0, "repetitive": 0, "answer": 0, "stopped": 0}
    for r in rows:
        prompt = r["input_ids"][: r["prompt_len"]]
        out = r["input_ids"][r["prompt_len"]:]
        plan = gen.plan(request_key(seed, r["sample_id"], prompt), prompt, MAX_NEW)
        kinds[plan.kind] = kinds.get(plan.kind, 0) + 1
        assert out == plan.output_ids[: len(out)], f"{r['sample_id']}: stored ids are not what the server generated"
        if plan.kind == "loop":
            need = plan.loop_onset + max(1024, 8 * plan.loop_period)  # the cycle covers the span (defaults)
            if r["finish_reason"] == "length" and len(out) < MAX_NEW:
                # the server capped max_new_tokens to the context left: the guard sees the cycle only at a
                # stream chunk (runaway.stream_interval tokens) and its abort lands later still, so the cap
                # may come first (a later turn after a long one, 1,254 tokens left with the span at ~1,200)
                continue
            assert r["finish_reason"] == "repetition", f"{r['sample_id']}: a loop was not stopped"
            assert need <= len(out) < MAX_NEW, f"{r['sample_id']}: stopped at {len(out)} tokens, the span at {need}"
            # how soon after `need` the abort took effect depends on the machine's load: measured in
            # tests/bench/bench_runaway.py, never asserted here
            kinds["stopped"] += 1
        else:
            assert r["finish_reason"] != "repetition", f"{r['sample_id']} ({plan.kind}) was stopped as a runaway"
            # whole, unless the server capped max_new_tokens to the context left (a later turn after a long one)
            assert out == plan.output_ids or r["finish_reason"] == "length", \
                f"{r['sample_id']}: an answer that finished is not whole"
    return kinds


@pytest.mark.parametrize("sglang_version,incremental", [("0.5.23", False), ("0.5.23", True), ("0.5.5", False)])
def test_loops_are_stopped_with_exact_ids_and_legit_repetition_is_kept(tmp_path, tiny_model_dir, supervisors,
                                                                       renderer_for, sglang_version, incremental):
    """0.5.23 streams cumulative ids (and with --incremental-streaming-output only the new ones); 0.5.5 only the
    new ids, with the whole text."""
    run_dir = tmp_path / "run"
    sim = ("--sim-sglang-version", sglang_version) + (("--incremental-streaming-output",) if incremental else ())
    cfg = config(run_dir, tiny_model_dir, sim=sim, prompts=60)
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(240) == 0, sup.log_text()[-3000:]
    rows = read_rows(run_dir)
    renderer = renderer_for(cfg)
    check_rows(rows, cfg, renderer)  # ids, masks, texts, templates, histories built on stopped answers too
    kinds = check_exact(rows, generator(tiny_model_dir, cfg), seed=7)
    assert kinds["loop"] >= 5 and kinds["repetitive"] >= 5, kinds
    stopped = sum(r["finish_reason"] == "repetition" for r in rows)
    assert stopped == kinds["stopped"] >= 5
    # counted as truncations are: the store, the status, regen stats
    with sqlite3.connect(f"file:{run_dir / 'state.sqlite'}?mode=ro", uri=True) as db:
        assert db.execute("SELECT sum(repetition) FROM shards").fetchone()[0] == stopped
    st = status(run_dir)
    assert st is None or sum(sh["repetition"] for sh in st["shards"]) == stopped
    report = compute_stats(run_dir)
    assert report.repetition.count == stopped
    log = sup.log_text()
    assert "is a runaway (a " in log and "aborting it" in log
    assert "aborted: Aborted" not in log  # a stopped runaway's final abort chunk is never retried
    assert not any(r["finish_reason"] == "abort" for r in rows)
    server_log = "".join(p.read_text() for p in (run_dir / "workers").glob("*/server.log"))
    assert '"POST /abort_request HTTP/1.1" 200' in server_log
    # every server streams deltas: launched with its version's flag (once), so no stream was cumulative
    flag = "--stream-output" if sglang_version == "0.5.5" else "--incremental-streaming-output"
    launches = [line for line in server_log.splitlines() if "launching:" in line]
    assert launches and all(line.count(flag) == 1 for line in launches), launches
    if not incremental:
        assert f"launched with {flag} (SGLang {sglang_version}, from the simulator's --sim-sglang-version)" in log
    assert not [e for e in events(run_dir) if e["type"] == "alert" and e["key"].startswith("cumulative-stream")]


def test_guard_off_sends_plain_requests_and_lets_loops_run(tmp_path, tiny_model_dir, supervisors, renderer_for):
    run_dir = tmp_path / "run"
    cfg = config(run_dir, tiny_model_dir, prompts=20)
    cfg = cfg.model_copy(update=dict(runaway=cfg.runaway.model_copy(update=dict(enabled=False))))
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(240) == 0, sup.log_text()[-3000:]
    rows = read_rows(run_dir)
    check_rows(rows, cfg, renderer_for(cfg))
    gen = generator(tiny_model_dir, cfg)
    for r in rows:
        prompt = r["input_ids"][: r["prompt_len"]]
        plan = gen.plan(request_key(7, r["sample_id"], prompt), prompt, MAX_NEW)
        out = r["input_ids"][r["prompt_len"]:]
        assert out == plan.output_ids or (r["finish_reason"] == "length" and out == plan.output_ids[: len(out)])
        if plan.kind == "loop":
            assert r["finish_reason"] == "length"  # every loop ran to max_new_tokens (or the context left)
    assert not any(r["finish_reason"] == "repetition" for r in rows)
    assert "/abort_request" not in "".join(p.read_text() for p in (run_dir / "workers").glob("*/server.log"))


@pytest.mark.timeout(480)
def test_sigkill_while_streams_are_open_loses_and_duplicates_nothing(tmp_path, tiny_model_dir, supervisors,
                                                                      renderer_for):
    """Killed while answers stream (runaways among them, some stopped and committed, some mid-stream), restarted:
    every sample exactly once, the stopped ones exact."""
    run_dir = tmp_path / "run"
    cfg = config(run_dir, tiny_model_dir, sim=("--sim-step-ms", "6"), prompts=120, gpus=1)
    rng = random.Random(20261204)
    kills = 0
    for _ in range(3):
        sup = supervisors(run_dir).start(cfg if kills == 0 else None)
        wait_for(lambda: quick_state(run_dir) in ("running", "done") or sup.proc.poll() is not None,
                 90, "a running supervisor", sup)
        wait_for(lambda: ((status(run_dir) or {}).get("dispatch") or {}).get("in_flight", 0) > 4
                 or sup.proc.poll() is not None, 60, "streams open", sup)
        try:  # the kill lands at a random moment of the streams, unless the run ends first
            sup.proc.wait(timeout=rng.uniform(0.2, 1.5))
        except subprocess.TimeoutExpired:
            pass
        if sup.proc.poll() is not None:
            break
        sup.kill()
        kills += 1
    sup = supervisors(run_dir).start()
    assert sup.wait(300) == 0, sup.log_text()[-3000:]
    assert kills >= 2, "the run finished before the kills: make it longer"
    renderer = renderer_for(cfg)
    acc = sample_accounting(run_dir, cfg, renderer)
    assert acc["lost"] == 0, acc["lost_ids"]
    assert acc["duplicated"] == 0 and acc["unreadable_parts"] == 0
    rows = read_rows(run_dir)
    check_rows(rows, cfg, renderer)
    kinds = check_exact(rows, generator(tiny_model_dir, cfg), seed=7)
    assert kinds["stopped"] >= 5, kinds
