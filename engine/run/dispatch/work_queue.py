"""What dispatch pulls work from: the ledger's ready queue, seen through a Protocol (the run wing's layers)."""
from __future__ import annotations

from typing import Protocol

from engine.run.items import WorkItem


class WorkQueue(Protocol):
    """Where the dispatcher pulls work from (the ledger's ready queue: which item a free slot of a worker takes,
    prefix affinity included, is its choice; the dispatcher says which workers are ready)."""
    def next_item(self, worker: str | None = None) -> WorkItem | None: ...
    async def wait_item(self, timeout: float) -> None: ...
    def worker_ready(self, name: str, ready: bool) -> None: ...
    @property
    def queued(self) -> int: ...
    def queued_for(self, worker: str) -> int: ...
