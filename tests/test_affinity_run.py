"""Prefix affinity end to end: a multi-turn run on 2 simulated workers keeps each conversation on one server, whose
radix cache then serves its prefix (the shards' worker and cached_tokens columns), and the figures reach status."""
from __future__ import annotations

import json

import pytest

from tests.bench.bench_affinity import figures, write_conversations
from tests.test_engine_run import make_config, read_rows, supervisors  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(180)


def test_a_conversations_turns_land_on_one_worker_and_its_cache_serves_their_prefix(tmp_path, tiny_model_dir,
                                                                                    supervisors):  # noqa: F811
    run_dir = tmp_path / "run"
    prompts = write_conversations(tmp_path / "conversations.jsonl", 24, seed=3)
    # more work than room, and answers slow enough (8 steps of 25 ms) that one server cannot finish the first turns
    # before the other is ready on a loaded machine
    cfg = make_config(run_dir, tiny_model_dir, gpus=2, sim=("--max-running-requests", "4", "--sim-step-ms", "25",
                                                            "--sim-output-mean", "200"))
    # most answers end at max_new_tokens here: their later turns are generated all the same (turns_after_cut
    # "continue"), since this test is about where a conversation's turns run
    # a hold of 2 s, not the default 0.5: this test is about where the turns go, not the hold's trade-off (a free slot
    # elsewhere against a cache hit); on a box loaded past its cores the owner's pull came late enough, at 0.5 s, for
    # 3 of 29 later turns to move (0.897)
    cfg = cfg.model_copy(update=dict(prompts=(str(prompts),), turns_after_cut="continue",
                                     sampling=cfg.sampling.model_copy(update=dict(max_new_tokens=64)),
                                     dispatch=cfg.dispatch.model_copy(update=dict(affinity_hold_s=2.0))))
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(150) == 0, sup.log_text()[-3000:]
    rows = read_rows(run_dir)
    assert len(rows) == len({r["sample_id"] for r in rows}) >= 24 * 3  # every turn once
    got = figures(rows, 0.0)
    assert got["later_turns_same_worker"] >= 0.9  # the common case: the server that has the prefix
    assert got["cached_of_reusable"] >= 0.8 and set(got["samples_per_worker"]) == {"gpu0", "gpu1"}
    events = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    last = {e["name"]: e for e in events if e["type"] == "worker"}
    assert sum(last[w]["cached_tokens"] for w in ("gpu0", "gpu1")) == got["cached_tokens"]
    assert sum(last[w]["prompt_tokens"] for w in ("gpu0", "gpu1")) == got["prompt_tokens"]
