"""Server errors: 5xx bursts, aborted finish reasons, request timeouts, and prompts over the context.
Each is retried or recorded in rejects.jsonl with its reason, and the run completes."""
from __future__ import annotations


import pytest

from tests.run_helpers import events, make_config, read_rows, record_figures, rejects, sample_accounting
from tests.run_helpers import renderer_for, supervisors  # noqa: F401  (fixtures)


def _final_dispatch(run_dir) -> dict:
    return [e for e in events(run_dir) if e["type"] == "dispatch"][-1]


@pytest.mark.slow
def test_5xx_bursts_and_aborts_are_retried_and_the_run_completes(tmp_path, tiny_model_dir, supervisors,
                                                                 renderer_for):
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=60, gpus=1,
                      sim=("--sim-5xx-rate", "0.25", "--sim-abort-rate", "0.1", "--sim-seed", "7"))
    cfg = cfg.model_copy(update=dict(dispatch=cfg.dispatch.model_copy(update=dict(retry_backoff_s=0.05,
                                                                                   max_retries=8))))
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(150) == 0, sup.log_text()[-3000:]
    acc = sample_accounting(run_dir, cfg, renderer_for(cfg))
    final = _final_dispatch(run_dir)
    log_text = sup.log_text()
    http_503 = log_text.count(": HTTP 503:")
    aborted = log_text.count(": aborted:")
    record_figures("server_5xx_and_abort", faults_injected=http_503 + aborted, survived=int(final["state"] == "done"),
                   http_503_retried=http_503, aborts_retried=aborted, retried=final["retried"],
                   failed_after_retries=acc["failed_after_retries"], samples_lost=acc["lost"],
                   samples_duplicated=acc["duplicated"], parts_unreadable=acc["unreadable_parts"])
    assert final["state"] == "done"
    assert http_503 > 0 and aborted > 0, "the simulator injected no 503 or no abort"
    assert final["retried"] >= http_503 + aborted
    assert acc["lost"] == acc["duplicated"] == acc["unreadable_parts"] == 0
    rows = {r["finish_reason"] for r in read_rows(run_dir)}
    assert "abort" not in rows, "an aborted answer was stored as a sample"


@pytest.mark.slow
def test_request_timeouts_are_retried_or_recorded(tmp_path, tiny_model_dir, supervisors, renderer_for):
    run_dir = tmp_path / "run"
    # long-tailed answers at one token per 8 ms step: the longest take seconds, the timeout is 1.5 s
    cfg = make_config(run_dir, tiny_model_dir, prompts=30, gpus=1,
                      sim=("--sim-output-mean", "60", "--sim-output-sigma", "1.2", "--sim-tokens-per-step", "1",
                           "--sim-step-ms", "8"))
    cfg = cfg.model_copy(update=dict(dispatch=cfg.dispatch.model_copy(update=dict(request_timeout_s=1.5, max_retries=2,
                                                                                   retry_backoff_s=0.05))))
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(150) == 0, sup.log_text()[-3000:]
    acc = sample_accounting(run_dir, cfg, renderer_for(cfg))
    final = _final_dispatch(run_dir)
    timeouts = sup.log_text().count("TimeoutError")
    failed = [r for r in rejects(run_dir) if r["kind"] == "generation_failed"]
    record_figures("request_timeout", faults_injected=timeouts, survived=int(final["state"] == "done"),
                   retried=final["retried"], recorded_in_rejects=len(failed), samples_lost=acc["lost"],
                   samples_duplicated=acc["duplicated"], parts_unreadable=acc["unreadable_parts"])
    assert final["state"] == "done"
    assert timeouts > 0, "no request timed out: make the answers slower"
    assert acc["lost"] == acc["duplicated"] == 0
    for r in failed:  # what was given up is recorded with the cause
        assert "generation failed after 3 attempts" in r["reason"] and "TimeoutError" in r["excerpt"]


def test_prompt_longer_than_the_context_is_rejected_with_the_reason(tmp_path, tiny_model_dir, supervisors,
                                                                    renderer_for):
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=10, gpus=1)  # the demo prompts hold one 4600-token row
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(120) == 0, sup.log_text()[-3000:]
    over = [r for r in rejects(run_dir) if r["kind"] == "context_overflow"]
    record_figures("context_overflow", faults_injected=1, survived=1, recorded_in_rejects=len(over))
    assert len(over) == 1
    assert over[0]["conversation_id"] == "too-long" and "context_length 4096" in over[0]["reason"]
    acc = sample_accounting(run_dir, cfg, renderer_for(cfg))
    assert acc["lost"] == acc["duplicated"] == 0
