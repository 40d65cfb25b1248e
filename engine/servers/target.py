"""What the dispatcher (engine.run.dispatch) needs of a dispatch target, and the defaults of one that is a server.

A target is a server launched here (Worker), one on another host (RemoteWorker) or a multi-host run's router
(RouterEndpoint); each has every member of the Protocol (none is read with a getattr default)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from typing import Self

    from engine.run.counts import ServedTokens
    from engine.servers.capacity import BatchSize, ServerCapacity
    from engine.servers.metrics_client import ServerMetrics


class DispatchTarget(Protocol):
    """A server (or a router) the dispatcher sends requests to. Read-only members are properties here (a plain
    attribute meets them too); the dispatcher writes only in_flight, held, capacity and batch."""

    @property
    def name(self) -> str:
        """Its name in the status, the log and the ledger (`gpu0-1`, `<host>.gpu0`, `router`)."""
        ...

    @property
    def url(self) -> str:
        """Its base URL (`http://host:port`): /generate and /abort_request are under it."""
        ...

    @property
    def headers(self) -> dict[str, str]:
        """Sent with every request (the API key's Authorization, if any)."""
        ...

    @property
    def state(self) -> str:
        """Its WorkerState: the dispatcher sends only to a READY one."""
        ...

    # called with the target and its new state at each change (the dispatcher's, the supervisor's, the fleet's)
    listeners: list[Callable[[Self, str], None]]

    @property
    def capacity_info(self) -> ServerCapacity:
        """Its discovered size: the batch it reports (batch()) and its KV pool (max_total_num_tokens)."""
        ...

    @property
    def metrics(self) -> ServerMetrics:
        """Its last /metrics reading (running and queued requests, token usage); a new object at each reading."""
        ...

    @property
    def queue_margin(self) -> int | None:
        """Requests it wants queued beyond its running batch; None: the dispatcher's own margin
        (engine.run.batch_feedback.margin_for). A router says its own (it picks servers without seeing their slots),
        and its reported batch, its servers' sum, is not cut to one KV pool."""
        ...

    @property
    def is_router(self) -> bool:
        """A router in front of servers: its 503 "No available workers" means it had none to route to (no attempt of
        the request), and no_servers() is called."""
        ...

    def no_servers(self) -> None:
        """The router answered 503 "No available workers": it reads its list of servers again. Only for a target
        whose is_router is True."""
        ...

    # its requests open now: the dispatcher writes its own count (an int); behind a router a server's is the
    # router's count or None (not known), so it reads back int | None
    @property
    def in_flight(self) -> int | None:
        ...

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        ...

    held: int  # written by the dispatcher: regen's queued items held for it
    capacity: int  # written by the dispatcher: how many requests it may have open
    batch: BatchSize | None  # written by the dispatcher: the batch size it works with (None while not ready)
    served: ServedTokens | None  # set by the supervisor: the ledger's figures of what it served


class SingleServer:
    """The DispatchTarget members of a target that is one server, not a router (Worker, RemoteWorker)."""

    @property
    def queue_margin(self) -> int | None:
        """None: a server takes the dispatcher's own margin, a quarter of its batch."""
        return None

    @property
    def is_router(self) -> bool:
        return False

    def no_servers(self) -> None:
        """Nothing to do: a server has no list of servers to read again (the dispatcher asks only a router)."""

