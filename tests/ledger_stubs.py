"""The ledger's feed and events in a unit test (engine.run.ledger_ports): what the ledger told them, recorded."""
from __future__ import annotations


class StubWing:
    def __init__(self, build_turn=None):
        self.turn_builder = build_turn
        self.rescanned: list[str] = []
        self.changed: list[str] = []
        self.brakes: list[tuple[bool, str]] = []
        self.trips: list = []

    def build_turn(self, progress, turn):
        if self.turn_builder is None:
            raise RuntimeError(f"no turn builder for turn {turn} of {progress.conv.conversation_id}")
        return self.turn_builder(progress, turn)

    def rescan(self, shard_id: str) -> None:
        self.rescanned.append(shard_id)

    def wake(self) -> None:
        pass

    def shard_changed(self, shard_id: str) -> None:
        self.changed.append(shard_id)

    def brake_changed(self, status, engaged: bool) -> None:
        self.brakes.append((engaged, status.text))

    def refused(self, trip) -> None:
        self.trips.append(trip)
