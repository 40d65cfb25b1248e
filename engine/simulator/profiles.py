"""What each real SGLang version does differently, one row per version (`--sim-sglang-version`).

Every per-version behaviour of the simulator is read from a `Profile` here, never from a version
string compared in place, so a behaviour added later (the contract's section 7.6) is one field and
one value per row. Each field names where the version was read (shared/reference/sglang_contract.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.simulator.kv_budget import SchedulingDefaults


@dataclass(frozen=True)
class Profile:
    version: str  # the --sim-sglang-version value
    reported_version: str  # "version" in /get_server_info (the simulator adds "+sim": a PEP 440 local version, so a client that parses it still can)
    # internal_states[i]["effective_max_running_requests_per_dp"]: the scheduler's working batch size
    # (0.5.10 managers/scheduler.py:3079; 0.5.23 scheduler_components/internal_state.py:73; absent in 0.5.5)
    reports_effective_max_running: bool
    # /model_info and /server_info, the old /get_* paths kept as aliases (0.5.10+; 0.5.5 has only /get_*)
    new_info_paths: bool
    # /model_info also names the served model, load format and parsers (0.5.23)
    model_info_names_server: bool
    warmup_info_path: str  # what the warmup thread polls before its first /generate (contract 1.2)
    # streaming /generate: output_ids only the new ids per chunk (0.5.5 tokenizer_manager.py:1533-1541) or
    # cumulative (0.5.10+, unless --incremental-streaming-output; contract 2.4 and 7.6)
    stream_ids_cumulative: bool
    # the server flag that makes streamed text and ids deltas: --incremental-streaming-output from 0.5.10
    # (--stream-output its deprecated alias); 0.5.5 has only --stream-output (contract 1.1)
    has_incremental_streaming_flag: bool
    # meta_info's retraction count: total_retractions up to 0.5.10, num_retractions in 0.5.23
    # (0.5.23 tokenizer_manager.py:2512; contract 2.3 lists 0.5.10 with the old name)
    retractions_key: str
    # meta_info.reasoning_tokens: absent in 0.5.5, present from 0.5.10 (contract 2.3 and 7.6)
    reports_reasoning_tokens: bool
    # a second in-flight request with the same rid: HTTP 400 from 0.5.10; 0.5.5 overwrites the earlier
    # one's state silently, whose client then never gets an answer (0.5.5 tokenizer_manager.py:938; contract 7.4)
    refuses_duplicate_rid: bool
    # repetition_penalty in (0, 2] from 0.5.12 (0.5.12 sampling/sampling_params.py:142, 0.5.23 :275); [0, 2] before
    # (0.5.10 :127); engine.config.schema.SAMPLING_VERSION_RANGES holds the same rows for the config checks
    repetition_penalty_excludes_zero: bool
    # --enable-priority-scheduling exports every scheduler gauge under priority="" (the total) and per
    # priority (0.5.23 observability/metrics_collector.py:1413-1430; contract 7.5)
    priority_labelled_metrics: bool
    # a streamed request's error event: {"error": {"message"}} (0.5.5), plus type/code/retryable (0.5.23; contract 2.4)
    stream_error_details: bool = False
    # admission adds a page of allocator overhead to the fit check (0.5.23 schedule_policy.py:733-737, :1404-1412;
    # not 0.5.10 :754-757 nor 0.5.5 :572-575) and to the reservation (0.5.10 :518-527; not 0.5.5 :434-440)
    admission_page_in_check: bool = False
    admission_page_in_reserve: bool = False
    # sglang:num_retracted_requests_total and its input/output token counters (0.5.10
    # observability/metrics_collector.py:290-310; 0.5.23 :552-572); 0.5.5 has only the gauge (metrics/collector.py:312)
    retraction_counters: bool = False
    # the retraction line names #new_tokens_gained (0.5.10 scheduler.py:2600; 0.5.23 :4530; not 0.5.5 :1958-1962)
    retract_log_tokens_gained: bool = False
    # --enable-mixed-chunk: a mixed step's decode rows first check that their tokens fit the pool after the
    # prefill's, and sit the step out when not (0.5.23 scheduler.py:4390-4393, check_decode_mem); 0.5.5 (:1872-1885)
    # and 0.5.10 (:2525-2540) mix them regardless (a shortfall there is SGLang's "Decode out of memory" error,
    # 0.5.5 mem_cache/common.py:408, which the simulator does not model: it mixes them)
    mixed_decode_fit_check: bool = False
    # the scheduler's SGLANG_* defaults (each version's srt/environ.py; kv_budget.ENV_FIELDS); the same so far
    scheduling: SchedulingDefaults = field(default_factory=SchedulingDefaults)


PROFILES: dict[str, Profile] = {p.version: p for p in (
    Profile(version="0.5.5", reported_version="0.5.5.post3", reports_effective_max_running=False,
            new_info_paths=False, model_info_names_server=False, warmup_info_path="/get_model_info",
            stream_ids_cumulative=False, has_incremental_streaming_flag=False, retractions_key="total_retractions",
            reports_reasoning_tokens=False, refuses_duplicate_rid=False, repetition_penalty_excludes_zero=False,
            priority_labelled_metrics=False, admission_page_in_check=False, admission_page_in_reserve=False,
            retraction_counters=False, retract_log_tokens_gained=False),
    Profile(version="0.5.10", reported_version="0.5.10", reports_effective_max_running=True,
            new_info_paths=True, model_info_names_server=False, warmup_info_path="/get_model_info",
            stream_ids_cumulative=True, has_incremental_streaming_flag=True, retractions_key="total_retractions",
            reports_reasoning_tokens=True, refuses_duplicate_rid=True, repetition_penalty_excludes_zero=False,
            priority_labelled_metrics=False, admission_page_in_check=False, admission_page_in_reserve=True,
            retraction_counters=True, retract_log_tokens_gained=True),
    Profile(version="0.5.23", reported_version="0.5.23", reports_effective_max_running=True,
            new_info_paths=True, model_info_names_server=True, warmup_info_path="/model_info",
            stream_ids_cumulative=True, has_incremental_streaming_flag=True, retractions_key="num_retractions",
            reports_reasoning_tokens=True, refuses_duplicate_rid=True, repetition_penalty_excludes_zero=True,
            priority_labelled_metrics=True, stream_error_details=True, admission_page_in_check=True,
            admission_page_in_reserve=True, retraction_counters=True, retract_log_tokens_gained=True,
            mixed_decode_fit_check=True),
)}
DEFAULT_VERSION = "0.5.23"  # the newest


def profile_for(version: str) -> Profile:
    """The profile of `version`; a ValueError that lists the known ones otherwise."""
    try:
        return PROFILES[version]
    except KeyError:
        raise ValueError(f"--sim-sglang-version {version}: not a simulated SGLang version; known: "
                         + ", ".join(PROFILES)) from None
