"""The simulator's admission, retraction and new-token ratio, rule by rule against SGLang's source.

Expected numbers are worked by hand from SGLang's formulas; each test names the release file:line it models.
"""
from __future__ import annotations

import io
from pathlib import Path

import pytest

from engine.simulator.config import parse_args
from engine.simulator.generator import OutputPlan
from engine.simulator.kv_budget import AdmissionRules, SchedulingDefaults, TokenRatio
from engine.simulator.kv_policy import admit, prepare_decode
from engine.simulator.profiles import PROFILES
from engine.simulator.request import RequestState, SimRequest
from engine.simulator.scheduler import Scheduler
from engine.simulator.sglang_check import check_installed, differences, read_defaults
from engine.simulator.simlog import SimLog


def scheduler(pool: int, version: str = "0.5.23", **kw) -> Scheduler:
    return Scheduler(log=SimLog(err=io.StringIO(), out=io.StringIO()), metrics=None, max_running=64,
                     max_total_tokens=pool, max_prefill_tokens=16384, step_ms=0, step_ms_per_req=0, tokens_per_step=1,
                     prefill_ms_per_1k=0, decode_log_interval=40, on_finish=lambda req: None,
                     profile=PROFILES[version], **kw)


def queue(sch: Scheduler, rid: str, prompt: int, max_new: int, planned: int | None = None) -> SimRequest:
    plan = OutputPlan(output_ids=[7] * (planned or max_new), finish_reason={"type": "length"}, reasoning_tokens=0)
    req = SimRequest(rid=rid, prompt_ids=list(range(1000 * len(sch.waiting) + 1000 * len(sch.running),
                                                    1000 * len(sch.waiting) + 1000 * len(sch.running) + prompt)),
                     plan=plan, max_new_tokens=max_new, state=RequestState.WAITING)
    sch.waiting.append(req)
    return req


def prefill(sch: Scheduler) -> list[SimRequest]:
    admitted, _ = admit(sch)
    sch._complete_prefill(admitted)
    return admitted


def decode(sch: Scheduler, steps: int = 1) -> None:
    for _ in range(steps):
        prepare_decode(sch)
        sch._complete_decode()


# --- rule 1: --schedule-conservativeness and the clip from the environment ---------------------------------------
def test_the_ratio_starts_from_the_conservativeness_as_sglang_computes_it():
    # 0.5.23 managers/scheduler_components/new_token_ratio_tracker.py:20-32 (0.5.5 scheduler.py:481-493):
    # init = min(0.7 x c, 1), min = min(init x 0.14, 1), decay = (init - min) / 600
    one = TokenRatio.from_defaults(SchedulingDefaults(), 1.0)
    assert (one.init, one.min) == pytest.approx((0.7, 0.098))  # 0.7 x 0.14 = 0.098
    assert one.decay == pytest.approx(0.602 / 600)  # (0.7 - 0.098) / 600 = 0.0010033
    two = TokenRatio.from_defaults(SchedulingDefaults(), 2.0)
    assert (two.init, two.min) == pytest.approx((1.0, 0.14))  # min(1.4, 1) = 1; 1 x 0.14
    half = TokenRatio.from_defaults(SchedulingDefaults(), 0.5)
    assert (half.init, half.min, half.current) == pytest.approx((0.35, 0.049, 0.35))  # 0.35 x 0.14 = 0.049


def test_the_cli_accepts_schedule_conservativeness_as_sglang_does(tmp_path: Path, capsys):
    # --schedule-conservativeness FLOAT, default 1.0 (0.5.5 server_args.py:2194-2197); >= 0 (validation_hook.py:314)
    assert parse_args(["--model-path", str(tmp_path)]).schedule_conservativeness == 1.0
    assert parse_args(["--model-path", str(tmp_path), "--schedule-conservativeness", "0.3"]
                      ).schedule_conservativeness == 0.3
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tmp_path), "--schedule-conservativeness", "-1"])
    assert "schedule_conservativeness must be non-negative" in capsys.readouterr().err


def test_the_clip_is_read_from_sglangs_environment_variable():
    # CLIP_MAX_NEW_TOKENS = int(os.environ.get("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION", "4096"))
    # (0.5.23 managers/schedule_policy.py:89-91, srt/environ.py:650; 0.5.5 schedule_policy.py:41-42)
    assert SchedulingDefaults().with_env({}).clip_max_new_tokens == 4096
    defaults = SchedulingDefaults().with_env({"SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "1000",
                                             "SGLANG_INIT_NEW_TOKEN_RATIO": "0.5"})
    assert (defaults.clip_max_new_tokens, defaults.init_new_token_ratio) == (1000, 0.5)
    sch = scheduler(100_000, scheduling=defaults)
    assert sch.rules.clip == 1000 and sch.ratio.current == 0.5


# --- rule 2: a new request reserves its clipped max_new_tokens in full, plus a page ------------------------------
def test_a_new_request_reserves_its_clipped_max_new_tokens_in_full_plus_a_page():
    # 0.5.23 schedule_policy.py:1404-1412 (check: extend + min(max_new - out, CLIP) + page, prefill_budget.py:128
    # strictly below the remaining budget) and :1344-1348, prefill_budget.py:156-167 (reserve extend + page + clip)
    rules = AdmissionRules(clip=4096, page_size=1, page_in_check=True, page_in_reserve=True)
    assert rules.need(extend=100, max_new=8000, generated=0) == 100 + 4096 + 1
    assert rules.reservation(extend=100, max_new=8000) == 100 + 1 + 4096
    # 0.5.5: no page in either (schedule_policy.py:572-575, :434-440); 0.5.10 a page in the reservation only (:518-527)
    assert AdmissionRules(page_in_check=False, page_in_reserve=False).need(100, 8000, 0) == 4196
    assert AdmissionRules(page_in_check=False, page_in_reserve=True).reservation(100, 8000) == 4197


def test_admission_stops_when_the_undiscounted_reservations_fill_the_pool():
    # pool 10,000; prompts of 100, max_new 4,000: each reserves 100 + 1 + 4,000 = 4,101 (0.5.23).
    # 1st: idle, taken (remaining 10,000 - 4,101 = 5,899); 2nd: 4,101 < 5,899 taken (remaining 1,798);
    # 3rd: 4,101 >= 1,798, NO_TOKEN. (Discounted by the ratio, 100 + 0.7 x 4,000 = 2,900 each, three would fit.)
    sch = scheduler(10_000)
    reqs = [queue(sch, f"r{i}", 100, 4000) for i in range(3)]
    assert prefill(sch) == reqs[:2]
    assert list(sch.waiting) == reqs[2:]


# --- rule 3: subtract, then clip --------------------------------------------------------------------------------
def test_a_running_request_counts_min_of_its_remaining_and_the_clip_times_the_ratio():
    # 0.5.23 schedule_policy.py:785-795, 0.5.5 :367-374: min(max_new - generated, CLIP) x ratio
    # max_new 5,000, 1,000 generated, ratio 0.5: min(4,000, 4,096) x 0.5 = 2,000 (clip first: (4,096 - 1,000) x 0.5
    # = 1,548)
    assert AdmissionRules(clip=4096).running_reserve(max_new=5000, generated=1000, ratio=0.5) == 2000
    # and the new request's check clips what is left: max_new 9,000 with 4,000 out -> min(5,000, 4,096) = 4,096
    assert AdmissionRules(clip=4096, page_in_check=False).need(extend=10, max_new=9000, generated=4000) == 10 + 4096


# --- rules 4 and 5: how much a retraction takes back, and the ratio after it --------------------------------------
def test_the_ratio_after_a_retraction_is_sglangs_estimate():
    # 0.5.23 new_token_ratio_tracker.py:40-49 (0.5.5 schedule_batch.py:1562-1570):
    # min(1, (sum output + 20 x kept) / (sum max_new_tokens unclipped + 1))
    assert TokenRatio.after_retract(300, 10_000, 2, 20) == pytest.approx(340 / 10_001)  # (300 + 40) / 10,001
    assert TokenRatio.after_retract(5_000, 100, 2, 20) == 1.0  # 5,040 / 101 > 1: capped


def four_running(pool_slack: int, version: str = "0.5.23") -> tuple[Scheduler, list[SimRequest]]:
    """Four running requests, prompts 1-4 tokens, 10 tokens out each; the pool then set to their KV + slack."""
    sch = scheduler(100_000, version)
    reqs = [queue(sch, f"r{i}", i + 1, 500) for i in range(4)]
    assert prefill(sch) == reqs  # the prefill gives each its first token
    decode(sch, 9)
    assert [sch.generated_running(r) for r in reqs] == [10] * 4
    assert sch.used_tokens() == (1 + 2 + 3 + 4) + 40  # 50
    sch.max_total_tokens = sch.used_tokens() + pool_slack
    return sch, reqs


@pytest.mark.parametrize("version", ["0.5.5", "0.5.10", "0.5.23"])
def test_a_retraction_takes_back_only_until_the_next_step_fits(version):
    # 0.5.23 schedule_batch.py:3451-3467 (0.5.10 :1950-1990, 0.5.5 :1503-1550): retract at least one, the least
    # advanced and among equals the longest prompt (:3542-3580), until the next step fits.
    # Used 50, pool 53: the next step needs 4 more (54 > 53). Retracting r3 (prompt 4, 10 out) frees 14: 36 + 3 = 39
    # <= 53, so one is retracted (20 steps of headroom would have taken three: 36 + 3 x 20 = 96 > 53, ...).
    sch, reqs = four_running(3, version)
    old = sch.ratio.current
    decode(sch)
    assert [r.rid for r in sch.waiting] == ["r3"] and reqs[3].resume_tokens == 10 and reqs[3].retractions == 1
    # ratio over the three kept, computed before their step: (3 x 10 + 20 x 3) / (3 x 500 + 1) = 90 / 1,501
    assert sch.ratio.current == pytest.approx((30 + 60) / 1501) and sch.ratio.current != old


def test_a_retraction_always_keeps_one_request():
    # "Always keep at least one request" (0.5.23 schedule_batch.py:3462-3464; 0.5.5 :1528-1545)
    sch, reqs = four_running(-30)
    decode(sch)
    assert list(sch.running) == [reqs[0]] and [r.rid for r in sch.waiting] == ["r3", "r2", "r1"]


# --- rules 6 and 7: decay on decode steps without a retraction only; reset when idle ------------------------------
def test_the_ratio_decays_only_on_decode_steps_that_retract_nothing_and_resets_when_idle():
    sch = scheduler(100_000)
    queue(sch, "a", 10, 50)
    prefill(sch)
    assert sch.ratio.current == pytest.approx(0.7)  # a prefill step: no decay (0.5.23 scheduler.py:4541-4542)
    decode(sch, 2)
    assert sch.ratio.current == pytest.approx(0.7 - 2 * 0.602 / 600)  # 0.697993
    sch2, _ = four_running(3)
    before = TokenRatio.after_retract(30, 1500, 3, 20)
    decode(sch2)  # the retracting step sets the ratio and does not decay it
    assert sch2.ratio.current == pytest.approx(before)
    sch._report_idle()  # idle: back to init (0.5.23 scheduler.py:5318; 0.5.5 scheduler_runtime_checker_mixin.py:251)
    assert sch.ratio.current == pytest.approx(0.7)


# --- rule 8: a prefill batch runs instead of a decode step ------------------------------------------------------
def test_a_prefill_step_advances_only_the_requests_it_admits():
    # 0.5.23 scheduler.py:3975-4005, 0.5.5 :1709-1728: "Run prefill first if possible", else decode
    sch = scheduler(100_000)
    a = queue(sch, "a", 10, 50)
    prefill(sch)
    decode(sch, 4)
    assert sch.generated_running(a) == 5  # 1 from its prefill + 4 decode steps
    b = queue(sch, "b", 10, 50)
    assert prefill(sch) == [b]
    assert (sch.generated_running(a), sch.generated_running(b), sch.step) == (5, 1, 4)
    assert sch.used_tokens() == 20 + 5 + 1
    decode(sch)
    assert (sch.generated_running(a), sch.generated_running(b)) == (6, 2)


# --- an installed sglang's defaults against the profile's --------------------------------------------------------
def fake_sglang(root: Path, clip: str) -> Path:
    srt = root / "sglang" / "srt"
    srt.mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("raise ImportError('the check must not import sglang')\n")
    (srt / "environ.py").write_text(
        "class Envs:\n    SGLANG_INIT_NEW_TOKEN_RATIO = EnvFloat(0.7)\n    SGLANG_RETRACT_DECODE_STEPS = EnvInt(20)\n"
        f"    SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION = EnvInt({clip})\n    SGLANG_OTHER = EnvBool(False)\n")
    return srt / "environ.py"


def test_an_installed_sglangs_defaults_are_compared_with_the_profiles(tmp_path: Path, monkeypatch):
    environ_py = fake_sglang(tmp_path, "2048")
    assert read_defaults(environ_py)["SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION"] == "2048"
    assert differences(read_defaults(environ_py), SchedulingDefaults()) == [
        "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: installed 2048, simulated 4096"]
    monkeypatch.syspath_prepend(str(tmp_path))
    line = check_installed(PROFILES["0.5.23"])
    assert line is not None and "differ: SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: installed 2048" in line


def test_a_matching_sglang_says_so_and_none_installed_says_nothing(tmp_path: Path, monkeypatch):
    assert check_installed(PROFILES["0.5.23"]) is None  # not in the venv
    fake_sglang(tmp_path, "4096")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = check_installed(PROFILES["0.5.5"])
    assert line is not None and "scheduler defaults match (simulated profile 0.5.5)" in line
