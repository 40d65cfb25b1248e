"""A server's running batch size, discovered from what it reports, its start-up log line or its launch flag.

Real SGLang often reports `max_running_requests: null` (contract 7.1); the first source that says wins: internal_states
(0.5.10+), the start-up log line, /get_server_info, the launch flag, else DEFAULT_MAX_RUNNING. The dispatcher then
corrects it from the server's own queue (source `feedback`)."""
from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.config.schema import flag_value

DEFAULT_MAX_RUNNING = 64


class BatchSource:
    INTERNAL_STATES = "internal_states"
    LOG = "log"
    SERVER_INFO = "server_info"
    FLAG = "flag"
    FEEDBACK = "feedback"
    KV_POOL = "kv_pool"  # the reported batch cut to what the KV pool holds (kv_fit)
    DEFAULT = "default"

    REPORTED = (INTERNAL_STATES, LOG, SERVER_INFO, FLAG)  # a size the server runs at most


# scheduler.py (0.5.5 L411, 0.5.23 L1268-1276): "max_total_num_tokens=N, chunked_prefill_size=N, max_prefill_tokens=N,
# max_running_requests=N, context_len=N, available_gpu_mem=X GB"; the server_args line also says
# "max_running_requests=None", so the match is anchored on the start-up line's first field
STARTUP_LINE = re.compile(r"max_total_num_tokens=\d+,.*?\bmax_running_requests=(\d+)")
FLAG = "--max-running-requests"


@dataclass(frozen=True)
class BatchSize:
    """A server's running batch size and where it came from (BatchSource)."""
    size: int
    source: str


@dataclass(frozen=True)
class ServerCapacity:
    """What regen knows of a server's size. `max_running_requests` is the batch it runs over all its DP
    ranks (None: unknown), `batch_source` where that came from (BatchSource)."""
    max_running_requests: int | None = None
    max_total_num_tokens: int | None = None
    context_length: int | None = None
    max_req_input_len: int | None = None  # a prompt this long or longer is refused (engine/run/prompt_limit.py)
    batch_source: str = ""  # "" until discovered
    dp_ranks: int = 1  # (dp_size or 1) * (attn_dp_size or 1), as SGLang's own benchmark counts them

    @property
    def discovered(self) -> bool:
        return bool(self.batch_source)

    def batch(self) -> BatchSize:
        """The batch size to start from: the discovered one, else DEFAULT_MAX_RUNNING (source default)."""
        if self.max_running_requests:
            return BatchSize(self.max_running_requests, self.batch_source)
        return BatchSize(DEFAULT_MAX_RUNNING, BatchSource.DEFAULT)


def _first_int(sources: list[dict[str, Any]], *keys: str) -> int | None:
    for src in sources:
        for key in keys:
            value = src.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                return int(value)
    return None


def parse_server_info(info: dict[str, Any]) -> ServerCapacity:
    """Capacity from /get_server_info: computed values live in internal_states[0] (server args there are
    the resolved ones); the top level holds the launch args and scheduler_info. The batch size is the
    scheduler's working value when the version reports it (0.5.10+), else max_running_requests, which is
    null unless the flag was passed (source default then: the log line or the flag may still say it)."""
    sources: list[dict[str, Any]] = []
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        sources.append(states[0])
    sources.append(info)
    ranks = (_first_int(sources, "dp_size") or 1) * (_first_int(sources, "attn_dp_size") or 1)
    per_dp = _first_int(sources, "effective_max_running_requests_per_dp")
    reported = _first_int(sources, "max_running_requests")
    if per_dp:
        batch, source = per_dp * ranks, BatchSource.INTERNAL_STATES
    elif reported:
        batch, source = reported, BatchSource.SERVER_INFO
    else:
        batch, source = None, BatchSource.DEFAULT
    return ServerCapacity(
        max_running_requests=batch, batch_source=source, dp_ranks=ranks,
        max_total_num_tokens=_first_int(sources, "max_total_num_tokens"),
        context_length=_first_int(sources, "context_length", "context_len"),
        max_req_input_len=_first_int(sources, "max_req_input_len"),
    )


def batch_from_log(text: str) -> int | None:
    """The per-DP-rank batch size of the last start-up line in `text` (one launch's server.log)."""
    found = STARTUP_LINE.findall(text)
    return int(found[-1]) if found else None


def batch_from_flag(argv: Sequence[str]) -> int | None:
    """--max-running-requests N (or =N) in a launch line; the last one counts, as in argparse."""
    value = flag_value(argv, FLAG)
    try:
        return int(value) if value is not None and int(value) > 0 else None
    except ValueError:
        return None


def discover(reported: ServerCapacity | None, log_batch: int | None, flag_batch: int | None) -> ServerCapacity:
    """The server's capacity with its batch size filled from the first source that says it (see the module doc).
    `reported` is what /get_server_info said (None when it did not answer)."""
    info = reported or ServerCapacity()
    if info.batch_source == BatchSource.INTERNAL_STATES:
        return info
    if log_batch:
        return dataclasses.replace(info, max_running_requests=log_batch * info.dp_ranks, batch_source=BatchSource.LOG)
    if info.max_running_requests:
        return dataclasses.replace(info, batch_source=BatchSource.SERVER_INFO)
    if flag_batch:
        return dataclasses.replace(info, max_running_requests=flag_batch, batch_source=BatchSource.FLAG)
    return dataclasses.replace(info, max_running_requests=None, batch_source=BatchSource.DEFAULT)


def kv_fit(max_total_num_tokens: int | None, tokens_per_request: float) -> int | None:
    """Requests a KV pool of `max_total_num_tokens` holds at once, each `tokens_per_request` (its prompt plus its
    expected output: engine.run.request_size); None when the pool is not known."""
    if not max_total_num_tokens or tokens_per_request <= 0:
        return None
    return max(1, int(max_total_num_tokens // tokens_per_request))


def configured_batch(launch: str, extra_args: Sequence[str]) -> int | None:
    """--max-running-requests in a [workers] launch template plus its extra_args."""
    return batch_from_flag(shlex.split(launch) + list(extra_args))
