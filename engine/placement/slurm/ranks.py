"""A server across several nodes: the crashes its ranks > 0 told in their agents' telemetry, each one alert here
naming the rank and its node (rank 0's own crash, which follows, is the member's)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from engine.api.events import AlertEvent, Event
from engine.placement.slurm.jobs import JobState
from engine.placement.slurm.step import NODE_FILE


class RankCrashes:
    """Reads each rank<I>/telemetry.jsonl of a job's dir from where it stopped the last time."""

    def __init__(self, group: str, emit: Callable[[Event], None]):
        self.group = group
        self.emit = emit
        self.offsets: dict[Path, int] = {}  # how far each rank > 0 agent's telemetry.jsonl was read

    def tell(self, job: JobState, here: Path) -> None:
        """A server across nodes: a rank > 0 that crashed or failed (its node's agent said so in its telemetry) is
        an alert here naming the rank and its node, once per crash; rank 0's own crash, which follows, is the
        member's."""
        for path in sorted(here.glob("rank*/telemetry.jsonl")):
            offset = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
                node = json.loads((path.parent / NODE_FILE).read_text())
            except (OSError, ValueError):
                continue  # not there yet: read at the next poll
            cut = data.rfind(b"\n") + 1  # a line being written is read whole at the next poll
            self.offsets[path] = offset + cut
            for line in data[:cut].decode(errors="replace").splitlines():
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                key = str(ev.get("key", ""))
                if ev.get("type") != "alert" or not key.startswith("worker:") or not key.endswith((":crash", ":failed")):
                    continue
                self.emit(AlertEvent(
                    severity=ev.get("severity", "error"),
                    text=f"node rank {node.get('node_rank', '?')} of the server of {self.group} (job "
                         f"{job.job_id}, node {node.get('node', '?')}): {ev.get('text', '')}; losing a rank ends "
                         "the server, its agent launches the rank again",
                    evidence=f"{ev.get('evidence', '')}\nlog: {path.parent}/workers/", key=key))
