"""Run config: one TOML file (`run.toml`), loaded with tomllib into typed dataclasses.

The content hash covers only the fields that change what the shards contain (model,
prompts, sampling, template/thinking, turns, shard size). Operational knobs (concurrency,
timeouts, launch extras) may change between restarts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shlex
import tomllib
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TURN_MODES = ("all", "last", "first")
PROMPT_FORMATS = ("auto", "jsonl", "json", "parquet")

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


class ConfigError(ValueError):
    """A run config that cannot be used; the message names the field and the problem."""


@dataclass(frozen=True)
class Sampling:
    # Qwen3 thinking defaults. /generate applies no model defaults, so these are always sent.
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    min_p: float = 0.0
    max_new_tokens: int = 32768
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

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


@dataclass(frozen=True)
class Workers:
    gpus: tuple[int, ...] = (0,)
    tp_size: int = 1
    base_port: int = 30000
    host: str = "127.0.0.1"  # SGLang binds to loopback unless the operator asks otherwise
    launch: str = DEFAULT_LAUNCH
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None
    ready_timeout_s: float = 1800.0
    max_restarts: int = 5
    # a ready server whose /health fails health_failures times in a row (each waiting up to
    # health_timeout_s; SGLang itself answers 503 after 20 s) while its process lives is hung: killed, restarted
    health_timeout_s: float = 25.0
    health_failures: int = 3

    def groups(self) -> list[tuple[int, ...]]:
        """GPU groups, one SGLang server each: consecutive runs of tp_size GPUs."""
        if self.tp_size < 1 or len(self.gpus) % self.tp_size:
            raise ConfigError(
                f"workers.gpus has {len(self.gpus)} GPUs, not a multiple of workers.tp_size={self.tp_size}"
            )
        return [tuple(self.gpus[i : i + self.tp_size]) for i in range(0, len(self.gpus), self.tp_size)]


@dataclass(frozen=True)
class Dispatch:
    max_in_flight_per_worker: int | None = None  # None: sized from the server's own capacity
    request_timeout_s: float = 3600.0
    max_retries: int = 5
    retry_backoff_s: float = 2.0
    # prefix affinity (engine/run/ready_queue.py): a conversation's next turn goes to the server that has its
    # prefix cached, held for it at most affinity_hold_s; prompts sharing a long prefix are grouped. false: any
    # free slot takes the oldest item (the baseline tests/bench/bench_affinity.py measures against)
    affinity: bool = True
    affinity_hold_s: float = 0.5


@dataclass(frozen=True)
class Alerts:
    empty_share: float = 0.05
    truncated_share: float = 0.10
    disk_free_min_gb: float = 20.0


@dataclass(frozen=True)
class Runaway:
    """[runaway]: the runaway guard (engine/run/runaway.py). Each answer is streamed while it is generated and
    stopped (SGLang's /abort_request) once its tail is degenerate repetition; the sample is committed with its
    exact ids and finish_reason "repetition". Operational (not in the content hash): it decides only how much
    of a degenerate answer is generated.

    Two signals, either stops the answer:
      cycle  the last max(min_span, min_repeats x p) tokens repeat one token cycle of period p exactly
             (1 <= p <= max_period): e.g. the same sentence 8 times over 1,024 tokens or more
      ngram  over the last ngram_window tokens, at least ngram_share of the informative ngram-token n-grams (not
             runs of a few tokens such as "0 & 0 & 0") already occurred earlier in that window: a loop whose
             cycles differ a little, e.g. by a counter (ngram_share = 1 turns it off)
    The defaults stop only what no legitimate answer does (a numbered list, a table, repeated code with other
    names, a multiplication table keep changing tokens inside every cycle)."""
    enabled: bool = True
    max_period: int = 512
    min_repeats: int = 8
    min_span: int = 1024
    ngram: int = 12
    ngram_window: int = 8192
    ngram_share: float = 0.9
    check_every: int = 512  # the ngram share is computed every this many tokens
    # tokens per streamed chunk (sampling_params.stream_interval): SGLang 0.5.10+ streams every id so far in each
    # chunk unless launched with --incremental-streaming-output (--stream-output), so a chunk every k tokens
    # costs both ends ~n^2 / 2k ids per n-token answer; 256 keeps that near 1.5x a plain request for a 2,000-token
    # answer and stops a loop at most 256 tokens later
    stream_interval: int = 256
    alert_share: float = 0.05  # a shard whose repetition-stopped share is above this raises an alert


@dataclass(frozen=True)
class Brake:
    """[brake]: the data-quality brake (engine.run.brake). Operational (not in the content hash): its levels may
    change between restarts, and a start whose [brake] differs from the one a brake was taken under judges the
    same recent samples again under the new one.

    When the share of one kind of bad answer over the last `window` committed samples (run-wide, in commit
    order; judged once at least `min_samples` are in it) is over its level, dispatch pauses run-wide until
    `regen resume --all`. Each level must be above its alert level in [alerts] (the alert warns first); 1.0
    never brakes on that kind. thinking_missing_share is judged only with enable_thinking = true."""
    enabled: bool = True
    window: int = 500
    min_samples: int = 200
    empty_share: float = 0.5
    truncated_share: float = 0.5
    thinking_missing_share: float = 0.5
    repetition_share: float = 0.5  # answers the runaway guard stopped ([runaway]); alerted above runaway.alert_share


@dataclass(frozen=True)
class Store:
    """[store]: how finished answers become part files. Operational (not in the content hash).

    The age bound is the crash cost: a SIGKILL loses the answers finished in the last part_max_age_s (buffered,
    not yet committed) of every worker, regenerated at the restart; next to the answers in flight, which any
    crash loses (minutes of a long thinking answer), 5 s of finished output is small. It cannot also bound the
    number of files: parts per sample then follow the rate (~30 rows a part at 6 samples/s; a few rows for the
    chained turns of turns = "all", committed within 0.2 s so the next turn can start), so the run dir is
    bounded by compaction instead: each shard, once finished, is rewritten as one file (engine.shard_store),
    and a run leaves one file per shard (~1,000 conversations), with parts only for the shards in progress.
    The rows bound caps a part's memory while it waits (256 rows of 4,000-token answers: ~10 MB) and only
    binds above ~50 samples/s (short answers, the simulator). It also bounds how long one commit holds the
    engine's interpreter (the rows made into Arrow columns): at 1,024 rows the dispatch loop stalled long enough
    for the servers' own queues to run dry at each commit (tests/bench/bench_capacity.py, 2 x 256 slots at ~200
    samples/s: 82% full-batch share against 94% with 256, issue 25)."""
    part_max_rows: int = 256
    part_max_age_s: float = 5.0


@dataclass(frozen=True)
class PlanAssumptions:
    # `regen plan` without --pilot projects with these (printed as "assumed"); a pilot measures them.
    output_tokens_per_sample: float = 2000.0
    tokens_per_s_per_gpu: float = 1500.0  # e.g. a 27B model at TP1 on one H100-class GPU
    sample_conversations: int = 2000  # conversations tokenized for the prompt-length figures
    # without a pilot, what the runaway guard is projected to save assumes this share of answers loops until
    # max_new_tokens (a pilot measures it: its answers are run through the guard's detector)
    loop_share: float = 0.02


NOTIFY_FORMATS = ("generic", "slack", "discord", "ntfy")
SEVERITIES = ("info", "warning", "error", "critical")  # AlertEvent.severity, least to most severe


@dataclass(frozen=True)
class NotifyConfig:
    """[notify]: failures and the run's end sent from the host to a webhook and/or a command.

    Operational, not content: it may change between restarts (not in the content hash)."""
    url: str | None = None  # webhook, POSTed to
    format: str = "generic"  # body of the webhook: generic | slack | discord | ntfy
    headers: dict[str, str] = field(default_factory=dict)  # extra HTTP headers, e.g. Authorization
    command: tuple[str, ...] = ()  # argv run per notification: message JSON on stdin, REGEN_NOTIFY_* env
    min_severity: str = "critical"  # alerts at or above it are sent
    run_end: bool = True  # also the normal ends (done, drained, stopped); a failed end is always sent
    retries: int = 3  # tries per notification and destination
    retry_backoff_s: float = 2.0  # wait before the second try, doubled before each next one
    timeout_s: float = 10.0  # one try: the HTTP request, or the command's run
    max_per_minute: int = 6  # more in a minute are held and sent as one "N more alerts suppressed"
    dedupe_s: float = 600.0  # the same alert key again within this is held the same way
    flush_timeout_s: float = 10.0  # at exit, the longest the supervisor waits for the last notifications

    @property
    def enabled(self) -> bool:
        return bool(self.url or self.command)


ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
ROUTER_LINKS = ("ssh", "lan")


@dataclass(frozen=True)
class Host:
    """One GPU host of a multi-host run: its SGLang workers run under a host agent there."""
    name: str
    address: str  # "local" (the dispatch host itself), an ssh alias, or user@host[:port]
    gpus: tuple[int, ...] = (0,)
    work_dir: str = "~/.regen-host"  # engine copy, agent pid/log, workers/<name>/server.log on that host
    host_python: str = "python3"
    tp_size: int | None = None  # default: workers.tp_size
    base_port: int | None = None  # default: workers.base_port
    lan_address: str | None = None  # with router.link = "lan": the address the workers bind and are reached at
    ssh_options: tuple[str, ...] = ()  # extra OpenSSH client options from the dispatch host, e.g. ["-F", "cfg"]

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


@dataclass(frozen=True)
class Router:
    """SGLang's own router (`sglang-router`), started on the dispatch host in front of every worker."""
    policy: str = "cache_aware"
    port: int = 30500
    prometheus_port: int | None = None  # the router's own metrics; default: port + 1
    python: str | None = None  # default: host_python
    link: str = "ssh"  # "ssh": SSH port forwards (workers stay on 127.0.0.1); "lan": workers bind lan_address
    forward_base_port: int = 40000  # local ends of the SSH port forwards on the dispatch host
    extra_args: tuple[str, ...] = ()
    ready_timeout_s: float = 60.0
    host_lost_after_s: float = 10.0  # a host whose workers cannot be reached this long is lost


@dataclass(frozen=True)
class RunConfig:
    run_dir: str
    model: str
    prompts: tuple[str, ...]
    host_python: str = "python3"
    tokenizer: str | None = None  # defaults to model
    prompt_format: str = "auto"
    turns: str = "all"
    enable_thinking: bool = True
    shard_size: int = 1000  # conversations per shard
    context_length: int | None = None  # defaults to the model config's
    sampling: Sampling = field(default_factory=Sampling)
    workers: Workers = field(default_factory=Workers)
    dispatch: Dispatch = field(default_factory=Dispatch)
    alerts: Alerts = field(default_factory=Alerts)
    plan: PlanAssumptions = field(default_factory=PlanAssumptions)
    store: Store = field(default_factory=Store)
    runaway: Runaway = field(default_factory=Runaway)
    brake: Brake = field(default_factory=Brake)
    hosts: tuple[Host, ...] = ()  # empty: one host, the supervisor's own ([workers])
    router: Router = field(default_factory=Router)
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    source_path: str | None = None  # where it was loaded from (not part of the content)

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
            "sampling": dataclasses.asdict(self.sampling),
        }

    def content_hash(self) -> str:
        blob = json.dumps(self.content_fields(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source_path", None)
        return d


def changed_content_fields(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Names of content fields that differ (dotted for sampling), for the refusal message."""
    changed = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += [f"{key}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            changed.append(key)
    return changed


def _build(cls, data: dict[str, Any], where: str):
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    kwargs = {}
    for key, value in data.items():
        if isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def config_from_dict(data: dict[str, Any], source_path: str | None = None) -> RunConfig:
    data = dict(data)
    for required in ("run_dir", "model", "prompts"):
        if required not in data:
            raise ConfigError(f"run config{f' {source_path}' if source_path else ''}: missing required key '{required}'")
    sections = {"sampling": Sampling, "workers": Workers, "dispatch": Dispatch, "alerts": Alerts, "plan": PlanAssumptions,
                "router": Router, "store": Store, "runaway": Runaway, "brake": Brake}
    for name, cls in sections.items():
        if name in data:
            if not isinstance(data[name], dict):
                raise ConfigError(f"[{name}] must be a table")
            data[name] = _build(cls, data[name], f"[{name}]")
    if "notify" in data:
        data["notify"] = notify_from_dict(data["notify"])
    if "hosts" in data:
        if not isinstance(data["hosts"], list) or not all(isinstance(h, dict) for h in data["hosts"]):
            raise ConfigError("hosts must be an array of tables ([[hosts]])")
        data["hosts"] = [_build(Host, h, f"[[hosts]] #{i + 1}") for i, h in enumerate(data["hosts"])]
    if isinstance(data.get("prompts"), str):
        data["prompts"] = [data["prompts"]]
    cfg: RunConfig = _build(RunConfig, data, "run config")
    cfg = dataclasses.replace(cfg, source_path=source_path)
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    if cfg.turns not in TURN_MODES:
        raise ConfigError(f"turns = {cfg.turns!r}: must be one of {', '.join(TURN_MODES)}")
    if cfg.prompt_format not in PROMPT_FORMATS:
        raise ConfigError(f"prompt_format = {cfg.prompt_format!r}: must be one of {', '.join(PROMPT_FORMATS)}")
    if cfg.shard_size < 1:
        raise ConfigError(f"shard_size = {cfg.shard_size}: must be >= 1")
    if not cfg.prompts:
        raise ConfigError("prompts: at least one path or glob is needed")
    if not isinstance(cfg.store.part_max_rows, int) or isinstance(cfg.store.part_max_rows, bool) \
            or cfg.store.part_max_rows < 1:
        raise ConfigError(f"store.part_max_rows = {cfg.store.part_max_rows!r}: must be an integer >= 1 (default "
                          f"{Store.part_max_rows})")
    if not isinstance(cfg.store.part_max_age_s, (int, float)) or isinstance(cfg.store.part_max_age_s, bool) \
            or cfg.store.part_max_age_s <= 0:
        raise ConfigError(f"store.part_max_age_s = {cfg.store.part_max_age_s!r}: must be a number > 0 (seconds; "
                          f"default {Store.part_max_age_s}: a crash loses at most this much finished output)")
    if not isinstance(cfg.dispatch.affinity, bool):
        raise ConfigError(f"dispatch.affinity = {cfg.dispatch.affinity!r}: must be true or false")
    if not isinstance(cfg.dispatch.affinity_hold_s, (int, float)) or isinstance(cfg.dispatch.affinity_hold_s, bool) \
            or not 0 <= cfg.dispatch.affinity_hold_s <= 60:
        raise ConfigError(f"dispatch.affinity_hold_s = {cfg.dispatch.affinity_hold_s!r}: must be a number of seconds "
                          f"in [0, 60] (default {Dispatch.affinity_hold_s}: how long a turn waits for the server "
                          "that holds its prefix before any server takes it)")
    validate_runaway(cfg.runaway)
    validate_brake(cfg)
    cfg.workers.groups()
    validate_seed(cfg)
    if cfg.workers.health_timeout_s <= 1.0:
        # SGLang's /health sleeps 1 s before it looks for an answer (contract 7.4): a shorter wait fails every
        # check and kills a healthy server as hung
        raise ConfigError(f"workers.health_timeout_s = {cfg.workers.health_timeout_s}: must be > 1 (seconds; SGLang's "
                          "/health takes at least 1 s), e.g. 25")
    if cfg.hosts:
        validate_hosts(cfg)


def validate_runaway(r: Runaway) -> None:
    """[runaway], key by key: each error names the key, its range and the default."""
    if not isinstance(r.enabled, bool):
        raise ConfigError(f"runaway.enabled = {r.enabled!r}: must be true or false (default true)")
    ints = (("max_period", 1, 4096), ("min_repeats", 2, 10**6), ("min_span", 2, 10**7), ("ngram", 2, 256),
            ("ngram_window", 64, 10**6), ("check_every", 1, 10**6), ("stream_interval", 1, 10**6))
    for key, low, high in ints:
        value = getattr(r, key)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ConfigError(f"runaway.{key} = {value!r}: must be an integer in {low}..{high} "
                              f"(default {getattr(Runaway, key)})")
    for key in ("ngram_share", "alert_share"):
        value = getattr(r, key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
            raise ConfigError(f"runaway.{key} = {value!r}: must be a share in (0, 1] (default {getattr(Runaway, key)}"
                              + ("; 1 turns the n-gram signal off)" if key == "ngram_share" else ")"))
    if r.ngram_window <= r.ngram:
        raise ConfigError(f"runaway.ngram_window = {r.ngram_window} must be larger than runaway.ngram = {r.ngram} "
                          f"(defaults {Runaway.ngram_window} and {Runaway.ngram})")


def validate_brake(cfg: RunConfig) -> None:
    """[brake], field by field: each error names the key and a value that works."""
    b = cfg.brake
    if not isinstance(b.enabled, bool):
        raise ConfigError(f"brake.enabled = {b.enabled!r}: must be true or false (false turns the brake off)")
    for key in ("window", "min_samples"):
        value = getattr(b, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"brake.{key} = {value!r}: must be an integer >= 1 (default {getattr(Brake, key)})")
    if b.min_samples > b.window:
        raise ConfigError(f"brake.min_samples = {b.min_samples} is more than brake.window = {b.window}: the window "
                          f"never holds that many samples, so the brake never judges; set min_samples <= window "
                          f"(defaults {Brake.min_samples} and {Brake.window})")
    for key in (f.name for f in dataclasses.fields(Brake) if f.name.endswith("_share")):  # one per brake reason
        level = getattr(b, key)
        if not isinstance(level, (int, float)) or isinstance(level, bool) or not 0 < level <= 1:
            raise ConfigError(f"brake.{key} = {level!r}: must be a share in (0, 1], e.g. {getattr(Brake, key)} "
                              "(1.0: never brake on it)")
        alert = getattr(cfg.alerts, key, None)
        if alert is not None and level <= alert:
            raise ConfigError(f"brake.{key} = {level:g} is not above alerts.{key} = {alert:g}: the brake would stop "
                              f"the run before the alert warns; set brake.{key} above it (e.g. {Brake.empty_share:g}) "
                              f"or lower alerts.{key}")


def validate_seed(cfg: RunConfig) -> None:
    """A seed only means something on servers launched with DETERMINISTIC_FLAG: refused otherwise, not
    paired with the flag behind the operator's back (it changes the servers' kernels and speed)."""
    if cfg.sampling.seed is None or DETERMINISTIC_FLAG in launch_words(cfg.workers):
        return
    raise ConfigError(
        f"sampling.seed = {cfg.sampling.seed}: SGLang ignores a request's sampling_seed unless the server runs with"
        f" {DETERMINISTIC_FLAG}, so the answers would not follow the seed. Either add the flag to the workers'"
        f' launch arguments (workers.extra_args = [..., "{DETERMINISTIC_FLAG}"]; SGLang then uses deterministic,'
        " slower kernels), or remove sampling.seed")


def launch_words(workers: Workers) -> list[str]:
    """The words of the workers' launch template plus their extra_args (the template unformatted)."""
    try:
        words = shlex.split(workers.launch)
    except ValueError as exc:
        raise ConfigError(f"workers.launch = {workers.launch!r}: cannot split it into words: {exc}") from exc
    return words + list(workers.extra_args)


def notify_from_dict(data: Any) -> NotifyConfig:
    """[notify], checked field by field: each error names the key and how to fix it."""
    if not isinstance(data, dict):
        raise ConfigError("[notify] must be a table")
    if "url" not in data and "command" not in data:
        raise ConfigError('[notify] has neither url nor command: set notify.url = "https://..." (a webhook)'
                          ' and/or notify.command = ["/path/to/program", "arg"], or remove [notify]')
    n: NotifyConfig = _build(NotifyConfig, data, "[notify]")
    if n.url is not None:
        if not isinstance(n.url, str) or not n.url.strip():
            raise ConfigError(f"notify.url = {n.url!r}: give the webhook URL (https://...) or remove the key")
        parsed = urllib.parse.urlsplit(n.url)
        if parsed.scheme not in ("http", "https"):
            raise ConfigError(f"notify.url = {redact_url(n.url)!r}: the scheme must be http or https"
                              f" (got {parsed.scheme or 'none'!r}), e.g. https://ntfy.sh/my-topic")
        if not parsed.hostname:
            raise ConfigError(f"notify.url = {redact_url(n.url)!r}: no host in the URL, e.g. https://ntfy.sh/my-topic")
    if n.format not in NOTIFY_FORMATS:
        raise ConfigError(f"notify.format = {n.format!r}: must be one of {', '.join(NOTIFY_FORMATS)}")
    if not isinstance(n.headers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in n.headers.items()):
        raise ConfigError('notify.headers must be a table of strings, e.g. headers = {Authorization = "Bearer ..."}')
    if "command" in data:
        if isinstance(data["command"], str):
            raise ConfigError(f"notify.command = {data['command']!r}: must be a list (argv, no shell), e.g."
                              ' command = ["/usr/local/bin/page-oncall", "--team", "ml"]')
        if not n.command or not all(isinstance(a, str) for a in n.command) or not n.command[0].strip():
            raise ConfigError(f"notify.command = {list(n.command)!r}: give the program and its arguments as a"
                              ' non-empty list of strings, e.g. command = ["/usr/local/bin/page-oncall", "--team", "ml"]')
    if n.min_severity not in SEVERITIES:
        raise ConfigError(f"notify.min_severity = {n.min_severity!r}: must be one of {', '.join(SEVERITIES)}")
    if not isinstance(n.run_end, bool):
        raise ConfigError(f"notify.run_end = {n.run_end!r}: must be true or false")
    for key, low in (("retries", 1), ("max_per_minute", 1)):
        value = getattr(n, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"notify.{key} = {value!r}: must be an integer >= {low}")
    for key, positive in (("retry_backoff_s", False), ("timeout_s", True), ("dedupe_s", False),
                          ("flush_timeout_s", True)):
        value = getattr(n, key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (positive and value == 0):
            raise ConfigError(f"notify.{key} = {value!r}: must be a number {'> 0' if positive else '>= 0'} (seconds)")
    return n


def redact_url(url: str) -> str:
    """scheme://host/… : a webhook's path is often its secret (Slack, Discord, an ntfy topic)."""
    parsed = urllib.parse.urlsplit(url)
    tail = "/…" if parsed.path.strip("/") or parsed.query else ""
    return f"{parsed.scheme}://{parsed.netloc.rpartition('@')[2]}{tail}" if parsed.netloc else url[:12] + "…"


def validate_hosts(cfg: RunConfig) -> None:
    names = [h.name for h in cfg.hosts]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"[[hosts]]: name(s) used twice: {', '.join(dup)}")
    if sum(h.is_local for h in cfg.hosts) > 1:
        raise ConfigError("[[hosts]]: only one host can be address = \"local\" (the dispatch host)")
    if cfg.router.policy not in ROUTER_POLICIES:
        raise ConfigError(f"router.policy = {cfg.router.policy!r}: must be one of {', '.join(ROUTER_POLICIES)}")
    if cfg.router.link not in ROUTER_LINKS:
        raise ConfigError(f"router.link = {cfg.router.link!r}: must be one of {', '.join(ROUTER_LINKS)}")
    for h in cfg.hosts:
        if not h.name or not h.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"[[hosts]] name {h.name!r}: letters, digits, - and _ only")
        if not h.address:
            raise ConfigError(f"[[hosts]] {h.name}: address is empty")
        if cfg.router.link == "lan" and not h.is_local and not h.lan_address:
            raise ConfigError(f"[[hosts]] {h.name}: router.link = \"lan\" needs lan_address (the address its workers"
                              " bind and the router reaches)")
        host_workers(cfg, h).groups()


def host_workers(cfg: RunConfig, host: Host) -> Workers:
    """[workers] with this host's GPUs, tp size, base port and bind address."""
    bind = cfg.workers.host
    if cfg.router.link == "lan" and not host.is_local:
        bind = host.lan_address or bind
    return dataclasses.replace(
        cfg.workers, gpus=host.gpus, tp_size=host.tp_size or cfg.workers.tp_size,
        base_port=host.base_port or cfg.workers.base_port, host=bind)


def load_config(path: str | Path) -> RunConfig:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read run config {path}: {exc}") from exc
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return config_from_dict(data, source_path=str(path))


def dump_toml(cfg: RunConfig) -> str:
    """Serialize a config back to TOML (the frozen copy kept in the run dir)."""
    d = cfg.to_dict()
    if not cfg.notify.enabled:
        d.pop("notify", None)  # an empty [notify] is refused at load
    elif not cfg.notify.command:
        d["notify"].pop("command")  # so is an empty command list
    lines: list[str] = []
    tables = {}
    hosts = d.pop("hosts", None) or []
    for key, value in d.items():
        if isinstance(value, dict):
            tables[key] = value
        elif value is not None:
            lines.append(f"{key} = {_toml_value(value)}")
    for name, table in tables.items():
        lines.append("")
        lines.append(f"[{name}]")
        for key, value in table.items():
            if value is None:
                continue
            if isinstance(value, dict):
                inner = ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items())
                lines.append(f"{key} = {{{inner}}}")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
    for host in hosts:
        lines.append("")
        lines.append("[[hosts]]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in host.items() if value is not None]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
