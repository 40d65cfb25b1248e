"""turns_after_cut in a rehearsal on the simulator: with ~10% of answers cut at max_new_tokens, `stop` generates none
of the later turns of a conversation once a turn of it is cut, `continue` generates them all; the turns not generated
are counted the same in `regen status`, `regen stats`, rejects.jsonl and the run manifest, and survive a restart."""
from __future__ import annotations

import json
import sqlite3
import sys
from collections import defaultdict

import pytest

from console.host.deploy import LAUNCH_FILE
from engine.config.load import ConfigError, Sampling, config_from_dict
from tests.test_cli_run import regen
from tests.test_engine_run import REPO, SupervisorProc, make_config, read_rows

pytestmark = pytest.mark.timeout(400)

# the simulator's lengths are lognormal (mean 24, sigma 0.5 in FAST_SIM): ~10% of answers are over 40 tokens
MAX_NEW_TOKENS = 40
CUT = ("length", "repetition")


def _run(tmp_path, model, policy: str):
    run_dir = tmp_path / policy / "run"
    cfg = make_config(run_dir, model, prompts=240, turns_after_cut=policy)
    cfg = cfg.model_copy(update=dict(sampling=cfg.sampling.model_copy(update=dict(max_new_tokens=MAX_NEW_TOKENS))))
    sup = SupervisorProc(run_dir).start(cfg)
    try:
        assert sup.wait(240) == 0, sup.log_text()[-3000:]
    finally:
        sup.cleanup()
    # what `regen start` records: `regen status` runs the engine with this python
    (run_dir / LAUNCH_FILE).parent.mkdir(exist_ok=True)
    (run_dir / LAUNCH_FILE).write_text(json.dumps({"host_python": sys.executable, "engine_path": str(REPO),
                                                   "run_dir": str(run_dir)}))
    return run_dir, read_rows(run_dir)


def _after_cut(rows: list[dict]) -> tuple[set[str], set[str]]:
    """(conversations with a cut turn, sample ids of the committed turns after a cut turn of their conversation)."""
    by_conv: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_conv[r["conversation_id"]].append(r)
    cut_convs, later = set(), set()
    for cid, turns in by_conv.items():
        cut_at = min((r["turn"] for r in turns if r["finish_reason"] in CUT), default=None)
        if cut_at is not None:
            cut_convs.add(cid)
            later |= {r["sample_id"] for r in turns if r["turn"] > cut_at}
    return cut_convs, later


def _figures(run_dir, home) -> dict[str, int]:
    """Later turns not generated after a cut, as each place the operator reads reports them."""
    st = regen("status", "local", "--run-dir", str(run_dir), "--json", home=home)
    assert st.returncode in (0, 4), st.stderr
    status = json.loads(st.stdout)
    stats = regen("stats", str(run_dir), "--json", home=home)
    assert stats.returncode in (0, 1), stats.stderr
    stats_text = " ".join(regen("stats", str(run_dir), home=home).stdout.split())
    text = " ".join(regen("status", "local", "--run-dir", str(run_dir), home=home).stdout.split())
    rejects = [json.loads(line) for line in (run_dir / "rejects.jsonl").read_text().splitlines()]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    figures = {"status": status["dispatch"]["after_cut"],
               "status shards": sum(s["after_cut"] for s in status["shards"]),
               "status by reason": status["rejects"]["by_reason"].get("after_cut", 0),
               "stats": json.loads(stats.stdout)["not_generated"].get("after_cut", 0),
               "rejects.jsonl": sum(1 for r in rejects if r.get("kind") == "after_cut"),
               "manifest": manifest["counts"]["dropped"].get("after_cut", 0)}
    n = figures["status"]
    if n:
        assert f"({n} after a cut turn)" in text, text
        assert f"of which {n:,} later turns after a cut turn" in stats_text, stats_text
    return figures


def test_stop_generates_no_turn_after_a_cut_and_continue_generates_them_all(tmp_path, tiny_model_dir):
    stop_dir, stop_rows = _run(tmp_path, tiny_model_dir, "stop")
    cont_dir, cont_rows = _run(tmp_path, tiny_model_dir, "continue")
    first = [r for r in cont_rows if r["turn"] == 0]
    share = sum(r["finish_reason"] in CUT for r in first) / len(first)
    assert 0.04 <= share <= 0.2, f"{share:.0%} of first turns cut: the rehearsal wants ~10%"

    cut_convs, generated_after = _after_cut(cont_rows)
    assert generated_after, "continue: later turns of conversations with a cut turn are generated"
    _, stop_after = _after_cut(stop_rows)
    assert not stop_after, f"stop: turns generated after a cut turn: {sorted(stop_after)[:5]}"
    # the simulator's answer is a function of the sample id: the same turns are cut in both runs, and stop
    # settles exactly the turns continue generated after them
    stop_ids = {r["sample_id"] for r in stop_rows}
    assert stop_ids | generated_after == {r["sample_id"] for r in cont_rows}
    assert not stop_ids & generated_after

    expected = len(generated_after)
    assert _figures(stop_dir, tmp_path) == dict.fromkeys(
        ["status", "status shards", "status by reason", "stats", "rejects.jsonl", "manifest"], expected)
    assert set(_figures(cont_dir, tmp_path).values()) == {0}
    manifest = json.loads((stop_dir / "manifest.json").read_text())
    assert manifest["turns_after_cut"] == "stop"
    st = json.loads(regen("status", "local", "--run-dir", str(stop_dir), "--json", home=tmp_path).stdout)
    assert st["state"] == "done" and st["dispatch"]["done"] == st["dispatch"]["total"] == len(stop_rows)
    cont = json.loads(regen("status", "local", "--run-dir", str(cont_dir), "--json", home=tmp_path).stdout)
    assert st["dispatch"]["planned"] == cont["dispatch"]["planned"]
    assert st["dispatch"]["done"] + expected == cont["dispatch"]["done"] == len(cont_rows)

    # a restart keeps the decision, even after a crash between a cut turn's commit and the settling of the turns
    # after it (their outcomes are not in the store): nothing is generated again, the counts stay
    with sqlite3.connect(stop_dir / "state.sqlite") as db:
        assert db.execute("DELETE FROM outcomes WHERE reason='after_cut'").rowcount == expected
    db.close()
    sup = SupervisorProc(stop_dir).start()
    try:
        assert sup.wait(120) == 0, sup.log_text()[-3000:]
    finally:
        sup.cleanup()
    assert len(read_rows(stop_dir)) == len(stop_rows)
    assert _figures(stop_dir, tmp_path)["status"] == expected


def test_the_policy_is_checked_and_only_a_changed_one_changes_the_hash(tmp_path):
    base = {"run_dir": str(tmp_path / "r"), "model": "/m", "prompts": ["/p.jsonl"]}
    with pytest.raises(ConfigError, match=r"turns_after_cut: \"never\": must be one of 'stop' or 'continue'"):
        config_from_dict({**base, "turns_after_cut": "never"})
    default = config_from_dict(base)
    assert default.turns_after_cut == "stop"
    assert "turns_after_cut" not in default.content_fields(), "run dirs made before the key keep their hash"
    assert config_from_dict({**base, "turns_after_cut": "stop"}).content_hash() == default.content_hash()
    assert config_from_dict({**base, "turns_after_cut": "continue"}).content_hash() != default.content_hash()
    assert Sampling().max_new_tokens > MAX_NEW_TOKENS
