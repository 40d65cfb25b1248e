"""Fault: SIGKILL of the supervisor at 20 seeded random moments of a simulated run, restarted each time.

Nothing may be lost, duplicated or left unreadable: every expected sample ends up committed once
(or in rejects.jsonl with its reason), and every Parquet file on disk after each kill is whole.
"""
from __future__ import annotations

import random
import subprocess
import time

import pyarrow.parquet as pq
import pytest

from tests.run_helpers import assert_one_file_per_shard, check_rows, make_config, read_rows, record_figures, quick_state, sample_accounting, wait_for
from tests.run_helpers import renderer_for, supervisors  # noqa: F401  (fixtures)

KILLS = 20
SEED = 20261202


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_sigkill_supervisor_20_times_loses_nothing(tmp_path, tiny_model_dir, supervisors, renderer_for):
    run_dir = tmp_path / "run"
    # a small batch (4 running) so generation lasts long enough for most kills to land mid-dispatch
    # long enough that 20 rounds never finish it, short enough that the run left after them is short: kills land
    # up to 6 s after a start, which takes 1.5-3 s, and answers commit in parts of a few seconds, so the 20 rounds
    # commit few samples (23 of 320 on a quiet box); the run left takes ~25 s
    cfg = make_config(run_dir, tiny_model_dir, prompts=160, gpus=1,
                      sim=("--sim-output-mean", "100", "--sim-step-ms", "10", "--sim-tokens-per-step", "2",
                           "--max-running-requests", "4"))
    rng = random.Random(SEED)
    kills = unreadable_after_kill = 0
    moments, states_at_kill = [], []
    for _ in range(KILLS):
        round_started = time.monotonic()
        sup = supervisors(run_dir).start(cfg if kills == 0 else None)
        # every 4th kill lands mid-dispatch (after the state is running); the others at a moment after
        # the start, which on a loaded machine falls in startup, worker launch, loading or early dispatch
        mid_dispatch = kills % 4 == 3
        moment = rng.uniform(0.1, 2.0) if mid_dispatch else rng.uniform(0.3, 6.0)
        if mid_dispatch:
            wait_for(lambda: quick_state(run_dir) in ("running", "done") or sup.proc.poll() is not None,
                     90, "a running supervisor", sup)
        try:  # the kill lands at a random moment (the moment is what is tested), or the run ends first
            sup.proc.wait(timeout=moment)
        except subprocess.TimeoutExpired:
            pass
        if sup.proc.poll() is not None:
            assert sup.proc.returncode == 0, sup.log_text()[-3000:]
            break  # the run finished between kills
        states_at_kill.append(quick_state(run_dir).split(" ")[0])
        round_started = time.monotonic() - round_started
        print(f"kill {kills + 1}: {states_at_kill[-1]} after {round_started:.1f} s")
        sup.kill()
        kills += 1
        moments.append(("running+" if mid_dispatch else "start+") + f"{moment:.2f}s")
        for f in (run_dir / "shards").rglob("*.parquet"):
            try:
                pq.read_metadata(f)
            except Exception as exc:  # noqa: BLE001 - counted and shown
                print(f"after kill {kills}: unreadable {f}: {exc!r}")
                unreadable_after_kill += 1
    print(f"after {kills} kills: {sum(pq.read_metadata(f).num_rows for f in (run_dir / 'shards').rglob('*.parquet'))}"
          " samples committed")
    sup = supervisors(run_dir).start()
    assert sup.wait(180) == 0, sup.log_text()[-3000:]
    renderer = renderer_for(cfg)
    acc = sample_accounting(run_dir, cfg, renderer)
    check_rows(read_rows(run_dir), cfg, renderer)
    record_figures("supervisor_sigkill", faults_injected=kills, survived=int(acc["lost"] == acc["duplicated"] == 0),
                   samples_lost=acc["lost"], samples_duplicated=acc["duplicated"],
                   parts_unreadable=acc["unreadable_parts"] + unreadable_after_kill, samples_expected=acc["expected"],
                   samples_committed=acc["committed"], kill_moments_s=moments, states_at_kill=states_at_kill,
                   seed=SEED)
    assert kills == KILLS, f"the run finished after only {kills} kills: make it longer"
    assert acc["lost"] == 0, acc["lost_ids"]
    assert acc["duplicated"] == 0
    assert acc["unreadable_parts"] == 0 and unreadable_after_kill == 0
    assert_one_file_per_shard(run_dir)  # every shard compacted, whichever kill interrupted which compaction
