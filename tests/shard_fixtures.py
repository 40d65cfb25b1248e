"""A run of 10,000 shards for the Shards tab tests: frozen figures and a source that records pause/resume."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator

from engine.api.ops import ShardsChanged, WorkerRestarted
from engine.api.status import RunStatus
from engine.api.wire import ShardFigures
from engine.api.events import DispatchEvent, Event, ShardEvent
from console.view.model_parts import ResumeHint

T0 = 1796220000.0
SHARDS = 10_000
SHARD_SIZE = 2


def frozen_shards(n: int = SHARDS) -> list[ShardFigures]:
    """Deterministic figures: the first tenth done, every 97th running, every 331st paused, the rest pending; a few
    shards with empty or truncated answers, or a runaway stopped."""
    out = []
    for i in range(n):
        sid = f"s{i:05d}"
        if i < n // 10:
            state, done = "done", SHARD_SIZE
        elif i % 331 == 0:
            state, done = "paused", 1
        elif i % 97 == 0:
            state, done = "running", i % SHARD_SIZE
        else:
            state, done = "pending", 0
        empty = 1 if done and i % 113 == 0 else 0
        truncated = 1 if done and i % 149 == 0 else 0
        repetition = 1 if state == "running" and i % 7 == 0 else 0
        out.append(ShardFigures(id=sid, state=state, done=done, total=SHARD_SIZE, planned=SHARD_SIZE,
                               output_tokens=done * (150 + i % 400), empty=empty, truncated=truncated, failed=0,
                               rejected=0, repetition=repetition))
    return out


class ShardsSource:
    """Follows a run of `n` shards (one snapshot of events, then silence: a run between ticks); pause/resume are
    recorded and applied to the shards, and status() says so, as the supervisor's reply would."""

    def __init__(self, n: int = SHARDS):
        self.host = "gpu-host"
        self.run_dir = "/data/runs/big"
        self.shards = {s.id: s for s in frozen_shards(n)}
        self.requests: list[tuple[str, list[str] | None]] = []
        self.status_asked: list[bool] = []  # each status() call: with its shard list or not
        total = sum(s.total for s in self.shards.values())
        done = sum(s.done for s in self.shards.values())
        self.dispatch = DispatchEvent(ts=T0, state="running", done=done, total=total, in_flight=16,
                                      tokens_per_s=5200.0)
        self.protocol_note = ""  # speaks the console's protocol

    def take_notes(self) -> list:
        return []

    async def connect(self) -> None:
        return None

    async def reconnect(self) -> None:
        return None

    async def follow(self, since: float | None) -> AsyncIterator[Event]:
        yield self.dispatch
        for s in self.shards.values():
            yield ShardEvent.of(s, ts=T0)
        await asyncio.Event().wait()  # a live run: the stream stays open

    async def status(self, shards: bool = True) -> RunStatus:
        self.status_asked.append(shards)
        return RunStatus(run_dir=self.run_dir, state="running", dispatch=self.dispatch,
                         shards=list(self.shards.values()) if shards else [], shards_omitted=not shards,
                         checked_at=T0 + 1)

    async def resume_hint(self) -> ResumeHint:
        return ResumeHint()

    async def last_status(self) -> RunStatus:
        return await self.status()

    def _set(self, op: str, ids: list[str] | None, state_of) -> ShardsChanged:
        self.requests.append((op, None if ids is None else list(ids)))
        for sid in self.shards if ids is None else ids:
            s = self.shards[sid]
            if s.state != "done":
                self.shards[sid] = dataclasses.replace(s, state=state_of(s))
        return ShardsChanged(op=op, shards=list(self.shards) if ids is None else list(ids), state="running")

    async def pause(self, shards: list[str] | None) -> ShardsChanged:
        return self._set("pause", shards, lambda s: "paused")

    async def resume(self, shards: list[str] | None) -> ShardsChanged:
        return self._set("resume", shards, lambda s: "running" if s.done else "pending")

    async def restart_worker(self, name: str) -> WorkerRestarted:
        raise NotImplementedError("no workers in this fake")

    async def log_tail(self, worker: str, lines: int = 200) -> str:
        return ""

    async def stats(self) -> dict[str, Any]:
        return {}

    async def probes(self, only=None):
        raise NotImplementedError("no probes in this fake")

    async def close(self) -> None:
        return None
