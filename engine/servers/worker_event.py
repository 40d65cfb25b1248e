"""The telemetry event (WorkerEvent) of a server launched here, watched on another host, or a router target."""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.api.events import WorkerEvent
from engine.api.tuning import LaunchTuning

if TYPE_CHECKING:
    from engine.run.counts import ServedTokens


def with_batch(ev: WorkerEvent, w) -> WorkerEvent:
    """`ev` with the batch size of a dispatch target or server: the size in use (the dispatcher's, else the
    discovered one) and the discovered one, each with its source; left empty until discovery ran."""
    info = w.capacity_info
    discovered = info.batch() if info.discovered else None
    batch = getattr(w, "batch", None) or discovered
    if batch is not None:
        ev.batch_size, ev.batch_source = batch.size, batch.source
    if discovered is not None:
        ev.discovered_batch, ev.discovered_source = discovered.size, discovered.source
    return ev


def worker_event(w, *, host: str = "", remote: bool = False) -> WorkerEvent:
    """The telemetry event of a server, launched here (Worker) or watched on another host (RemoteWorker)."""
    m = w.metrics
    return with_batch(WorkerEvent(
        name=w.name, state=w.state, url=w.url, gpus=list(w.spec.gpus), pid=w.pid, restarts=w.restarts,
        running_reqs=m.running_reqs, queued_reqs=m.queued_reqs, gen_throughput=m.gen_throughput,
        token_usage=m.token_usage, in_flight=w.in_flight, in_flight_source=w.in_flight_source,
        held=getattr(w, "held", 0), capacity=w.capacity, error=w.error, host=host, remote=remote,
        node=getattr(w, "node", ""), job_id=getattr(w, "job_id", ""), retracted=m.retracted,
        **tuning_fields(w.tuning), **served_fields(w.served)), w)


def tuning_fields(tuning: LaunchTuning | None) -> dict:
    """A server's --schedule-conservativeness and its source (engine.servers.tuning; a remote server's from its host
    agent's identity record); none where not known (an agent from before the field)."""
    if tuning is None:
        return {}
    return {"conservativeness": tuning.value, "conservativeness_source": str(tuning.source)}


def served_fields(served: ServedTokens | None) -> dict:
    """A dispatch target's committed prompt and cached tokens for its event (the ledger's figures)."""
    if served is None:
        return {}
    return {"prompt_tokens": served.prompt_tokens, "cached_tokens": served.cached_tokens}
