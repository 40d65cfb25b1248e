"""Whether a remote server may join the router, from its host agent's identity records (read over ssh): the agent
proved it is its own launch and the server answers with that launch's name; an unanswering server takes the state the
agent gives it (crashed, failed, launched again), each crash told once.
"""
from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

import aiohttp

from engine.api.events import AlertEvent, Event
from engine.api.wire import AlertKind, Severity
from engine.config.load import Host
from engine.placement.hosts.remote_worker import ENDED, RemoteWorker, server_log
from engine.placement.hosts.ssh import HostError
from engine.servers.identity import IdentityCheck, ServedNames, Verdict, read_served_names
from engine.servers.identity_record import IDENTITY_FILE, IdentityRecord
from engine.servers.tuning import RunTuning
from engine.api.wire import WorkerState
from probes.shell import shell_path

log = logging.getLogger("regen.hosts")

IDENTITY_REFRESH_S = 2.0  # the agents' identity records are read over ssh at most this often

AGENT_LINE = "agent "


def admit_remote(record: IdentityRecord | None, answer: ServedNames, where: str) -> IdentityCheck:
    """Whether a remote server may join the router: its host agent proved it is its own launch, and
    the server reached at `where` answers with that launch's name."""
    if record is None:
        return IdentityCheck(Verdict.PENDING, f"the host agent has not recorded this server's identity yet ({IDENTITY_FILE})")
    if record.state == WorkerState.REFUSED:
        return IdentityCheck(Verdict.FOREIGN, f"the host agent refused it: {record.error}", names=answer.names)
    if record.state != WorkerState.READY or not record.served_model_name:
        return IdentityCheck(Verdict.PENDING, f"the host agent has not proven it yet (its state: {record.state})")
    if record.served_model_name in answer.names:
        return IdentityCheck(Verdict.PROVEN, f"{where} answers as {record.served_model_name!r}, the host agent's "
                             f"proven launch (pid {record.pid})", names=answer.names)
    if not answer.names:
        return IdentityCheck(Verdict.PENDING, f"{where} does not say its name yet ({answer.error})")
    return IdentityCheck(Verdict.FOREIGN, f"{where} answers as {', '.join(map(repr, answer.names))}, but the host "
                         f"agent's launch on port {record.port} (pid {record.pid}) is {record.served_model_name!r}: "
                         "another server answers there", names=answer.names)


def parse_identity_records(text: str) -> tuple[dict[str, IdentityRecord], list[str]]:
    """The records `cat workers/*/identity.json` printed, by worker name, and the lines that did not parse."""
    records, bad = {}, []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = IdentityRecord.from_json(line)
        except (ValueError, KeyError, TypeError) as exc:
            bad.append(f"{line[:120]!r}: {exc}")
            continue
        records[rec.name] = rec
    return records, bad


def live_records(text: str) -> tuple[dict[str, IdentityRecord], list[str]]:
    """The records of the live agent from `_identity_records`' output: its first line `agent <pid>` (`agent none`
    when no agent runs), then the records. A record another agent wrote (one that has gone since, whose servers'
    failures are not this run's) is dropped; one from an agent before the field is kept."""
    head, _, rest = text.partition("\n")
    pid_text = head.removeprefix(AGENT_LINE).strip() if head.startswith(AGENT_LINE) else ""
    if not pid_text.isdigit():
        return {}, [] if head.startswith(AGENT_LINE) else [f"no agent line: {head[:120]!r}"]
    records, bad = parse_identity_records(rest)
    return {k: r for k, r in records.items() if r.agent_pid in (None, int(pid_text))}, bad


class AgentRecords:
    """The host agent's workers/*/identity.json of one host, read over `ssh` at most every IDENTITY_REFRESH_S; what
    they say of each member (admitted, refused, crashed, the --schedule-conservativeness it runs with) is alerted
    through `emit`; a restart's change of that value is recorded as the run's in `tuning` (the run dir's record)."""

    def __init__(self, host: Callable[[], Host], ssh: Callable[..., Awaitable[tuple[int, str, str]]],
                 emit: Callable[[Event], None], session: aiohttp.ClientSession, agent_alive: str,
                 tuning: RunTuning | None = None):
        self._host = host  # a Slurm group's host changes with each job it attaches to
        self.ssh = ssh
        self.emit = emit
        self.session = session
        self.agent_alive = agent_alive
        self.tuning = tuning
        self.by_name: dict[str, IdentityRecord] = {}
        self.read_at = float("-inf")
        self.error = ""

    @property
    def host(self) -> Host:
        return self._host()

    async def read(self, fresh: bool = False) -> dict[str, IdentityRecord]:
        """The host agent's workers/*/identity.json, read over ssh at most every IDENTITY_REFRESH_S
        unless `fresh`."""
        if not fresh and time.monotonic() - self.read_at < IDENTITY_REFRESH_S:
            return self.by_name
        self.read_at = time.monotonic()
        command = (f"cd {shell_path(self.host.work_dir)} && if [ -f agent.pid ] && p=$(cat agent.pid)"
                   f' {self.agent_alive}; then echo "{AGENT_LINE}$p"; else echo "{AGENT_LINE}none"; fi;'
                   f' for f in workers/*/{IDENTITY_FILE}; do [ -e "$f" ] || continue; cat "$f"; echo; done')
        try:
            rc, out, err = await self.ssh(command, timeout=20)
        except HostError as exc:
            self.error = f"cannot read the host agent's identity records: {exc}"
            return self.by_name
        if rc != 0:
            self.error = f"reading the host agent's identity records failed (exit {rc}): {err.strip()}"
            return self.by_name
        self.by_name, bad = live_records(out)
        self.error = ""
        for line in bad:
            log.warning("host %s: unreadable identity record %s", self.host.name, line)
        return self.by_name

    async def admit(self, m: RemoteWorker) -> bool:
        """A healthy server that is not ready yet: True when it may join the router. A server the agent
        refused, or another server answering its port, is refused here too, with a critical alert."""
        answer = await read_served_names(self.session, m.url, m.headers)
        record = (await self.read()).get(m.name)
        where = f"{m.name} ({m.url})"
        check = admit_remote(record, answer, where)
        if check.verdict == Verdict.FOREIGN and m.state != WorkerState.REFUSED:
            # before alerting: the cached record may predate the agent's latest launch
            record = (await self.read(fresh=True)).get(m.name)
            check = admit_remote(record, answer, where)
        if record is not None:
            self.tell_crashes(m, record)  # a crash and relaunch between two reads is said before the rejoin
            self.take_tuning(m, record)
        if check.verdict == Verdict.PROVEN:
            if record is None:  # admit_remote proves only a launch its agent recorded
                raise RuntimeError(f"{m.name} was proven without its host agent's identity record")
            m.pid = record.pid  # the host agent's launch, on its host
            if m.state == WorkerState.REFUSED:
                self.emit(AlertEvent(severity=Severity.INFO, text=f"worker {m.name}: its own server answers again; it rejoins",
                                     evidence=f"refused before: {m.error}", key=f"worker:{m.name}:refused",
                                     kind=AlertKind.CLEARED))
            m.served_model_name = record.served_model_name
            log.info("worker %s: %s", m.name, check.reason)
            return True
        if check.verdict == Verdict.FOREIGN:
            self.refuse(m, check.reason, record)
        elif m.state != WorkerState.REFUSED:
            m.error = check.reason + (f" ({self.error})" if self.error else "")
        return False

    def refuse(self, m: RemoteWorker, reason: str, record: IdentityRecord | None) -> None:
        first = m.state != WorkerState.REFUSED
        m.served_model_name = None
        m.set_state(WorkerState.REFUSED, reason)
        if first:
            evidence = f"host: {self.host.name} ({self.host.address})\nserver: {m.url}\n" + (
                f"agent record: {record.to_json()}" if record else "agent record: none")
            self.emit(AlertEvent(severity=Severity.CRITICAL, text=f"worker {m.name} refused on host {self.host.name}: {reason}",
                                 evidence=evidence, key=f"worker:{m.name}:refused", kind=AlertKind.RAISED))

    async def recheck_refused(self, m: RemoteWorker) -> None:
        """A refused server that stopped answering: once the agent no longer refuses it (the port was
        freed, its own server is loading), it is starting again, and admitted when it answers."""
        record = (await self.read()).get(m.name)
        if record is not None and record.state != WorkerState.REFUSED:
            self.take_tuning(m, record)
            m.set_state(WorkerState.STARTING, f"the host agent's server: {record.state}")

    async def still_admitted(self, m: RemoteWorker) -> None:
        """A ready server must keep answering with the name it was admitted with (a restart by the agent
        makes a new launch, to be proven again; another server on the port must not stay in the router)."""
        answer = await read_served_names(self.session, m.url, m.headers)
        if answer.names and m.served_model_name not in answer.names:
            m.set_state(WorkerState.LOADING, f"answers as {', '.join(map(repr, answer.names))}, admitted as "
                        f"{m.served_model_name!r}: its identity is checked again")

    def mirror(self, m: RemoteWorker, record: IdentityRecord | None) -> bool:
        """An unanswering server whose host agent says it crashed or failed takes that state, its error and last
        words (the crash itself is told by tell_crashes, a failure here, once); one the agent launched again is
        starting. False when the record says nothing of that (the caller keeps the /health reason)."""
        if record is None:
            return False
        self.tell_crashes(m, record)
        self.take_tuning(m, record)
        if record.state in ENDED:
            seen = (record.state, record.restarts, record.pid)
            if m.agent_seen != seen:
                m.agent_seen, m.restarts, m.last_error_lines = seen, record.restarts, list(record.last_words)
                m.set_state(record.state, record.error)
                if record.state == WorkerState.FAILED:
                    self.emit(AlertEvent(
                        severity=Severity.CRITICAL, text=f"worker {m.name} failed, not restarted again on host "
                        f"{self.host.name}: {record.error}",
                        evidence="\n".join([*record.last_words, f"log: {self.host.name}:{server_log(self.host.work_dir, m)}"]),
                        key=f"worker:{m.name}:failed"))
            return True
        if m.state in ENDED and record.state in (WorkerState.STARTING, WorkerState.LOADING):
            m.restarts, m.pid = record.restarts, record.pid
            m.set_state(record.state, f"the host agent's server: {record.state} (restart {record.restarts})")
            return True
        return False

    def take_tuning(self, m: RemoteWorker, record: IdentityRecord) -> None:
        """The value the agent launched it with (N/A from an agent before the field); a change its restart made is
        recorded as the run's (so the next join starts it there) and alerted, once, as a one-host run does."""
        m.tuning = record.tuning
        if self.tuning is None or record.tuning is None:
            return
        where = f"host {self.host.name}'s {self.host.work_dir}/workers/{m.name}/{IDENTITY_FILE}"
        change = self.tuning.remote_change(m.name, record.tuning, where)
        if change is not None:
            log.info("worker %s on host %s: %s", m.name, self.host.name, change.text)
            self.emit(AlertEvent(severity=change.severity, text=change.text, evidence=change.evidence,
                                 key=f"worker:{m.name}:tuning"))

    def tell_crashes(self, m: RemoteWorker, record: IdentityRecord) -> None:
        """Each crash the agent counted and this link has not told yet, as one alert. The agent relaunches a
        crashed server within about a second, faster than this link reads its records: the count (not the record's
        state at the moment it is read) says a crash happened. A new agent (a rejoin, a new Slurm job) counts from
        zero."""
        agent, told = m.crashes_told
        if agent != record.agent_pid:
            told = 0
        new = record.crashes - told
        m.crashes_told = (record.agent_pid, max(told, record.crashes))
        if new <= 0:
            return
        more = f" ({new} crashes since the last one told)" if new > 1 else ""
        self.emit(AlertEvent(
            severity=Severity.ERROR, text=f"worker {m.name} crashed on host {self.host.name}: {record.last_crash}{more}",
            evidence="\n".join([*record.last_words, f"log: {self.host.name}:{server_log(self.host.work_dir, m)}"]),
            key=f"worker:{m.name}:crash"))
