"""The simulated server's state words: its lifecycle status and the pause modes /pause_generation takes (SGLang's)."""
from __future__ import annotations

from enum import StrEnum


class ServerStatus(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"  # SIGTERM: still serves what it has, then exits
    STOPPED = "stopped"
    CRASHED = "crashed"


class PauseMode(StrEnum):
    ABORT = "abort"  # abort every request in flight
    RETRACT = "retract"
    IN_PLACE = "in_place"
