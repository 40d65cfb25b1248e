"""Bad input: a prompts file mixing malformed JSON, wrong shapes, empty and huge conversations,
invalid UTF-8 and duplicate ids. Every bad row lands in rejects.jsonl with its reason, every good
row is produced, and the counts show in `regen status --json` and on screen in `regen status`."""
from __future__ import annotations

import json

import pytest

from tests.run_helpers import (
    ctl, make_config, quick_state, read_rows, record_figures, rejects, sample_accounting, wait_for,
)
from engine.config.load import dump_toml
from tests.run_helpers import renderer_for  # noqa: F401  (fixture)
from tests.test_cli_run import cleanup_runs, regen  # noqa: F401  (fixture)


def _good(i: int) -> bytes:
    return json.dumps({"id": f"good-{i}", "messages": [{"role": "user", "content": f"question {i}?"}]}).encode()


# (line bytes, the reject kind expected for it)
BAD_ROWS: list[tuple[bytes, str]] = [
    (b'{"id": "bad-json", "messages": [{"role": "user", "content": "unterminated"', "malformed_json"),
    (b'{"id": "trailing-comma", "messages": [],}', "malformed_json"),
    (b'["a", "list", "not", "an", "object"]', "not_object"),
    (json.dumps({"id": "messages-string", "messages": "hello"}).encode(), "bad_conversation"),
    (json.dumps({"id": "no-content", "messages": [{"role": "user"}]}).encode(), "non_string_content"),
    (json.dumps({"id": "content-int", "messages": [{"role": "user", "content": 42}]}).encode(), "non_string_content"),
    (json.dumps({"id": "role-wizard", "messages": [{"role": "wizard", "content": "hi"}]}).encode(), "unknown_role"),
    (json.dumps({"id": "empty-conv", "messages": []}).encode(), "empty_conversation"),
    (json.dumps({"id": "only-system", "messages": [{"role": "system", "content": "be brief"}]}).encode(),
     "no_user_turn"),
    (b'{"id": "bad-utf8", "messages": [{"role": "user", "content": "caf\xc3 au lait"}]}', "invalid_utf8"),
    (json.dumps({"id": "good-1", "messages": [{"role": "user", "content": "the same id again"}]}).encode(),
     "duplicate_id"),
    # a huge conversation: 200 turns of long text, far over the 4096-token context
    (json.dumps({"id": "huge", "messages": [
        {"role": "user" if k % 2 == 0 else "assistant", "content": "word " * 400} for k in range(199)]}).encode(),
     "context_overflow"),
]


def write_bad_prompts(path) -> int:
    lines = []
    for i in range(12):
        lines.append(_good(i))
        if i < len(BAD_ROWS):
            lines.append(BAD_ROWS[i][0])
    lines.insert(5, b"")  # a blank line is not a row
    path.write_bytes(b"\n".join(lines) + b"\n")
    return 12


@pytest.mark.slow
def test_bad_rows_are_rejected_with_reasons_good_rows_produced_counts_shown(tmp_path, tiny_model_dir, cleanup_runs,
                                                                            renderer_for):
    run_dir = tmp_path / "run"
    prompts = tmp_path / "mixed prompts.jsonl"
    good = write_bad_prompts(prompts)
    cfg = make_config(run_dir, tiny_model_dir, prompts=1, gpus=1, sim=("--sim-output-mean", "40"))
    cfg = cfg.model_copy(update=dict(prompts=(str(prompts),), turns="last"))
    config_path = tmp_path / "run.toml"
    config_path.write_text(dump_toml(cfg))
    cleanup_runs.append(run_dir)
    started = regen("start", "local", "--config", str(config_path), "--no-preflight", home=tmp_path)
    assert started.returncode == 0, started.stdout + started.stderr
    wait_for(lambda: quick_state(run_dir) in ("running", "done"), 90, "running")
    paused = ctl(run_dir, "pause", "--all")  # hold the run so its status can be read while it lives
    st_json = regen("status", "local", "--run-dir", str(run_dir), "--json", home=tmp_path)
    st_text = regen("status", "local", "--run-dir", str(run_dir), home=tmp_path)
    if paused.returncode == 0:
        resumed = ctl(run_dir, "resume", "--all")
        # on a loaded machine the run can settle its last sample before the pause holds it: it then ends on
        # its own (a paused run with nothing left is done), and there is nothing to resume
        assert resumed.returncode == 0 or not (run_dir / "supervisor.pid").exists(), resumed.stderr
    wait_for(lambda: not (run_dir / "supervisor.pid").exists(), 120, "the supervisor to exit")
    assert "run done" in (run_dir / "supervisor.log").read_text()

    logged = rejects(run_dir)
    kinds = sorted(r["kind"] for r in logged)
    expected_kinds = sorted(k for _, k in BAD_ROWS)
    for r in logged:
        assert r["reason"] and r["file"] == str(prompts), r
        assert r["line"] is not None or r["kind"] == "context_overflow", r
    rows = read_rows(run_dir)
    produced = {r["conversation_id"] for r in rows}
    acc = sample_accounting(run_dir, cfg, renderer_for(cfg))
    assert st_json.returncode == 0, st_json.stderr
    counts = json.loads(st_json.stdout)["rejects"]
    record_figures("bad_input", bad_rows_tried=len(BAD_ROWS), rejected_with_reason=len(logged),
                   good_rows=good, good_rows_produced=len(produced & {f"good-{i}" for i in range(good)}),
                   status_json_rejects=counts["total"], kinds=dict(sorted(counts["by_reason"].items())),
                   samples_lost=acc["lost"], samples_duplicated=acc["duplicated"])
    assert kinds == expected_kinds, f"{kinds} != {expected_kinds}\n" + "\n".join(json.dumps(r) for r in logged)
    assert produced == {f"good-{i}" for i in range(good)}
    assert counts["total"] == len(BAD_ROWS)
    assert sum(counts["by_reason"].values()) == len(BAD_ROWS)
    assert st_text.returncode == 0, st_text.stderr
    overflow = sum(1 for _, k in BAD_ROWS if k == "context_overflow")  # a sample (turn), not an input row
    assert (counts["input_rows"], counts["samples_rejected"], counts["samples_failed"]) == (
        len(BAD_ROWS) - overflow, overflow, 0), counts
    assert (f"rejects {len(BAD_ROWS)} ({len(BAD_ROWS) - overflow} input rows, {overflow} sample rejected); "
            "rejects.jsonl rows by reason: ") in st_text.stdout, st_text.stdout
    for kind in set(expected_kinds):
        assert kind in st_text.stdout
