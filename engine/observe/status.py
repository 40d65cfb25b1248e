"""The one place a status is built: build_run_status assembles an engine.api.status.RunStatus, live (the supervisor)
and offline (engine.observe.offline_status), from the ledger's counts and the process-side parts; shard_state is the
one shard-state rule. The fields' meanings: RunStatus's docstring."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from engine.api.events import DispatchEvent
from engine.api.status import Rejects, RunStatus
from engine.api.wire import AlertLevels, DISPATCHING_RUN_STATES, RunState, ShardFigures

if TYPE_CHECKING:  # the console reads this module: the ledger's (pyarrow via the shard store) stays out of its imports
    from engine.config.load import RunConfig
    from engine.run.counts import CommitRate, ShardCounts

STOPPING = ("draining", "stopping")


def shard_state(counts: ShardCounts, paused: bool, run_state: str, started: bool) -> str:
    """The one rule: done | paused | running | pending | draining | stopped."""
    if counts.complete:
        return "done"
    if paused:
        return "paused"
    started = started or counts.settled > 0
    if run_state in DISPATCHING_RUN_STATES:  # shards with work left are being worked on
        return "running" if started else "pending"
    if run_state in STOPPING:
        return "draining" if started else "pending"
    if run_state == RunState.STARTING:
        return "pending"
    return "stopped" if started else "pending"


def shard_status(sid: str, counts: ShardCounts, paused: bool, run_state: str, dispatched: int = 0) -> ShardFigures:
    return ShardFigures(id=sid, state=shard_state(counts, paused, run_state, dispatched > 0), done=counts.done,
                       total=counts.to_generate, planned=counts.total, output_tokens=counts.output_tokens,
                       empty=counts.empty, truncated=counts.truncated, failed=counts.failed,
                       rejected=counts.rejected, dispatched=dispatched, repetition=counts.repetition,
                       after_cut=counts.after_cut, unclosed_reasoning=counts.unclosed_reasoning)


def shard_statuses(shards: Mapping[str, ShardCounts], paused: Iterable[str], run_state: str,
                   dispatched: Mapping[str, int] | None = None) -> list[ShardFigures]:
    paused = set(paused)
    dispatched = dispatched or {}
    return [shard_status(sid, shards[sid], sid in paused, run_state, dispatched.get(sid, 0)) for sid in sorted(shards)]


def dispatch_figures(shards: Mapping[str, ShardCounts], state: str, *, rate: CommitRate | None = None,
                     in_flight: int = 0, retried: int = 0) -> DispatchEvent:
    """The run's figures, summed over the ledger's counts; a rate and an ETA only while it runs."""
    from engine.run.counts import eta_s

    done = sum(c.done for c in shards.values())
    total = sum(c.to_generate for c in shards.values())
    tokens = sum(c.output_tokens for c in shards.values())
    tok_s = rate.tokens_per_s() if rate is not None and state == RunState.RUNNING else None
    return DispatchEvent(in_flight=in_flight, done=done, failed=sum(c.failed for c in shards.values()),
                         retried=retried, rejected=sum(c.rejected for c in shards.values()), total=total,
                         planned=sum(c.total for c in shards.values()), output_tokens=tokens,
                         repetition=sum(c.repetition for c in shards.values()),
                         after_cut=sum(c.after_cut for c in shards.values()),
                         tokens_per_s=round(tok_s, 1) if tok_s is not None else None,
                         eta_s=eta_s(total - done, done, tokens, tok_s) if state == RunState.RUNNING else None,
                         state=state)


def build_run_status(*, run_dir: str, state: str, shards: Mapping[str, ShardCounts] | None, paused: Iterable[str] = (),
                     dispatch_state: str | None = None, rate: CommitRate | None = None, in_flight: int = 0,
                     retried: int = 0, dispatched: Mapping[str, int] | None = None,
                     last_dispatch: DispatchEvent | None = None, rejects: Rejects, **parts: Any) -> RunStatus:
    """The one place a status is assembled, live (Supervisor.status) and offline (engine.observe.offline_status).

    shards: the ledger's counts, or None while there is no ledger (a starting supervisor; a run dir that recorded
    no shard and no figures): then `last_dispatch` (the last dispatch event, or None) stands in for the figures.
    dispatch_state: the state shards and figures are judged in (`state` unless given: disk_full while commits wait
    for space); the figures are as of now (their ts). parts: the process-side fields of RunStatus (pid, workers, fatal, ...)."""
    judged = dispatch_state or state
    if shards is None:
        shard_list, dispatch = [], last_dispatch
    else:
        shard_list = shard_statuses(shards, paused, judged, dispatched)
        dispatch = dispatch_figures(shards, judged, rate=rate, in_flight=in_flight, retried=retried)
    return RunStatus(run_dir=run_dir, state=state, dispatch=dispatch, shards=shard_list, rejects=rejects, **parts)


def levels_of(cfg: RunConfig) -> AlertLevels:
    """The run's alert levels ([alerts], [runaway]) as the status carries them."""
    return AlertLevels(empty_share=cfg.alerts.empty_share, truncated_share=cfg.alerts.truncated_share,
                       repetition_share=cfg.runaway.alert_share)
