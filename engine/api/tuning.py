"""SGLang's --schedule-conservativeness as regen chose it for a run's servers: the choice, the /metrics evidence it
was made from and where it came from. The plan report, the run's record (engine/servers/tuning_record.py) and each
worker's event carry these; the rule itself is engine/servers/tuning_rule.py."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

from engine.api.wire import duration_text

SGLANG_DEFAULT = 1.0  # SGLang's own --schedule-conservativeness (0.5.23 srt/arg_groups/fields/schedule.py:139-142)


class TuningSource(StrEnum):
    """Where a server's --schedule-conservativeness came from."""
    OPERATOR_FLAG = "operator flag"  # --schedule-conservativeness in [workers] launch / extra_args: never overridden
    CONFIG = "run.toml"  # [workers] schedule_conservativeness = <number>: fixed, not tuned
    SGLANG_DEFAULT = "SGLang default"  # "auto" with nothing measured yet: SGLang's 1.0
    PILOT = "pilot"  # "auto", chosen by `regen plan --pilot` from the pilot servers' /metrics
    RESTART = "restart"  # "auto", changed at the server's restart from its own /metrics

    @property
    def tuned(self) -> bool:
        """regen chooses the value (and may change it at a restart)."""
        return self in (TuningSource.SGLANG_DEFAULT, TuningSource.PILOT, TuningSource.RESTART)


class TuningVerdict(StrEnum):
    """What the measured figures say limits the servers, and so which way the value goes."""
    LOWER = "lower"  # admission: token usage < 0.9 while requests queue (SGLang's guide: decrease it)
    RAISE = "raise"  # the pool: more than about one retraction a minute (SGLang's guide: increase it)
    KEEP = "keep"  # neither (or not enough readings to tell)


@dataclass
class TuningEvidence:
    """One server's /metrics over one window (a pilot, or one launch in a run)."""
    server: str
    source: str  # what was read: "pilot: gpu0 http://127.0.0.1:30000/metrics", "gpu0 /metrics since its launch"
    measured_at: float  # unix time of the last reading: the evidence's age is counted from it
    window_s: float  # from the first reading to the last
    readings: int
    queued_readings: int  # readings with #queue-req > 0
    low_usage_queued: int  # of those, token usage < 0.9 while the server ran less than its whole batch
    usage_queued: float | None  # mean token usage over the queued readings (None: none queued)
    mean_queue: float | None  # mean #queue-req over every reading (None: no reading)
    # requests the server retracted in the window (growth of sglang:num_retracted_requests_total); None: the server
    # exports no such counter (SGLang before 0.5.10): N/A, never 0
    retractions: float | None = None
    capped_queued: int = 0  # queued readings where the server ran its whole batch (max_running_requests): the cap held

    @property
    def retractions_per_min(self) -> float | None:
        """Per minute over the window, a window under a minute counted as one (two retractions in ten seconds are 2 a
        minute, not 12)."""
        if self.retractions is None:
            return None
        return self.retractions * 60.0 / max(self.window_s, 60.0)

    def text(self, now: float | None = None) -> str:
        """The figures with their source and age, one line (the plan, an alert's evidence)."""
        now = time.time() if now is None else now
        usage = "N/A (never queued)" if self.usage_queued is None else f"{self.usage_queued:.2f}"
        retracted = ("N/A (no sglang:num_retracted_requests_total: SGLang before 0.5.10)" if self.retractions is None
                     else f"{self.retractions:.0f} ({self.retractions_per_min or 0:.1f} a minute)")
        capped = f", {self.capped_queued} at the batch cap" if self.capped_queued else ""
        return (f"{self.server}: token usage {usage} while requests queued ({self.low_usage_queued} of "
                f"{self.queued_readings} queued readings under 0.9{capped}; {self.readings} readings), mean #queue-req "
                f"{self.mean_queue or 0:.1f}, retracted {retracted}; from {self.source} over "
                f"{duration_text(self.window_s)}, {duration_text(now - self.measured_at)} ago")


@dataclass
class AnswerTail:
    """The pilot's answer lengths against the clip its servers ran with (SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION): the
    tokens past the clip are what SGLang's reservation of a running request never counts."""
    clip: int
    answers: int
    p99: float
    past_clip: int  # answers longer than the clip
    past_clip_mean: float  # tokens past the clip, averaged over every answer (0 for the answers within it)


@dataclass
class TuningChoice:
    """The run's --schedule-conservativeness (and the clip env, where one is set), with why."""
    value: float | None  # what the servers are launched with (None: the operator's flag, whose value is no number)
    measured_at_value: float | None  # the value the evidence was measured at (None: no evidence)
    source: TuningSource
    verdict: TuningVerdict
    reason: str  # one sentence with the figures that decided it
    low: float  # [workers] conservativeness_min / conservativeness_max: the bounds of a tuned value
    high: float
    evidence: list[TuningEvidence] = field(default_factory=list)
    clip: int | None = None  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION given to the servers; None: not set by regen
    clip_reason: str = ""
    mixed_chunk: bool = False  # --enable-mixed-chunk added by regen to the servers' launch
    mixed_reason: str = ""
    config_key: str = ""  # what the evidence was measured on (engine/servers/tuning_record.py): another config's is ignored
    # the pilot's answers against the clip: a server's restart lowers no further than their tail allows either
    answer_tail: AnswerTail | None = None


@dataclass(frozen=True)
class LaunchTuning:
    """The --schedule-conservativeness (and clip env) a server's current launch runs with, where it came from and why:
    a host agent's identity record carries it to the dispatch host (engine/servers/identity_record.py), which shows it
    and records a restart's change as the run's (engine/servers/tuning.py)."""
    value: float | None  # None: the operator's flag with a value that is not a number
    source: TuningSource
    reason: str = ""
    clip: int | None = None  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION regen set; None: not set by regen
    floor: float | None = None  # the highest value it retracted too often at (engine.servers.tuning_record)
    mixed_chunk: bool = False  # --enable-mixed-chunk regen added
