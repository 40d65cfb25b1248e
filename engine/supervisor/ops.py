"""The supervisor's control-op handlers, one per op of engine.api.ops (registered with @handles), each returning its
op's Reply type; ControlError's text is the reply's error. A new op: its class in engine.api.ops, its handler here."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import shlex
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from engine.api.ops import (SUPERVISOR_OPS, ControlError, ControlOp, Drain, DrainHost, LogTail, LogText, Op, Pause,
                            RestartWorker, Resume, RunEnding, ShardsChanged, Status, Stop, UndrainHost, WireReply,
                            WorkerRestarted)
from engine.api.status import HostStatus, RunStatus
from engine.placement.hosts.ssh import HostError
from engine.placement.hosts.remote_worker import RemoteWorker
from engine.run.ledger import Ledger
from engine.servers.workers import Worker
from engine.servers.server_log import log_tail
from engine.supervisor.lifecycle import EndHow

if TYPE_CHECKING:
    from engine.supervisor.supervisor import Supervisor

log = logging.getLogger("regen.supervisor")

LOG_TAIL_TIMEOUT_S = 20.0  # a log_tail of a [[hosts]] server: one ssh to its host
Handler = Callable[["Supervisor", Any], Awaitable[WireReply]]
HANDLERS: dict[type[ControlOp], Handler] = {}


def handles(*ops: type[ControlOp]) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        for cls in ops:
            HANDLERS[cls] = handler
        return handler
    return register


async def handle(sup: Supervisor, op: Op) -> WireReply:
    """One control op, answered by its handler."""
    handler = HANDLERS.get(type(op))
    if handler is None:
        raise ControlError(f"unknown op {op!r}")
    return await handler(sup, op)


def unhandled() -> list[str]:
    """The supervisor's ops with no handler here (a test keeps it empty)."""
    return [cls.op for cls in SUPERVISOR_OPS if cls not in HANDLERS]


@handles(Status)
async def status(sup: Supervisor, op: Status) -> RunStatus:
    reply = sup.monitor.status()
    if not op.shards:
        reply = dataclasses.replace(reply, shards=[], shards_omitted=True)
    return reply


def _needs_ledger(sup: Supervisor) -> Ledger:
    if sup.ledger is None:
        raise ControlError("the supervisor is still starting (counting prompts); try again in a moment")
    return sup.ledger


@handles(Pause, Resume)
async def set_paused(sup: Supervisor, op: Pause | Resume) -> ShardsChanged:
    ledger = _needs_ledger(sup)
    try:
        changed = ledger.set_paused(None if op.shards is None else list(op.shards), isinstance(op, Pause))
    except KeyError as exc:
        raise ControlError(exc.args[0]) from exc
    log.info("%s %s", op.op, "all" if op.shards is None else list(op.shards))
    braked = ledger.brake.engaged
    return ShardsChanged(op=op.op, shards=sorted(changed), paused=sorted(ledger.paused), state=sup.state(),
                         brake=braked.text if braked is not None else None)


def _worker(sup: Supervisor, name: str) -> Worker | RemoteWorker:
    found = next((w for w in sup.workers if w.name == name), None)
    if found is None:
        raise ControlError(f"unknown worker {name!r}; workers: {', '.join(w.name for w in sup.workers)}")
    return found


@handles(RestartWorker)
async def restart_worker(sup: Supervisor, op: RestartWorker) -> WorkerRestarted:
    _needs_ledger(sup)
    found = _worker(sup, op.worker)
    try:
        found.restart()
    except NotImplementedError as exc:
        raise ControlError(str(exc)) from exc
    log.info("restart of worker %s requested", op.worker)
    return WorkerRestarted(worker=op.worker, state=found.state)


@handles(LogTail)
async def tail_log(sup: Supervisor, op: LogTail) -> LogText:
    found = _worker(sup, op.worker)
    if isinstance(found, Worker):
        path = found.log_path
        return LogText(worker=op.worker, path=str(path),
                       text="\n".join(await asyncio.to_thread(log_tail, path, 0, op.lines)))
    assert sup.fleet is not None  # a worker not of this machine is a fleet member
    link = sup.fleet.link_of(found)
    path, where = link.server_log(found), link.server_log_where(found)
    try:
        rc, out, err = await link.ssh(f"tail -n {op.lines} -- {shlex.quote(path)}", timeout=LOG_TAIL_TIMEOUT_S)
    except HostError as exc:
        raise ControlError(f"tail {where}: {exc}") from exc
    if rc != 0:
        raise ControlError(f"tail {where}: exit status {rc}: {err.strip() or '(no stderr)'}")
    return LogText(worker=op.worker, path=where, text=out)


@handles(DrainHost, UndrainHost)
async def set_host_drained(sup: Supervisor, op: DrainHost | UndrainHost) -> HostStatus:
    if sup.fleet is None:
        raise ControlError("drain_host: this run has no [[hosts]]")
    try:
        return sup.fleet.set_drained(op.host, isinstance(op, DrainHost))
    except KeyError as exc:
        raise ControlError(exc.args[0]) from exc


@handles(Drain, Stop)
async def end_on_request(sup: Supervisor, op: Drain | Stop) -> RunEnding:
    if isinstance(op, Drain):
        sup.end_cause = sup.end_cause or "drain requested over the control socket (regen stop --drain)"
    else:
        sup.end_cause = sup.end_cause or "stop requested over the control socket (regen stop)"
    sup.ending.begin_shutdown(EndHow(op.op))
    return RunEnding(state=sup.state())
