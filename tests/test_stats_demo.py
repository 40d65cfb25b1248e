"""Issue 4's acceptance: on a `regen demo` run with a known share of empty and truncated
answers configured in the simulator, `regen stats --json` reports those shares exactly
(computed here independently, straight from the committed Parquet parts)."""
from __future__ import annotations

import json
import sqlite3

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tests.test_cli_run import cleanup_runs, regen  # noqa: F401  (fixture re-used)

SIM_EMPTY = "<think>\n\n</think>\n\nOK.<|im_end|>"  # the simulator's empty answer, byte for byte


@pytest.mark.slow
def test_stats_on_a_demo_run_report_the_configured_shares_exactly(tmp_path, cleanup_runs):  # noqa: F811
    run_dir = tmp_path / "demo"
    cleanup_runs.append(run_dir)
    sim = ["--sim-empty-share", "0.2", "--sim-output-mean", "700", "--sim-output-sigma", "1.0", "--sim-step-ms", "3"]
    r = regen("demo", "--quick", "--headless", "--until-done", "--gpus", "2", "--prompts", "300", "--run-dir", str(run_dir),
              *[f"--sim-arg={a}" for a in sim], home=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    with sqlite3.connect(f"file:{run_dir / 'state.sqlite'}?mode=ro", uri=True) as db:
        parts = [row[0] for row in db.execute("SELECT path FROM parts ORDER BY path")]
    table = pq.ParquetDataset([str(run_dir / p) for p in parts]).read(columns=["text", "finish_reason"])
    n = table.num_rows
    empty = pc.sum(pc.equal(table["text"], SIM_EMPTY)).as_py()
    truncated = pc.sum(pc.equal(table["finish_reason"], "length")).as_py()
    assert n > 300 and 0 < truncated < n and 0 < empty < n
    # the configured share, loosely (binomial spread over a few hundred samples)
    assert abs(empty / n - 0.2) < 0.08

    s = regen("stats", str(run_dir), "--json", home=tmp_path)
    assert s.returncode == 1, s.stderr  # 20% empty is above the 5% threshold: flagged
    report = json.loads(s.stdout)
    assert report["samples"] == n
    assert report["empty"] == {"count": empty, "share": empty / n}
    assert report["truncated"] == {"count": truncated, "share": truncated / n}
    assert any(f["key"] == "empty_share" for f in report["flags"])


def test_stats_on_a_qwen35_demo_count_cut_reasoning_as_unterminated(tmp_path, cleanup_runs):  # noqa: F811
    """`regen demo --template qwen3.5`: the prompt opens <think>, so no answer opens it again, the empty
    answer is `\\n</think>\\n\\nOK.<|im_end|>`, and an answer cut inside its reasoning is unterminated."""
    run_dir = tmp_path / "demo35"
    cleanup_runs.append(run_dir)
    sim = ["--sim-empty-share", "0.2", "--sim-output-mean", "1000", "--sim-output-sigma", "0.8",
           "--sim-step-ms", "1", "--sim-tokens-per-step", "64"]  # the demo's max_new_tokens (1024) cuts ~40%
    r = regen("demo", "--quick", "--headless", "--until-done", "--gpus", "1", "--prompts", "40", "--template", "qwen3.5",
              "--run-dir", str(run_dir), *[f"--sim-arg={a}" for a in sim], home=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    with sqlite3.connect(f"file:{run_dir / 'state.sqlite'}?mode=ro", uri=True) as db:
        parts = [row[0] for row in db.execute("SELECT path FROM parts ORDER BY path")]
    rows = pq.ParquetDataset([str(run_dir / p) for p in parts]).read(
        columns=["text", "finish_reason", "prompt_opened"]).to_pylist()
    assert rows and all(row["prompt_opened"] for row in rows)
    assert not [row["text"] for row in rows if "<think>" in row["text"]]
    empty = sum(row["text"] == "\n</think>\n\nOK.<|im_end|>" for row in rows)
    cut = sum(row["finish_reason"] == "length" and "</think>" not in row["text"] for row in rows)
    assert 0 < empty < len(rows) and 0 < cut < len(rows)

    s = regen("stats", str(run_dir), "--json", home=tmp_path)
    report = json.loads(s.stdout)
    assert report["samples"] == len(rows)
    assert report["empty"]["count"] == empty
    assert report["reasoning"]["unterminated"]["count"] == cut
    assert report["reasoning"]["missing"]["count"] == 0
    assert report["reasoning"]["present"]["count"] == len(rows) - cut
