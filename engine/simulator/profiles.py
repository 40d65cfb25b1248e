"""What each real SGLang version does differently, one row per version (`--sim-sglang-version`).

Every per-version behaviour of the simulator is read from a `Profile` here, never from a version
string compared in place, so a behaviour added later (the contract's section 7.6) is one field and
one value per row. Each field names where the version was read (shared/reference/sglang_contract.md).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    version: str  # the --sim-sglang-version value
    reported_version: str  # "version" in /get_server_info (the simulator adds "-sim")
    # internal_states[i]["effective_max_running_requests_per_dp"]: the scheduler's working batch size
    # (0.5.10 managers/scheduler.py:3079; 0.5.23 scheduler_components/internal_state.py:73; absent in 0.5.5)
    reports_effective_max_running: bool
    # /model_info and /server_info, the old /get_* paths kept as aliases (0.5.10+; 0.5.5 has only /get_*)
    new_info_paths: bool
    # /model_info also names the served model, load format and parsers (0.5.23)
    model_info_names_server: bool
    warmup_info_path: str  # what the warmup thread polls before its first /generate (contract 1.2)


PROFILES: dict[str, Profile] = {p.version: p for p in (
    Profile(version="0.5.5", reported_version="0.5.5.post3", reports_effective_max_running=False,
            new_info_paths=False, model_info_names_server=False, warmup_info_path="/get_model_info"),
    Profile(version="0.5.10", reported_version="0.5.10", reports_effective_max_running=True,
            new_info_paths=True, model_info_names_server=False, warmup_info_path="/get_model_info"),
    Profile(version="0.5.23", reported_version="0.5.23", reports_effective_max_running=True,
            new_info_paths=True, model_info_names_server=True, warmup_info_path="/model_info"),
)}
DEFAULT_VERSION = "0.5.23"  # the newest


def profile_for(version: str) -> Profile:
    """The profile of `version`; a ValueError that lists the known ones otherwise."""
    try:
        return PROFILES[version]
    except KeyError:
        raise ValueError(f"--sim-sglang-version {version}: not a simulated SGLang version; known: "
                         + ", ".join(PROFILES)) from None
