"""One status shape, built in one place: the supervisor's `status` reply, engine.ctl last-status (a run whose
supervisor is gone), `regen status [--json]` and the TUI all read what these functions build from the
ledger's counts (engine.run.counts.ShardCounts: loaded from state.sqlite, moved by each commit).

Field meanings (the figures in `dispatch` and in each shard):
  done           samples committed (rows in committed parts)
  total          samples to generate: planned less rejected and failed (so a finished run is done == total)
  planned        samples the input plans (generated turns of the good conversations)
  rejected       samples never generated because their input cannot be (engine.run.counts); input rows refused
                 when read are not samples: they are in `rejects` (rejects.jsonl, by reason) with the rest
  failed         samples whose retries were spent in this run (the next start generates them again)
  retried        attempts that failed and went back to the queue (not an outcome)
  in_flight      requests sent and not answered; while draining, what is left to drain
  output_tokens, empty, truncated   sums over the committed samples
  tokens_per_s   output tokens committed per second over the last minute of this start; null until measurable
                 and when not running
  eta_s          seconds left at that rate (remaining samples x committed tokens per sample); null until
                 measurable and whenever the run is not running
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

from engine.run.counts import CommitRate, ShardCounts, eta_s
from engine.telemetry_events import DispatchEvent, ShardEvent

DISPATCHING = ("running", "paused", "disk_full")  # run states in which shards with work left are being worked on
STOPPING = ("draining", "stopping")


def shard_state(counts: ShardCounts, paused: bool, run_state: str, started: bool) -> str:
    """The one rule: done | paused | running | pending | draining | stopped."""
    if counts.complete:
        return "done"
    if paused:
        return "paused"
    started = started or counts.settled > 0
    if run_state in DISPATCHING:
        return "running" if started else "pending"
    if run_state in STOPPING:
        return "draining" if started else "pending"
    if run_state == "starting":
        return "pending"
    return "stopped" if started else "pending"


@dataclass
class ShardStatus:
    id: str
    state: str
    done: int
    total: int
    planned: int
    output_tokens: int
    empty: int
    truncated: int
    failed: int
    rejected: int
    dispatched: int = 0  # requests sent for it by this supervisor

    def event(self) -> ShardEvent:
        return ShardEvent(id=self.id, state=self.state, done=self.done, total=self.total,
                          output_tokens=self.output_tokens, empty=self.empty, truncated=self.truncated,
                          failed=self.failed, rejected=self.rejected, planned=self.planned)

    def to_dict(self) -> dict:
        return asdict(self)


def shard_status(sid: str, counts: ShardCounts, paused: bool, run_state: str, dispatched: int = 0) -> ShardStatus:
    return ShardStatus(id=sid, state=shard_state(counts, paused, run_state, dispatched > 0), done=counts.done,
                       total=counts.to_generate, planned=counts.total, output_tokens=counts.output_tokens,
                       empty=counts.empty, truncated=counts.truncated, failed=counts.failed,
                       rejected=counts.rejected, dispatched=dispatched)


def shard_statuses(shards: Mapping[str, ShardCounts], paused: Iterable[str], run_state: str,
                   dispatched: Mapping[str, int] | None = None) -> list[ShardStatus]:
    paused = set(paused)
    dispatched = dispatched or {}
    return [shard_status(sid, shards[sid], sid in paused, run_state, dispatched.get(sid, 0)) for sid in sorted(shards)]


def dispatch_figures(shards: Mapping[str, ShardCounts], state: str, *, rate: CommitRate | None = None,
                     in_flight: int = 0, retried: int = 0) -> DispatchEvent:
    """The run's figures, summed over the ledger's counts; a rate and an ETA only while it runs."""
    done = sum(c.done for c in shards.values())
    total = sum(c.to_generate for c in shards.values())
    tokens = sum(c.output_tokens for c in shards.values())
    tok_s = rate.tokens_per_s() if rate is not None and state == "running" else None
    return DispatchEvent(in_flight=in_flight, done=done, failed=sum(c.failed for c in shards.values()),
                         retried=retried, rejected=sum(c.rejected for c in shards.values()), total=total,
                         planned=sum(c.total for c in shards.values()), output_tokens=tokens,
                         tokens_per_s=round(tok_s, 1) if tok_s is not None else None,
                         eta_s=eta_s(total - done, done, tokens, tok_s) if state == "running" else None, state=state)
