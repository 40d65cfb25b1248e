"""The reports the console reads: `regen stats` (RunStats, schema regen.stats/1) and `regen plan` (Plan, regen.plan/1).

The engine fills these types and prints them as JSON (to_dict); the console decodes that JSON back with from_dict
(engine.api.wire.decode: a malformed field is a WireError naming it). No report crosses to the console as a dict.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from engine.api.tuning import AnswerTail, TuningChoice, TuningEvidence
from engine.api.wire import Severity, decode

STATS_SCHEMA = "regen.stats/1"
PLAN_SCHEMA = "regen.plan/1"


# --- regen stats -------------------------------------------------------------------------------


@dataclass
class Count:
    count: int
    share: float  # of the samples it is counted over (0.0 when there are none)


@dataclass
class Distribution:
    count: int
    mean: float | None
    min: int | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: int | None


@dataclass
class HistogramBin:
    label: str  # "0", "1", "2-3", "4-7", ...
    low: int  # inclusive
    high: int  # inclusive
    count: int
    share: float


@dataclass
class LossMaskStats:
    distribution: Distribution
    histogram: list[HistogramBin]
    computed_from: str  # "output_len (checked against loss_mask, see integrity.mask_check)"


@dataclass
class CutStats:
    train_max_length: int
    supervised_tokens_total: int
    supervised_tokens_kept: int
    supervised_tokens_cut: int
    cut_share: float
    samples_cut: int  # samples with prompt_len + output_len > N (lose some supervision)
    samples_cut_share: float
    samples_unsupervised: int  # prompt_len >= N: lose all supervision
    samples_unsupervised_share: float


@dataclass
class GroupStats:
    name: str
    samples: int
    empty: Count
    truncated: Count
    aborted: Count
    mean_output: float | None
    output_tokens: int
    flagged: list[str] = field(default_factory=list)  # "empty", "truncated", "repetition" above the thresholds
    repetition: Count = field(default_factory=lambda: Count(0, 0.0))  # stopped by the runaway guard


@dataclass
class ShardStats(GroupStats):
    parts: int = 0
    total_conversations: int | None = None  # planned (shards table), None without state.sqlite
    paused: bool | None = None


@dataclass
class MaskCheck:
    mode: str  # full | sample | off
    parts_checked: int
    rows_checked: int
    mismatches: int


@dataclass
class IntegrityError:
    kind: str  # mask_sum | mask_length | mask_layout | mask_values | rows | sqlite_counts | missing_part | unreadable_part
    path: str
    detail: str


@dataclass
class Flag:
    key: str  # stable: "empty_share", "truncated_share", "integrity", "worker:<name>:empty_share", ...
    severity: Severity  # warning | error
    text: str
    value: float
    threshold: float | None


@dataclass
class PartsRead:
    listed_from: str  # "state.sqlite" | "glob"
    committed: int
    read: int
    rows: int
    uncommitted_ignored: int  # part files on disk that are not committed (in progress or crash leftovers)
    missing: list[str]


@dataclass
class Thresholds:
    """The shares above which a figure is flagged."""
    empty_share: float
    truncated_share: float
    repetition_share: float | None = None  # None: an engine from before the runaway guard


@dataclass
class NotGenerated:
    """Samples planned and settled without a row (state.sqlite outcomes); all 0 without state.sqlite."""
    rejected: int = 0
    failed: int = 0
    after_cut: int = 0  # of the rejected: later turns not generated after a cut turn (turns_after_cut = "stop")


@dataclass
class RunStats:
    run_dir: str
    generated_at: float
    elapsed_s: float
    parts: PartsRead
    notes: list[str]
    thresholds: Thresholds
    samples: int
    empty: Count
    truncated: Count
    aborted: Count
    # finish_reason "repetition": stopped by the runaway guard (0 from an engine before it)
    repetition: Count = field(default_factory=lambda: Count(0, 0.0), kw_only=True)
    reasoning: dict[str, Count]  # present | missing | unterminated
    loss_mask: LossMaskStats
    lengths: dict[str, Distribution]  # output | reasoning | prompt
    cut: CutStats
    by_source: list[GroupStats]
    by_worker: list[GroupStats]
    by_shard: list[ShardStats]
    mask_check: MaskCheck
    integrity_errors: list[IntegrityError]
    integrity_error_count: int
    flags: list[Flag]
    # samples rejected, failed, and of the rejected after_cut: only the kinds state.sqlite recorded ({} without it)
    not_generated: dict[str, int] = field(default_factory=dict)

    @property
    def quality_flagged(self) -> bool:
        return bool(self.flags)

    def not_generated_counts(self) -> NotGenerated:
        return NotGenerated(**{k: v for k, v in self.not_generated.items() if k in ("rejected", "failed", "after_cut")})

    def to_dict(self) -> dict[str, Any]:
        return {"schema": STATS_SCHEMA, **asdict(self)}

    @classmethod
    def from_dict(cls, data: Any, what: str = "stats report") -> RunStats:
        return decode(cls, data, what)


# --- regen plan --------------------------------------------------------------------------------


@dataclass
class Range:
    value: float
    low: float
    high: float
    basis: str  # "assumed" | "pilot: ..." | "measured"


@dataclass
class ShardPlan:
    conversations: int
    rejects: int
    rejects_by_reason: dict[str, int]
    samples_by_mode: dict[str, int]  # all | last | first
    turn_mode: str
    samples: int
    shard_size: int
    shards: int
    last_shard_conversations: int
    sources: dict[str, int]  # conversations per source
    user_turns: dict[int, int] = field(default_factory=dict)  # conversations by their number of user turns


@dataclass
class PromptTokens:
    conversations_sampled: int
    samples_sampled: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: int | None
    note: str


@dataclass
class PromptExample:
    where: str  # file:line of the conversation
    sample_id: str
    tokens: int


@dataclass
class ContextCheck:
    """The planned prompts against the context, before any server starts (engine.plan.context_check decides)."""
    context_length: int
    context_source: str  # where the context length was read
    input_limit: int  # prompts of this many tokens or more are refused
    max_new_tokens: int
    rows_read: int  # conversations read (every row of every prompt file)
    rendered: int  # prompts rendered for this check (a conversation's every planned turn)
    how: str  # which conversations were rendered
    over_limit: int  # rendered prompts at or over input_limit
    over_limit_at_least: bool  # the longest-by-characters rows were all over: more rows than those may be
    over_examples: list[PromptExample]  # the longest first
    capped: int  # rendered prompts under the limit whose room for the answer is below max_new_tokens
    capped_examples: list[PromptExample]
    longest: int | None  # the longest rendered prompt, in tokens


@dataclass
class FilesProjection:
    """The files the shards take: parts while a shard is generated, one file per shard once it is compacted."""
    shards: int  # files the run leaves: one per shard (shards/<id>/shard.parquet)
    samples_per_shard: float
    rows_per_part: Range  # at the projected rate: a part is cut every `cut_s` (or at part_max_rows)
    parts_per_shard: Range  # part files a shard has while it is generated, before its compaction
    cut_s: float
    basis: str


@dataclass
class Projection:
    output_tokens_per_sample: Range
    tokens_per_s_per_worker: Range
    total_output_tokens: Range
    gpu_hours: Range
    wall_hours: Range
    disk_bytes: Range
    bytes_per_prompt_token: float
    bytes_per_output_token: float
    bytes_per_token_basis: str
    disk_free_bytes: int | None
    disk_free_path: str
    disk_headroom_bytes: Range | None
    workers: int
    gpus_per_worker: int
    files: FilesProjection


@dataclass
class GuardProjection:
    """What the runaway guard ([runaway]) is expected to save: the output tokens (hence GPU time, at a full batch)
    that answers looping until max_new_tokens would have cost past the point where the guard stops them."""
    enabled: bool
    settings: str
    basis: str  # "pilot: ..." (the pilot's answers run through the detector) | "assumed: ..."
    answers: int  # judged (pilot answers; 0 when assumed)
    would_stop: int  # of them, stopped by the guard
    loop_share: float  # the share of answers looping (measured or assumed)
    tokens_saved_share: float  # of the output tokens generated without the guard
    gpu_hours_saved: Range


@dataclass
class CutPolicyProjection:
    """What turns_after_cut = "stop" saves: a conversation's turns after a cut one (length, or a runaway the guard
    stops) are not generated. With a cut share p per turn, a conversation of n turns skips
    sum_{k=1}^{n-1} (1 - (1 - p)^k) turns; GPU time saved in proportion to the samples (mean output per sample)."""
    policy: str  # the config's turns_after_cut
    basis: str  # "pilot: ..." | "no pilot: ..." | "turns = ...: no later turns are generated"
    cut_share: float | None  # of the pilot's answers: ended at max_new_tokens or a runaway (None: no pilot)
    later_turns: int  # samples after a conversation's first turn (what the policy can skip)
    skipped: float  # expected samples not generated under "stop" (0 when not estimated)
    skipped_share: float  # of the planned samples
    gpu_hours_saved: Range  # under "stop" (with "continue": what "stop" would save)


@dataclass
class PilotWorker:
    name: str
    url: str
    requests: int
    batch: int  # the server's batch size as discovered
    batch_source: str  # internal_states | log | server_info | flag | default
    in_flight: int  # requests kept in flight (batch + queue margin, or dispatch.max_in_flight_per_worker)
    batch_reached: int  # the batch the throughput was measured at: the most the server ran, at most `batch`
    completion_tokens: int
    full_batch_window_s: float
    tokens_per_s: float
    window_basis: str  # metrics (the server's num_running_reqs) | client (reconstructed from completions)


@dataclass
class PilotResult:
    requested: int  # N of --pilot N
    needed: int  # requests that fill every server's batch (sum of ROUNDS x in-flight)
    prompts: int  # requests sent
    workers: list[PilotWorker]
    output_mean: float
    output_p50: float
    output_p90: float
    output_max: int
    output_mean_ci: tuple[float, float]  # bootstrap 95%
    truncated_share: float
    wall_s: float
    log_dir: str
    finish_reasons: dict[str, int]
    output_p99: float | None = None  # None: an engine from before it
    # each pilot server's /metrics while the pilot ran (token usage, queue, retractions): what the tuning is chosen from
    evidence: list[TuningEvidence] = field(default_factory=list)
    answer_tail: AnswerTail | None = None  # the answers against the clip the pilot's servers ran with
    clip_tails: list[AnswerTail] = field(default_factory=list)  # against each lower clip regen may choose


@dataclass
class BrakeLevel:
    reason: str
    level: float
    alert: float | None  # its alert level in [alerts], where there is one
    judged: bool  # False: does not apply to this run (thinking_missing with enable_thinking = false)


@dataclass
class BrakePlan:
    """[brake] as `regen plan` prints it."""
    enabled: bool
    window: int
    min_samples: int
    levels: list[BrakeLevel]


@dataclass(frozen=True)
class SlurmHandover:
    """One planned hand-over of a [slurm] group (engine/placement/slurm/schedule.py): seconds from the run's first
    submission, on the plan's assumed queue wait and load time (regen measures both as it runs)."""
    group: int
    job: int  # the group's allocation that hands over: 0 for its first job
    time_limit_s: int  # that job's --time (a group's first one is staggered)
    submit_s: float  # the next job is submitted (lead: queue wait + load + margin before the switch)
    switch_s: float  # the next job's servers are proven: they join the router and this job's servers drain
    drain_s: float  # the latest drain: handover_s before the limit, whether or not the next job is ready
    limit_s: float  # this job's limit (Slurm ends it then, or up to its kill lag later, unless regen cancelled it)


@dataclass(frozen=True)
class SlurmPlan:
    """What `regen plan` says about a [slurm] run."""
    layout: str
    groups: int
    servers: int
    time_limit_s: int
    handover_s: int
    usable_s: int  # per allocation: time limit minus the hand-over
    projected_wall_s: float | None
    allocations: int | None  # consecutive allocations each group needs (None: no projection)
    sbatch: list[str]  # one line per group, shell-quoted
    srun: list[str]
    time_min_s: int | None = None  # [slurm] time_min: backfill may start a job with a limit down to this
    # when each group hands over (its first --time staggered so no two drain together), and the assumptions
    handovers: list[SlurmHandover] = field(default_factory=list)
    spacing_s: float = 0.0  # how far apart the groups' first limits are set
    assumed_queue_wait_s: float = 0.0
    assumed_load_s: float = 0.0


@dataclass
class Assumptions:
    """The config's [plan] figures, and whether the projection used them (no pilot)."""
    output_tokens_per_sample: float
    tokens_per_s_per_gpu: float
    loop_share: float
    used: bool


@dataclass
class SampledValue:
    value: Any  # a [sampling] key's effective value (number or string)
    source: str  # run.toml | the model's generation_config.json | regen's default


@dataclass
class Plan:
    config: str | None
    run_dir: str
    shard_plan: ShardPlan
    prompt_tokens: PromptTokens
    pilot: PilotResult | None
    projection: Projection
    assumptions: Assumptions
    notes: list[str] = field(default_factory=list)
    runaway: GuardProjection | None = None
    brake: BrakePlan | None = None  # the data-quality brake's settings ([brake])
    sampling: dict[str, SampledValue] = field(default_factory=dict)  # key -> its value and where it came from
    sampling_note: str = ""
    turns_after_cut: CutPolicyProjection | None = None
    slurm: SlurmPlan | None = None  # with [slurm]: the jobs regen submits and the allocations the run needs
    context: ContextCheck | None = None  # the prompts against the context (every row read)
    warnings: list[str] = field(default_factory=list)  # what the operator must see before starting (WARN lines)
    # the servers' --schedule-conservativeness: chosen from the pilot's /metrics, or what the run starts with
    tuning: TuningChoice | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"schema": PLAN_SCHEMA, **asdict(self)}

    @classmethod
    def from_dict(cls, data: Any, what: str = "plan report") -> Plan:
        return decode(cls, data, what)
