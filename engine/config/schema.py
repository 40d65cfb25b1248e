"""The run.toml schema (pydantic v2): every key, its type, default, range and meaning, and the rules between keys.
Over 500 lines on purpose: the one strict schema `regen config schema` and the config reference are generated from.

Strict: a string where a number, bool or list belongs is an error, never coerced, and an unknown key is an error.
Each field's docstring is its description; errors are worded by engine.config.errors.
"""
from __future__ import annotations

import hashlib
import json
import re
import shlex
import urllib.parse
from dataclasses import KW_ONLY, dataclass
from typing import Annotated, Any, Callable, Iterator, Literal, Sequence, TypeAlias, get_args

from annotated_types import GroupedMetadata
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, StrictBool,
                      StrictFloat, StrictInt, StrictStr, ValidationError, ValidatorFunctionWrapHandler, WithJsonSchema,
                      WrapValidator, model_validator)

DEFAULT_LAUNCH = (
    "{python} -m sglang.launch_server --model-path {model} --host {host} --port {port}"
    " --tp-size {tp} --enable-metrics"
)
SIMULATOR_LAUNCH = (
    "{python} -m engine.simulator --model-path {model} --host {host} --port {port}"
    " --tp-size {tp} --enable-metrics"
)
# SGLang reads a request's sampling_seed only on a server launched with this flag (contract 7.3); the probes
# keep their own copy (probes/context.py: they never import the engine)
DETERMINISTIC_FLAG = "--enable-deterministic-inference"

TurnMode = Literal["all", "last", "first"]
TurnsAfterCut = Literal["stop", "continue"]
PromptFormat = Literal["auto", "jsonl", "json", "parquet"]
NotifyFormat = Literal["generic", "slack", "discord", "ntfy"]
Severity = Literal["info", "warning", "error", "critical"]
RouterPolicy = Literal["cache_aware", "round_robin", "random", "power_of_two"]
RouterLink = Literal["ssh", "lan"]
TURN_MODES: tuple[str, ...] = get_args(TurnMode)
TURNS_AFTER_CUT: tuple[str, ...] = get_args(TurnsAfterCut)
PROMPT_FORMATS: tuple[str, ...] = get_args(PromptFormat)
NOTIFY_FORMATS: tuple[str, ...] = get_args(NotifyFormat)
SEVERITIES: tuple[str, ...] = get_args(Severity)  # AlertEvent.severity, least to most severe
ROUTER_POLICIES: tuple[str, ...] = get_args(RouterPolicy)
ROUTER_LINKS: tuple[str, ...] = get_args(RouterLink)


class ConfigRuleError(ValueError):
    """A rule between keys is broken; `problems` are (key path, message) pairs, each one line for the operator."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("\n".join(f"{key}: {text}" for key, text in problems))


def _range_check(low: float | None, high: float | None, low_open: bool, high_open: bool) -> Callable[[float], float]:
    def check(value: float) -> float:
        if value != value:  # NaN
            raise ValueError("must be a number, not nan")
        too_low = low is not None and (value <= low if low_open else value < low)
        too_high = high is not None and (value >= high if high_open else value > high)
        if too_low or too_high:
            raise ValueError(f"must be {_interval(low, high, low_open, high_open)}")
        return value
    return check


def _interval(low, high, low_open, high_open) -> str:
    """`in [0, 1]`, `> 0`: the words after "must be"."""
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    if low is None:
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


# A TOML number (integer or float, kept as written so the content hash of `1` stays that of `1`)
Real: TypeAlias = StrictInt | StrictFloat


@dataclass(frozen=True)
class Range(GroupedMetadata):
    """`Annotated[Real, Range(0, 1)]`: a number in range (never NaN), the range also in the JSON Schema. Pydantic
    expands it (annotated_types' grouped metadata) into its validator and its schema."""
    low: float | None = None
    high: float | None = None
    _: KW_ONLY
    low_open: bool = False
    high_open: bool = False

    def __iter__(self) -> Iterator[object]:
        schema: dict[str, Any] = {"type": "number"}
        if self.low is not None:
            schema["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            schema["exclusiveMaximum" if self.high_open else "maximum"] = self.high
        yield AfterValidator(_range_check(self.low, self.high, self.low_open, self.high_open))
        yield WithJsonSchema(schema)


def _one_or_many(value: Any) -> Any:
    return (value,) if isinstance(value, str) else value


# A TOML array: the list itself is taken as a tuple (frozen), its items stay strict
IntList = Annotated[tuple[Annotated[StrictInt, Field(ge=0)], ...], Field(strict=False)]
StrList = Annotated[tuple[StrictStr, ...], Field(strict=False)]
Seconds = Annotated[Real, Range(0, low_open=True)]


def _auto_or_number(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError:  # one line for the operator, not one per member of the union
        raise ValueError('must be "auto" or a number >= 0, e.g. 0.3') from None


AutoOrNumber = Annotated[Literal["auto"] | Annotated[Real, Range(0)], WrapValidator(_auto_or_number)]


class Section(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, use_attribute_docstrings=True,
                              allow_inf_nan=False, validate_default=False)


class Sampling(Section):
    """[sampling]: sent with every request (SGLang's /generate applies no model defaults). A key left out takes the
    model's own recommended value from its generation_config.json (temperature, top_p, top_k, min_p,
    repetition_penalty, as SGLang's OpenAI API does), else regen's default (Qwen3 thinking); `regen plan` prints
    each effective value and where it came from."""
    temperature: Annotated[Real, Range(0)] = 0.6
    """Sampling temperature; 0 is greedy (loops in long thinking answers)."""
    top_p: Annotated[Real, Range(0, 1, low_open=True)] = 0.95
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p, in (0, 1]."""
    top_k: Annotated[StrictInt, Field(ge=-1)] = 20
    """Sample among the k most likely tokens; -1 for all (SGLang refuses 0)."""
    min_p: Annotated[Real, Range(0, 1)] = 0.0
    """Drop tokens less likely than min_p times the most likely one, in [0, 1]."""
    max_new_tokens: Annotated[StrictInt, Field(ge=1)] = 32768
    """The longest answer, in tokens (Qwen3 thinking needs 32768); an answer cut here ends with finish_reason length."""
    presence_penalty: Annotated[Real, Range(-2, 2)] = 0.0
    """Penalty on tokens already present, in [-2, 2]."""
    repetition_penalty: Annotated[Real, Range(0, 2)] = 1.0
    """Multiplicative repetition penalty, in [0, 2]; 1 is none. SGLang 0.5.12 and later refuse 0 (their range is
    (0, 2]): judged against the servers' version by `regen config check` (a rehearsal names it) and by preflight
    (the host's installed sglang)."""
    seed: Annotated[StrictInt, Field(ge=0)] | None = None
    """Per-request sampling seed; needs workers launched with --enable-deterministic-inference."""

    @model_validator(mode="after")
    def _top_k_not_zero(self) -> Sampling:
        if self.top_k == 0:
            raise ConfigRuleError([("[sampling] top_k", "0 is refused by SGLang: write -1 (all tokens) or a k >= 1, "
                                                       "e.g. 20")])
        return self

    def as_sglang(self) -> dict[str, Any]:
        """Only keys SGLang's SamplingParams knows (unknown keys are a 400 in 0.5.23)."""
        params: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "max_new_tokens": self.max_new_tokens,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "skip_special_tokens": False,
        }
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        return params


# -- [sampling] ranges that differ between SGLang versions ---------------------------------------------------------
# Read from SamplingParams.verify() of each released wheel, sglang/srt/sampling/sampling_params.py:
#   repetition_penalty in [0, 2]: 0.5.5.post3 :122, 0.5.10 :127, 0.5.11 :142
#   repetition_penalty in (0, 2]: 0.5.12 :142 (the first), 0.5.13 :142, 0.5.16 :197, 0.5.23 :275
# Every other key regen sends has one range in all of them (temperature >= 0 and, from 0.5.16, finite, which the
# schema already asks; top_p (0, 1]; top_k -1 or >= 1; min_p [0, 1]; presence_penalty [-2, 2]). The schema's field
# keeps the widest range (a config is valid for some version); a known version narrows it here.


@dataclass(frozen=True)
class VersionRange:
    """The range an SGLang release (and every later one, until the next row of the same key) takes for a key."""
    key: str  # the [sampling] key
    since: tuple[int, int, int]  # the first release with this range
    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def allows(self, value: float) -> bool:
        return _range_allows(value, self.low, self.high, self.low_open, self.high_open)

    @property
    def words(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


def _range_allows(value: float, low: float, high: float, low_open: bool, high_open: bool) -> bool:
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    return above and below


SAMPLING_VERSION_RANGES: tuple[VersionRange, ...] = (
    VersionRange("repetition_penalty", (0, 0, 0), 0, 2),
    VersionRange("repetition_penalty", (0, 5, 12), 0, 2, low_open=True),
)
# a fix that is in range for every version, per key (the key's neutral value)
_SAMPLING_NEUTRAL = {"repetition_penalty": "1.0 (no penalty)"}


def sglang_version_tuple(text: str | None) -> tuple[int, int, int] | None:
    """`0.5.10.post1` -> (0, 5, 10); None when the text does not start with three numbers."""
    m = re.match(r"\s*v?(\d+)\.(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def version_range(key: str, version: tuple[int, int, int]) -> VersionRange | None:
    """The range `version` takes for `key` (None: the key's range does not depend on the version)."""
    rows = [r for r in SAMPLING_VERSION_RANGES if r.key == key and r.since <= version]
    return max(rows, key=lambda r: r.since) if rows else None


def sampling_version_problems(sampling: Sampling, version: str, how: str) -> list[tuple[str, str]]:
    """[sampling] values the SGLang `version` refuses (its servers would answer every request HTTP 400), each with
    the key, the value, the version, where the version was read (`how`) and the fix. [] for a version that cannot
    be parsed (`sglang_version_tuple` is None): the caller says that it could not judge."""
    parsed = sglang_version_tuple(version)
    if parsed is None:
        return []
    out = []
    for key in dict.fromkeys(r.key for r in SAMPLING_VERSION_RANGES):
        value, rng = getattr(sampling, key), version_range(key, parsed)
        if rng is None or rng.allows(value):
            continue
        first = ".".join(map(str, rng.since))
        out.append((f"[sampling] {key}", f"{value:g} is refused by SGLang {version} ({how}): from {first} on, SGLang "
                                         f"takes {rng.words}, so every request would fail with HTTP 400; fix: write "
                                         f"a value in {rng.words}, e.g. {_SAMPLING_NEUTRAL.get(key, 'its default')}"))
    return out


def sampling_version_warnings(sampling: Sampling) -> list[tuple[str, str]]:
    """Values valid for the schema that some SGLang versions refuse, for when the servers' version is not known
    yet (preflight reads it from the host): each with the versions that refuse it and the fix."""
    out = []
    for key in dict.fromkeys(r.key for r in SAMPLING_VERSION_RANGES):
        value = getattr(sampling, key)
        rows = sorted((r for r in SAMPLING_VERSION_RANGES if r.key == key), key=lambda r: r.since)
        refusing = [r for r in rows if not r.allows(value)]
        if not refusing:
            continue
        spans = []
        for r in refusing:
            later = next((n for n in rows if n.since > r.since), None)
            span = f"{'.'.join(map(str, r.since))} and later" if later is None else \
                f"{'.'.join(map(str, r.since))} to before {'.'.join(map(str, later.since))}"
            spans.append(f"SGLang {span} ({r.words})")
        out.append((f"[sampling] {key}", f"{value:g} is refused by " + ", ".join(spans) + ": preflight judges it "
                                         "against the host's installed sglang; a value every version takes: "
                                         f"{_SAMPLING_NEUTRAL.get(key, 'its default')}"))
    return out


def simulated_sglang_version(words: list[str]) -> str | None:
    """The SGLang version a simulator launch plays (its --sim-sglang-version, else the simulator's default), or None
    when the launch is not the simulator's: one that runs engine.simulator, or passes --sim-* flags (SGLang has none)."""
    if "engine.simulator" not in words and not any(w.startswith("--sim-") for w in words):
        return None
    for i, word in enumerate(words):
        if word == "--sim-sglang-version" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith("--sim-sglang-version="):
            return word.split("=", 1)[1]
    from engine.simulator.profiles import DEFAULT_VERSION

    return DEFAULT_VERSION


class Workers(Section):
    """[workers]: one SGLang server per group of tp_size GPUs on the supervisor's host."""
    gpus: IntList = (0,)
    """GPU indices, e.g. [0, 1, 2, 3]; consecutive runs of tp_size make one server each."""
    tp_size: Annotated[StrictInt, Field(ge=1, le=64)] = 1
    """Tensor-parallel size: GPUs per server."""
    base_port: Annotated[StrictInt, Field(ge=1, le=65535)] = 30000
    """The first server's port; server i listens on base_port + i."""
    host: StrictStr = "127.0.0.1"
    """Address the servers bind; SGLang binds to loopback unless the operator asks otherwise."""
    launch: StrictStr = DEFAULT_LAUNCH
    """The launch command template ({python}, {model}, {host}, {port}, {tp}); the simulator's for a rehearsal."""
    extra_args: StrList = ()
    """Extra launch arguments, one list item per word, e.g. ["--mem-fraction-static", "0.85"]."""
    env: dict[StrictStr, StrictStr] = Field(default_factory=dict)
    """Extra environment of every server, e.g. {SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN = "1"}."""
    api_key: StrictStr | None = None
    """The servers' --api-key, sent as a bearer token."""
    ready_timeout_s: Seconds = 1800.0
    """How long a server may take to load and answer before it counts as failed."""
    max_restarts: Annotated[StrictInt, Field(ge=0)] = 5
    """Restarts of a crashed or hung server before it is given up."""
    health_timeout_s: Annotated[Real, Range(1, low_open=True)] = 25.0
    """One /health check's wait; SGLang's /health takes at least 1 s (contract 7.4)."""
    health_failures: Annotated[StrictInt, Field(ge=1)] = 3
    """/health failures in a row that make a live server hung (killed, restarted)."""
    schedule_conservativeness: AutoOrNumber = "auto"
    """SGLang's --schedule-conservativeness for the servers: "auto" (SGLang's 1.0 until `regen plan --pilot` chooses
    one; changed at a server's restart as SGLang's tuning guide says, within conservativeness_min..max) or a fixed
    number. A --schedule-conservativeness in launch or extra_args is the operator's and is never overridden."""
    conservativeness_min: Annotated[Real, Range(0, low_open=True)] = 0.3
    """The lowest value "auto" chooses (SGLang's guide: "decrease it to a value like 0.3")."""
    conservativeness_max: Annotated[Real, Range(0, low_open=True)] = 1.3
    """The highest value "auto" chooses (SGLang's guide: "increase it to a value like 1.3"; above 1/0.7 it changes
    nothing, as SGLang caps its starting ratio 0.7 x value at 1)."""
    mixed_chunk: Literal["auto"] | StrictBool = "auto"
    """SGLang's --enable-mixed-chunk for the servers (a new request's prefill runs in the running batch's decode step
    instead of a step of its own): "auto" (added when `regen plan --pilot` finds admission holding requests back, the
    case where every finished answer's replacement is prefilled alone), true (always) or false (never). A
    --enable-mixed-chunk in launch or extra_args is the operator's."""

    @model_validator(mode="after")
    def _gpus_fit_groups(self) -> Workers:
        problems = gpu_list_problems("[workers]", self.gpus, self.tp_size, self.base_port)
        problems += conservativeness_problems(self)
        try:
            shlex.split(self.launch)
        except ValueError as exc:
            problems.append(("[workers] launch", f"cannot be split into words: {exc} (check its quotes)"))
        if problems:
            raise ConfigRuleError(problems)
        return self

    def groups(self) -> list[tuple[int, ...]]:
        """GPU groups, one SGLang server each: consecutive runs of tp_size GPUs."""
        return [tuple(self.gpus[i: i + self.tp_size]) for i in range(0, len(self.gpus), self.tp_size)]


CONSERVATIVENESS_FLAG = "--schedule-conservativeness"
MIXED_CHUNK_FLAG = "--enable-mixed-chunk"
CHUNKED_PREFILL_FLAG = "--chunked-prefill-size"


def operator_conservativeness(workers: Workers) -> str | None:
    """The value of a --schedule-conservativeness (or =VALUE) in the launch template or extra_args (the last one, as
    argparse takes it), as written; None when the operator's line has none."""
    return flag_value(launch_words(workers), CONSERVATIVENESS_FLAG)


def operator_mixed_chunk(workers: Workers) -> str | None:
    """Why regen adds no --enable-mixed-chunk of its own: the operator's line has the flag, or turns chunked prefill
    off (`--chunked-prefill-size -1`: SGLang then mixes nothing); None when neither."""
    words = launch_words(workers)
    if MIXED_CHUNK_FLAG in words:
        return f"{MIXED_CHUNK_FLAG} in [workers] launch / extra_args: the operator's"
    size = flag_value(words, CHUNKED_PREFILL_FLAG)
    if size is not None and size.lstrip("-").isdigit() and int(size) <= 0:
        return f"{CHUNKED_PREFILL_FLAG} {size} in [workers] launch / extra_args: chunked prefill is off, SGLang mixes nothing"
    return None


def flag_value(words: Sequence[str], flag: str) -> str | None:
    """The value of `flag VALUE` (or `flag=VALUE`) in a command line's words: the last one, as argparse takes it."""
    value = None
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            value = words[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def conservativeness_problems(w: Workers) -> list[tuple[str, str]]:
    out = []
    if w.conservativeness_min > w.conservativeness_max:
        out.append(("[workers] conservativeness_min", f"{w.conservativeness_min:g} is above conservativeness_max = "
                                                      f"{w.conservativeness_max:g}: set it at or below"))
    flag = operator_conservativeness(w)
    if flag is not None and w.schedule_conservativeness != "auto":
        out.append(("[workers] schedule_conservativeness", f"{w.schedule_conservativeness} and "
                                                           f"{CONSERVATIVENESS_FLAG} {flag} in launch / extra_args both "
                                                           "set it: keep one"))
    return out


def gpu_list_problems(where: str, gpus: tuple[int, ...], tp_size: int, base_port: int) -> list[tuple[str, str]]:
    problems = []
    if not gpus:
        problems.append((f"{where} gpus", "is empty: list at least one GPU index, e.g. [0]"))
    dup = sorted({g for g in gpus if gpus.count(g) > 1})
    if dup:
        problems.append((f"{where} gpus", f"lists GPU {', '.join(map(str, dup))} twice: each GPU runs one server"))
    if gpus and len(gpus) % tp_size:
        problems.append((f"{where} gpus", f"has {len(gpus)} GPUs, not a multiple of tp_size = {tp_size}: give "
                                          f"{tp_size} GPUs per server"))
    servers = max(1, len(gpus) // max(tp_size, 1))
    if base_port + servers - 1 > 65535:
        problems.append((f"{where} base_port", f"{base_port} + {servers} servers runs past port 65535"))
    return problems


class Dispatch(Section):
    """[dispatch]: how requests go to the servers. Operational (may change between restarts)."""
    max_in_flight_per_worker: Annotated[StrictInt, Field(ge=1)] | None = None
    """Requests in flight per server; unset: sized from the server's own capacity."""
    request_timeout_s: Seconds = 3600.0
    """One request's longest wait before it is retried."""
    max_retries: Annotated[StrictInt, Field(ge=0)] = 5
    """Retries of a request that failed (connection, 5xx, timeout) before its sample is failed."""
    retry_backoff_s: Annotated[Real, Range(0)] = 2.0
    """Wait before a retry, doubled each time."""
    affinity: bool = True
    """Prefix affinity: a conversation's next turn goes to the server that has its prefix cached."""
    affinity_hold_s: Annotated[Real, Range(0, 60)] = 0.5
    """How long a turn waits for the server that holds its prefix before any server takes it."""


class Alerts(Section):
    """[alerts]: the levels at which the run warns (the brake stops at its own, higher, levels)."""
    empty_share: Annotated[Real, Range(0, 1)] = 0.05
    """Alert when a shard's share of empty answers is above this."""
    truncated_share: Annotated[Real, Range(0, 1)] = 0.10
    """Alert when a shard's share of answers cut at max_new_tokens is above this."""
    disk_free_min_gb: Annotated[Real, Range(0)] = 20.0
    """Alert when the run dir's disk has less free space than this (GB)."""


class Runaway(Section):
    """[runaway]: the runaway guard (engine/run/runaway.py). Each answer is streamed while it is generated and
    stopped (SGLang's /abort_request) once its tail is degenerate repetition; the sample is committed with its exact
    ids and finish_reason "repetition". Operational (not in the content hash). Two signals, either stops the answer:
    cycle (the last max(min_span, min_repeats x p) tokens repeat one cycle of period p <= max_period exactly) and
    ngram (over the last ngram_window tokens, ngram_share of the informative n-grams already occurred in it)."""
    enabled: bool = True
    """Stream answers and stop degenerate repetition."""
    max_period: Annotated[StrictInt, Field(ge=1, le=4096)] = 512
    """The longest token cycle the cycle signal looks for."""
    min_repeats: Annotated[StrictInt, Field(ge=2, le=10**6)] = 8
    """Repeats of one cycle that stop an answer."""
    min_span: Annotated[StrictInt, Field(ge=2, le=10**7)] = 1024
    """Tokens a repeated cycle must cover at least."""
    ngram: Annotated[StrictInt, Field(ge=2, le=256)] = 12
    """n of the n-gram signal."""
    ngram_window: Annotated[StrictInt, Field(ge=64, le=10**6)] = 8192
    """Tokens the n-gram signal looks back over."""
    ngram_share: Annotated[Real, Range(0, 1, low_open=True)] = 0.9
    """Share of repeated informative n-grams that stops an answer; 1 turns the n-gram signal off."""
    check_every: Annotated[StrictInt, Field(ge=1, le=10**6)] = 512
    """The n-gram share is computed every this many tokens."""
    stream_interval: Annotated[StrictInt, Field(ge=1, le=10**6)] = 1024
    """Tokens per streamed chunk (SGLang's stream_interval). Servers are launched with their version's delta-streaming
    flag, so a chunk carries only its new ids; each chunk still costs the client a read, a parse and a detector pass,
    and a loop is stopped at most this many tokens late."""
    alert_share: Annotated[Real, Range(0, 1, low_open=True)] = 0.05
    """Alert when a shard's share of repetition-stopped answers is above this."""

    @model_validator(mode="after")
    def _window_over_ngram(self) -> Runaway:
        if self.ngram_window <= self.ngram:
            raise ConfigRuleError([("[runaway] ngram_window", f"{self.ngram_window} must be larger than ngram = "
                                                              f"{self.ngram} (defaults 8192 and 12)")])
        return self


class Brake(Section):
    """[brake]: the data-quality brake (engine.run.brake). When the share of one kind of bad answer over the last
    `window` committed samples is over its level, dispatch pauses run-wide until `regen resume --all`. Each level must
    be above its alert level in [alerts]; 1.0 never brakes on that kind. Operational (not in the content hash)."""
    enabled: bool = True
    """false turns the brake off."""
    window: Annotated[StrictInt, Field(ge=1)] = 500
    """Committed samples judged (run-wide, in commit order)."""
    min_samples: Annotated[StrictInt, Field(ge=1)] = 200
    """Samples the window must hold before it judges."""
    empty_share: Annotated[Real, Range(0, 1, low_open=True)] = 0.5
    """Brake when the share of empty answers is above this."""
    truncated_share: Annotated[Real, Range(0, 1, low_open=True)] = 0.5
    """Brake when the share of answers cut at max_new_tokens is above this."""
    thinking_missing_share: Annotated[Real, Range(0, 1, low_open=True)] = 0.5
    """Brake when the share of answers whose reasoning is missing or unclosed is above this (enable_thinking only)."""
    repetition_share: Annotated[Real, Range(0, 1, low_open=True)] = 0.5
    """Brake when the share of answers the runaway guard stopped is above this."""
    refused_share: Annotated[Real, Range(0, 1, low_open=True)] = 0.25
    """Brake when the share of samples the servers refused (HTTP 400) or failed (retries spent) is above this; a run
    refused run-wide (20 in a row for one reason, or most of the last 200) fails instead."""

    @model_validator(mode="after")
    def _window_holds_min(self) -> Brake:
        if self.min_samples > self.window:
            raise ConfigRuleError([("[brake] min_samples", f"{self.min_samples} is more than window = {self.window}: "
                                    "the window never holds that many samples, so the brake never judges; set "
                                    "min_samples <= window (defaults 200 and 500)")])
        return self


class Store(Section):
    """[store]: how finished answers become part files. Operational (not in the content hash). The age bound is the
    crash cost: a SIGKILL loses the answers finished in the last part_max_age_s, regenerated at the restart. Each
    shard, once finished, is compacted into one file. The rows bound caps a part's memory while it waits."""
    part_max_rows: Annotated[StrictInt, Field(ge=1)] = 256
    """Rows that close a part file. It also bounds how long one commit holds the engine's interpreter (the rows made
    into Arrow columns): at 1,024 rows the dispatch loop stalled long enough for the servers' own queues to run dry at
    each commit (tests/bench/bench_capacity.py: 82% full-batch share against 94% with 256)."""
    part_max_age_s: Seconds = 5.0
    """Seconds after which a part is committed however few rows it has (a crash loses at most this much)."""


class Metrics(Section):
    """[metrics]: the run's figures served to Prometheus by the supervisor (GET /metrics), derived from the same
    committed state as `regen status`. Operational (not in the content hash). A busy port does not stop the run: it
    is an alert, and `regen status` says why nothing is served."""
    enabled: bool = True
    """Serve the metrics endpoint; false: not served (`regen status` says so)."""
    host: Annotated[StrictStr, Field(min_length=1)] = "127.0.0.1"
    """Address the endpoint binds: loopback by default, like the servers; a scraper on another machine needs the
    host's address (or an SSH tunnel)."""
    # 9433: clear of the exporters a GPU host already runs (node_exporter 9100, NVIDIA's DCGM exporter 9400) and of
    # SGLang's own ports (servers 30000+, router 30500+, the router's metrics 29000 by default)
    port: Annotated[StrictInt, Field(ge=0, le=65535)] = 9433
    """Port of the endpoint (default clear of node_exporter's 9100 and the DCGM exporter's 9400); two runs on one
    host need two ports; 0: a free port the system picks (`regen status` says which)."""
    per_shard: bool = False
    """Also export each shard's done and to-generate samples (a `shard` label: one series per shard, 10,000 for a
    10^7-sample run); off, shards are counted by state."""


class PlanAssumptions(Section):
    """[plan]: what `regen plan` without --pilot assumes (printed as "assumed"); a pilot measures them."""
    output_tokens_per_sample: Annotated[Real, Range(0, low_open=True)] = 2000.0
    """Output tokens per sample."""
    tokens_per_s_per_gpu: Annotated[Real, Range(0, low_open=True)] = 1500.0
    """Output tokens per second per GPU (e.g. a 27B model at TP1 on one H100-class GPU)."""
    sample_conversations: Annotated[StrictInt, Field(ge=1)] = 2000
    """Conversations tokenized for the prompt-length figures."""
    loop_share: Annotated[Real, Range(0, 1)] = 0.02
    """Share of answers assumed to loop to max_new_tokens (what the runaway guard saves)."""


class NotifyConfig(Section):
    """[notify]: failures and the run's end sent from the host to a webhook and/or a command. Operational."""
    url: StrictStr | None = None
    """Webhook POSTed to (http or https)."""
    format: NotifyFormat = "generic"
    """Body of the webhook."""
    headers: dict[StrictStr, StrictStr] = Field(default_factory=dict)
    """Extra HTTP headers, e.g. {Authorization = "Bearer ..."}."""
    command: StrList = ()
    """argv run per notification (no shell): message JSON on stdin, REGEN_NOTIFY_* in its environment."""
    min_severity: Severity = "critical"
    """Alerts at or above it are sent."""
    run_end: bool = True
    """Also send the normal ends (done, drained, stopped); a failed end is always sent."""
    retries: Annotated[StrictInt, Field(ge=1)] = 3
    """Tries per notification and destination."""
    retry_backoff_s: Annotated[Real, Range(0)] = 2.0
    """Wait before the second try, doubled before each next one."""
    timeout_s: Seconds = 10.0
    """One try: the HTTP request, or the command's run."""
    max_per_minute: Annotated[StrictInt, Field(ge=1)] = 6
    """More in a minute are held and sent as one "N more alerts suppressed"."""
    dedupe_s: Annotated[Real, Range(0)] = 600.0
    """The same alert again within this is held the same way."""
    flush_timeout_s: Seconds = 10.0
    """At exit, the longest the supervisor waits for the last notifications."""

    @property
    def enabled(self) -> bool:
        return bool(self.url or self.command)

    @model_validator(mode="after")
    def _destinations(self) -> NotifyConfig:
        problems = []
        if self.url is not None:
            parsed = urllib.parse.urlsplit(self.url)
            if not self.url.strip():
                problems.append(("[notify] url", "is empty: give the webhook URL (https://...) or remove the key"))
            elif parsed.scheme not in ("http", "https"):
                problems.append(("[notify] url", f"{redact_url(self.url)!r}: the scheme must be http or https (got "
                                                 f"{parsed.scheme or 'none'!r}), e.g. https://ntfy.sh/my-topic"))
            elif not parsed.hostname:
                problems.append(("[notify] url", f"{redact_url(self.url)!r}: no host in the URL, e.g. "
                                                 "https://ntfy.sh/my-topic"))
        if "command" in self.model_fields_set and (not self.command or not self.command[0].strip()):
            problems.append(("[notify] command", f"{list(self.command)!r}: give the program and its arguments (argv, no "
                                                 'shell) as a non-empty list of strings, e.g. command = '
                                                 '["/usr/local/bin/page-oncall", "--team", "ml"]'))
        if problems:
            raise ConfigRuleError(problems)
        return self


def redact_url(url: str) -> str:
    """scheme://host/… : a webhook's path is often its secret (Slack, Discord, an ntfy topic)."""
    parsed = urllib.parse.urlsplit(url)
    tail = "/…" if parsed.path.strip("/") or parsed.query else ""
    return f"{parsed.scheme}://{parsed.netloc.rpartition('@')[2]}{tail}" if parsed.netloc else url[:12] + "…"


class Host(Section):
    """[[hosts]]: one GPU host of a multi-host run; its SGLang workers run under a host agent there."""
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]+$")]
    """The host's name in regen (letters, digits, - and _)."""
    address: Annotated[StrictStr, Field(min_length=1)]
    """"local" (the dispatch host itself), an ssh alias, or user@host[:port]."""
    gpus: IntList = (0,)
    """GPU indices on that host."""
    work_dir: StrictStr = "~/.regen-host"
    """Engine copy, agent pid/log and server logs on that host."""
    host_python: StrictStr = "python3"
    """Interpreter of the SGLang environment on that host."""
    tp_size: Annotated[StrictInt, Field(ge=1, le=64)] | None = None
    """Default: [workers] tp_size."""
    base_port: Annotated[StrictInt, Field(ge=1, le=65535)] | None = None
    """Default: [workers] base_port."""
    lan_address: StrictStr | None = None
    """With router.link = "lan": the address its workers bind and are reached at."""
    ssh_options: StrList = ()
    """Extra OpenSSH client options from the dispatch host, e.g. ["-F", "cfg"]."""

    @property
    def is_local(self) -> bool:
        return self.address == "local"

    def ssh_destination(self) -> list[str]:
        """`user@host:port` is not an ssh(1) destination: split the port into -p."""
        dest = self.address
        if dest.startswith("ssh://"):
            return [dest]
        head, _, port = dest.rpartition(":")
        if head and port.isdigit() and "]" not in port:
            return ["-p", port, head]
        return [dest]


class Router(Section):
    """[router]: SGLang's own router (`sglang-router`), started on the dispatch host in front of every worker of a
    multi-host run ([[hosts]])."""
    policy: RouterPolicy = "cache_aware"
    """The router's load-balancing policy."""
    port: Annotated[StrictInt, Field(ge=1, le=65535)] = 30500
    """The router's port on the dispatch host."""
    prometheus_port: Annotated[StrictInt, Field(ge=1, le=65535)] | None = None
    """The router's own metrics port; default: port + 1."""
    python: StrictStr | None = None
    """Interpreter that runs the router; default: host_python."""
    link: RouterLink = "ssh"
    """"ssh": SSH port forwards (workers stay on 127.0.0.1); "lan": workers bind each host's lan_address."""
    forward_base_port: Annotated[StrictInt, Field(ge=1, le=65535)] = 40000
    """Local ends of the SSH port forwards on the dispatch host."""
    extra_args: StrList = ()
    """Extra router arguments, one item per word."""
    ready_timeout_s: Seconds = 60.0
    """How long the router may take to answer."""
    host_lost_after_s: Seconds = 10.0
    """A host whose workers cannot be reached this long is lost."""


_TIME_LIMIT = re.compile(r"^(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)$")


def time_limit_seconds(text: str) -> int:
    """Slurm's --time format in seconds: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (ValueError otherwise)."""
    m = _TIME_LIMIT.match(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a Slurm time limit: write minutes (\"240\"), \"H:MM:SS\" (\"4:00:00\") or "
                         "\"D-HH:MM:SS\" (\"1-00:00:00\")")
    d, dh, dm, ds, m1, m2, m3 = (int(g) if g else None for g in m.groups())
    if d is not None and dh is not None:  # the pattern has no D without H
        seconds = d * 86400 + dh * 3600 + (dm or 0) * 60 + (ds or 0)
    elif m1 is not None and m2 is not None and m3 is not None:  # H:M:S
        seconds = m1 * 3600 + m2 * 60 + m3
    elif m1 is not None:  # M or M:S
        seconds = m1 * 60 + (m2 or 0)
    else:
        raise AssertionError(f"{text!r} matched the time-limit pattern in none of its forms")
    if seconds <= 0:
        raise ValueError(f"{text!r} is no time at all: give the allocation a time limit above 0")
    return seconds


def _time_limit(text: str) -> str:
    time_limit_seconds(text)
    return text


def _node_count(value: Any) -> Any:
    if isinstance(value, str):
        low, sep, high = value.partition("-")
        if not (sep and low.isdigit() and high.isdigit()):
            raise ValueError(f"{value!r} is neither a node count (2) nor a range (\"2-4\")")
        if not 1 <= int(low) <= int(high):
            raise ValueError(f"{value!r}: a range goes from at least 1 up, e.g. \"2-4\"")
    return value


class Slurm(Section):
    """[slurm]: the servers run on nodes a Slurm cluster allocates, not on [[hosts]]. `regen start` (on the login
    node) submits one job per server group (one node, or the nodes one server spans) with sbatch; each job runs
    regen's host agent on its nodes as a job step (srun); the supervisor and the router stay where `regen start`
    ran and reach the servers over the cluster network. `regen plan` prints the exact sbatch and srun lines."""
    partition: Annotated[StrictStr, Field(min_length=1)]
    """The partition (sbatch --partition) whose nodes have the GPUs."""
    account: StrictStr | None = None
    """The account charged (sbatch --account); unset: the user's default."""
    qos: StrictStr | None = None
    """The quality of service (sbatch --qos); unset: the account's default."""
    nodes: Annotated[Annotated[StrictInt, Field(ge=1)] | StrictStr, AfterValidator(_node_count)] = 1
    """Nodes of the run: a count (2), or a range ("2-4": regen submits for the most and the plan counts on the
    fewest). The same range in server groups is min_groups / max_groups: with them, leave nodes out."""
    min_groups: Annotated[StrictInt, Field(ge=1)] | None = None
    """Server groups (jobs) the plan counts on: its wall time and ETA assume this many. The run never waits for
    them: each group serves the moment its job runs. Below max_groups (an elastic run), fewer than min_groups
    granted for pending_alert_s is one warning, sent by [notify], until enough run again (a group above min_groups
    waiting for free nodes is no alert). Default 1. With max_groups, the group form of `nodes` (a group is one node,
    or the nodes one server spans)."""
    max_groups: Annotated[StrictInt, Field(ge=1)] | None = None
    """Server groups regen keeps submitted (an elastic run: each one Slurm grants is used, a lost one is submitted
    again). Default: min_groups."""
    gpus_per_node: Annotated[StrictInt, Field(ge=1, le=64)] = 8
    """GPUs asked of each node (sbatch --gres=gpu:N); [workers] tp_size of them make one server, or a server with
    tp_size above it spans tp_size / gpus_per_node nodes."""
    time_limit: Annotated[StrictStr, AfterValidator(_time_limit)] = "4:00:00"
    """Each allocation's time limit (sbatch --time), in Slurm's format: "240", "4:00:00", "1-00:00:00". A run
    longer than it goes on in the next allocation."""
    time_min: Annotated[StrictStr, AfterValidator(_time_limit)] | None = None
    """The shortest time limit a job may be started with (sbatch --time-min), in time_limit's format: Slurm's
    backfill may then start a job in an idle window shorter than time_limit, with a limit between the two (the
    hand-over comes handover_s before whatever limit the job got). Unset: every job asks for time_limit."""
    handover_s: Annotated[StrictInt, Field(ge=30)] = 300
    """Seconds before the time limit by which the job's servers are drained (requests in flight finish in it). regen
    submits the group's next job early enough (this run's measured queue wait and load time) that its servers are
    proven by then, moves the group onto them, and cancels the old job once drained; the groups' first limits are
    staggered so that no two hand over together (docs/slurm.md)."""
    pending_alert_s: Annotated[StrictInt, Field(ge=1)] = 600
    """Seconds a job may stay PENDING before regen raises one alert with Slurm's reason (Resources, Priority, ...),
    which [notify] sends whatever its min_severity; its start after that is said too."""
    constraint: StrictStr | None = None
    """Node features required (sbatch --constraint), e.g. "h100&ib"."""
    job_name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_.-]+$")] = "regen"
    """The jobs' name prefix in squeue; job i is <job_name>-<i>."""
    extra_args: StrList = ()
    """Extra sbatch arguments, one item per word, e.g. ["--exclusive", "--mem=0"]."""
    work_dir: StrictStr | None = None
    """Where the nodes' host agents keep their engine copy and logs (a filesystem the nodes share with the login
    node); default: <run_dir>/slurm."""

    @property
    def time_limit_s(self) -> int:
        return time_limit_seconds(self.time_limit)

    @property
    def time_min_s(self) -> int | None:
        return time_limit_seconds(self.time_min) if self.time_min is not None else None

    @property
    def node_range(self) -> tuple[int, int]:
        if isinstance(self.nodes, int):
            return self.nodes, self.nodes
        low, _, high = self.nodes.partition("-")
        return int(low), int(high)

    @property
    def by_groups(self) -> bool:
        """The range is given in server groups (min_groups / max_groups), not in nodes."""
        return self.min_groups is not None or self.max_groups is not None

    def group_range(self, nodes_per_group: int) -> tuple[int, int]:
        """(the groups the plan counts on, the groups regen keeps submitted): min_groups / max_groups, or `nodes`
        in groups of `nodes_per_group` nodes (at least one)."""
        if self.by_groups:
            low = self.min_groups or 1
            return low, self.max_groups or low
        low, high = self.node_range
        return max(1, low // nodes_per_group), max(1, high // nodes_per_group)


class RunConfig(Section):
    """run.toml: one run of regeneration. The content fields (model, tokenizer, prompts, prompt_format, turns,
    enable_thinking, shard_size, [sampling]) decide what the shards contain; a run dir with committed samples is
    resumed only with the same ones. Every other key is operational and may change between restarts."""
    run_dir: Annotated[StrictStr, Field(min_length=1)]
    """The run directory on the host (shards, state.sqlite, logs)."""
    model: Annotated[StrictStr, Field(min_length=1)]
    """The model directory (or name) the servers load."""
    prompts: Annotated[StrList, BeforeValidator(_one_or_many), Field(min_length=1)]
    """Prompt files or globs on the host (a list, or one string)."""
    host_python: StrictStr = "python3"
    """Interpreter of the SGLang environment on the host."""
    tokenizer: StrictStr | None = None
    """Tokenizer and chat template directory; default: model."""
    prompt_format: PromptFormat = "auto"
    """Prompt file format; auto decides by extension."""
    turns: TurnMode = "all"
    """Which user turns are answered: all (turn by turn on the model's own answers), last, or first."""
    turns_after_cut: TurnsAfterCut = "stop"
    """With turns = "all": once a turn ends at max_new_tokens or is stopped by the runaway guard, "stop" settles the
    conversation's later turns without generating them (rejected, kind after_cut); "continue" generates them on the
    cut history, as the model was prompted with it. A content field (in the hash only when not "stop")."""
    enable_thinking: bool = True
    """Passed to the chat template."""
    shard_size: Annotated[StrictInt, Field(ge=1)] = 1000
    """Conversations per shard."""
    context_length: Annotated[StrictInt, Field(ge=2)] | None = None
    """The servers' context length; default: the model config's."""
    sampling: Sampling = Field(default_factory=Sampling)
    workers: Workers = Field(default_factory=Workers)
    dispatch: Dispatch = Field(default_factory=Dispatch)
    alerts: Alerts = Field(default_factory=Alerts)
    plan: PlanAssumptions = Field(default_factory=PlanAssumptions)
    store: Store = Field(default_factory=Store)
    runaway: Runaway = Field(default_factory=Runaway)
    brake: Brake = Field(default_factory=Brake)
    hosts: Annotated[tuple[Host, ...], Field(strict=False)] = ()
    """[[hosts]]: GPU hosts of a multi-host run; empty: one host, the supervisor's own ([workers])."""
    router: Router = Field(default_factory=Router)
    slurm: Slurm | None = None
    """[slurm]: the servers' nodes come from a Slurm cluster (exclusive with [[hosts]])."""
    notify: NotifyConfig = Field(default_factory=NotifyConfig)
    metrics: Metrics = Field(default_factory=Metrics)
    _source_path: str | None = PrivateAttr(default=None)  # where it was loaded from (not part of the content)

    @property
    def source_path(self) -> str | None:
        return self._source_path

    def with_source(self, path: str | None) -> RunConfig:
        copy = self.model_copy()
        copy._source_path = path
        return copy

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    def content_fields(self) -> dict[str, Any]:
        """The fields whose change changes the data; resuming with another hash is refused."""
        return {
            "model": self.model,
            "tokenizer": self.tokenizer_path,
            "prompts": list(self.prompts),
            "prompt_format": self.prompt_format,
            "turns": self.turns,
            "enable_thinking": self.enable_thinking,
            "shard_size": self.shard_size,
            "sampling": self.sampling.model_dump(),
            # in the hash only when not the default, so run dirs made before the key existed keep their hash; a run
            # that switches policy between starts is refused (it changes which samples exist)
            **({"turns_after_cut": self.turns_after_cut} if self.turns_after_cut != "stop" else {}),
        }

    def content_hash(self) -> str:
        blob = json.dumps(self.content_fields(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="python")

    @model_validator(mode="before")
    @classmethod
    def _slurm_node_gpus(cls, data: Any) -> Any:
        """With [slurm], [workers] gpus are one node's (or one spanning server's): derived, not written."""
        if isinstance(data, dict) and isinstance(data.get("slurm"), dict) and isinstance(data.get("workers", {}), dict):
            workers = dict(data.get("workers", {}))
            tp, gpn = workers.get("tp_size", 1), data["slurm"].get("gpus_per_node", 8)
            if "gpus" not in workers and type(tp) is int and type(gpn) is int and tp > 0 and gpn > 0:
                workers["gpus"] = list(range(tp if tp > gpn else gpn - gpn % tp))
                data = {**data, "workers": workers}
        return data

    @model_validator(mode="after")
    def _rules_between_sections(self) -> RunConfig:
        problems = brake_over_alerts(self) + seed_needs_flag(self) + hosts_rules(self) + slurm_rules(self)
        if "notify" in self.model_fields_set and not self.notify.enabled:
            problems.append(("[notify]", 'has neither url nor command: set url = "https://..." (a webhook) and/or '
                                         'command = ["/path/to/program", "arg"], or remove [notify]'))
        if problems:
            raise ConfigRuleError(problems)
        return self


def brake_over_alerts(cfg: RunConfig) -> list[tuple[str, str]]:
    out = []
    for key in (k for k in Brake.model_fields if k.endswith("_share")):
        level, alert = getattr(cfg.brake, key), getattr(cfg.alerts, key, None)
        if alert is not None and level <= alert:
            out.append((f"[brake] {key}", f"{level:g} is not above [alerts] {key} = {alert:g}: the brake would stop "
                                          f"the run before the alert warns; set it above (e.g. 0.5) or lower the alert"))
    return out


def seed_needs_flag(cfg: RunConfig) -> list[tuple[str, str]]:
    """A seed only means something on servers launched with DETERMINISTIC_FLAG: refused otherwise, not paired with
    the flag behind the operator's back (it changes the servers' kernels and speed)."""
    if cfg.sampling.seed is None or DETERMINISTIC_FLAG in launch_words(cfg.workers):
        return []
    return [("[sampling] seed", f"{cfg.sampling.seed}: SGLang ignores a request's sampling_seed unless the server runs "
                                f"with {DETERMINISTIC_FLAG}, so the answers would not follow the seed. Either add the "
                                f'flag to the workers\' launch arguments (workers.extra_args = [..., '
                                f'"{DETERMINISTIC_FLAG}"]; SGLang then uses deterministic, slower kernels), or '
                                "remove sampling.seed")]


def named_sglang_version(cfg: RunConfig) -> tuple[str, str] | None:
    """(version, where it was read) of the SGLang the config's servers are, when the config itself names it: a
    rehearsal's simulator plays one version (--sim-sglang-version, else its default). None for real SGLang servers:
    their version is the host's installed sglang, which preflight reads."""
    words = launch_words(cfg.workers)
    version = simulated_sglang_version(words)
    if version is None:
        return None
    given = any(w == "--sim-sglang-version" or w.startswith("--sim-sglang-version=") for w in words)
    return version, ("--sim-sglang-version in [workers] launch / extra_args" if given
                     else "the simulator's default version; [workers] launch runs engine.simulator")


def sampling_version_check(cfg: RunConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(errors, warnings) of [sampling] against the servers' SGLang version where the config names it (a rehearsal);
    otherwise no error, and a warning for each value some version refuses (preflight judges it on the host)."""
    named = named_sglang_version(cfg)
    if named is not None:
        return sampling_version_problems(cfg.sampling, *named), []
    return [], sampling_version_warnings(cfg.sampling)


def config_warnings(cfg: RunConfig) -> list[tuple[str, str]]:
    """What is allowed but probably not meant: said by the `config` probe (WARN) and `regen config check`."""
    out = []
    if cfg.context_length is not None and cfg.sampling.max_new_tokens >= cfg.context_length:
        out.append(("[sampling] max_new_tokens", f"{cfg.sampling.max_new_tokens} is not below context_length = "
                                                 f"{cfg.context_length}: every answer is capped at the context its "
                                                 "prompt leaves (SGLang's own cap)"))
    return out


def hosts_rules(cfg: RunConfig) -> list[tuple[str, str]]:
    if not cfg.hosts:
        return []
    out = []
    names = [h.name for h in cfg.hosts]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        out.append(("[[hosts]] name", f"{dup!r} is used twice: each host needs its own name"))
    if sum(h.is_local for h in cfg.hosts) > 1:
        out.append(("[[hosts]] address", 'only one host can be "local" (the dispatch host)'))
    for i, h in enumerate(cfg.hosts, 1):
        where = f"[[hosts]] #{i}"
        if cfg.router.link == "lan" and not h.is_local and not h.lan_address:
            out.append((f"{where} lan_address", 'router.link = "lan" needs it: the address its workers bind and '
                                                "the router reaches"))
        out += gpu_list_problems(where, h.gpus, h.tp_size or cfg.workers.tp_size, h.base_port or cfg.workers.base_port)
    return out


def launch_words(workers: Workers) -> list[str]:
    """The words of the workers' launch template plus their extra_args (the template unformatted)."""
    try:
        words = shlex.split(workers.launch)
    except ValueError:
        words = workers.launch.split()  # the launch rule reports the quoting
    return words + list(workers.extra_args)


def host_workers(cfg: RunConfig, host: Host) -> Workers:
    """[workers] with this host's GPUs, tp size, base port and bind address."""
    bind = cfg.workers.host
    if cfg.router.link == "lan" and not host.is_local:
        bind = host.lan_address or bind
    return cfg.workers.model_copy(update=dict(
        gpus=host.gpus, tp_size=host.tp_size or cfg.workers.tp_size,
        base_port=host.base_port or cfg.workers.base_port, host=bind))


def slurm_rules(cfg: RunConfig) -> list[tuple[str, str]]:
    """[slurm] places the servers itself: not with [[hosts]] or [workers] gpus; tp_size and gpus_per_node must tile
    whole nodes. (router.link does not apply: the router reaches the nodes' servers over the cluster network.)"""
    s = cfg.slurm
    if s is None:
        return []
    out = []
    if cfg.hosts:
        out.append(("[slurm]", "and [[hosts]] both place the servers: keep [slurm] (nodes from the cluster) or "
                               "[[hosts]] (hosts reached over SSH), not both"))
    tp, gpn = cfg.workers.tp_size, s.gpus_per_node
    if cfg.workers.gpus != tuple(range(tp if tp > gpn else gpn - gpn % tp)):
        out.append(("[workers] gpus", f"is not used with [slurm]: each node's GPUs are the {s.gpus_per_node} Slurm "
                                      "gives it (slurm.gpus_per_node); remove [workers] gpus"))
    if tp <= gpn and gpn % tp:
        out.append(("[workers] tp_size", f"{tp} does not divide slurm.gpus_per_node = {gpn}: {gpn % tp} GPU(s) of "
                                         f"each node would idle; use a tp_size that divides {gpn}"))
    if tp > gpn:
        if tp % gpn:
            out.append(("[workers] tp_size", f"{tp} is above slurm.gpus_per_node = {gpn} but not a multiple of it: "
                                             "a server spanning nodes takes whole nodes"))
        else:
            span = tp // gpn
            low, high = s.node_range
            for which, n in () if s.by_groups else (("", low),) if low == high else (("the fewest ", low),
                                                                                    ("the most ", high)):
                if n % span:
                    out.append(("[slurm] nodes", f"{which}{n} is not a multiple of {span}, the nodes one server "
                                                 f"spans (tp_size {tp} / gpus_per_node {gpn})"))
    if s.handover_s >= s.time_limit_s:
        out.append(("[slurm] handover_s", f"{s.handover_s} is not below time_limit = {s.time_limit} "
                                          f"({s.time_limit_s} s): the servers would be drained before they start"))
    return out + slurm_group_rules(s)


def slurm_group_rules(s: Slurm) -> list[tuple[str, str]]:
    """The elastic keys: one form of the range (nodes, or min_groups / max_groups), min up to max, and a time_min
    that leaves a job serving time before its hand-over."""
    out = []
    if s.by_groups and s.nodes != 1:  # (1, the default, is what a frozen copy of a groups config writes)
        out.append(("[slurm] nodes", f"and min_groups / max_groups both size the run: keep nodes = {s.nodes!r} or "
                                     "the groups (a group is one node, or the nodes one server spans), not both"))
    if s.min_groups is not None and s.max_groups is not None and s.min_groups > s.max_groups:
        out.append(("[slurm] min_groups", f"{s.min_groups} is above max_groups = {s.max_groups}: the plan would "
                                          "count on more groups than regen submits; lower min_groups or raise "
                                          "max_groups"))
    if s.time_min_s is not None:
        if s.time_min_s > s.time_limit_s:
            out.append(("[slurm] time_min", f"{s.time_min} ({s.time_min_s} s) is above time_limit = {s.time_limit} "
                                            f"({s.time_limit_s} s): use a time_min up to time_limit"))
        elif s.time_min_s <= s.handover_s:
            out.append(("[slurm] time_min", f"{s.time_min} ({s.time_min_s} s) is not above handover_s = "
                                            f"{s.handover_s}: a job started with it would be drained at once; "
                                            "raise time_min or lower handover_s"))
    return out
