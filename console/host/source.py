"""Where the console's data comes from: a host (HostSource: RunClient over a transport) or a recorded telemetry file
(ReplaySource), behind the DataSource protocol. Every failure is a SourceError whose `kind` says what to do:
connection (reconnect with backoff), no_supervisor (show history, keep checking), refused (host key or auth:
retrying cannot help, the text says what the operator must do), error (an operation refused: show the text)."""
from __future__ import annotations

import dataclasses
import asyncio
import shlex
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, NoReturn, Protocol

import orjson

from console.host import start_record
from console.view.model_parts import ResumeHint
from console.host.config_probe import config_failed_report, config_passed
from console.host.follow import FollowSource, SourceError, SourceErrorKind
from console.host.hints import regen_command
from console.host.remote_engine import engine_command
from console.host.control_channel import ChannelClosed
from console.host.run_client import ClientErrorKind, NoSupervisor, RunClient, RunClientError
from console.host.ssh_options import SshOptions
from console.host.transport import Transport, TransportError
from console.host.connect import open_transport
from engine.config.load import ConfigError
from engine.api.ops import ShardsChanged, WorkerRestarted
from engine.api.status import RunStatus
from engine.api.reports import RunStats
from engine.api.wire import WireError
from engine.api.events import Event, UnknownEventType, parse_event
from probes.model import ConnectErrorKind, ProbeReport

LOG_TAIL_LINES = 200
STATS_TIMEOUT_S = 300.0
TAIL_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class SourceNote:
    """Something the source saw that the operator should know, though nothing failed (the app lists it as an alert)."""
    severity: str  # info | warning
    text: str
    key: str  # one alert per key


class DataSource(FollowSource, Protocol):
    @property
    def protocol_note(self) -> str:
        """Non-empty: the engine has no control channel, ops go one process each (the header says so)."""
        ...

    def take_notes(self) -> list[SourceNote]: ...  # the notes since the last call
    async def status(self, shards: bool = True) -> RunStatus: ...  # shards=False: without the shard list
    async def pause(self, shards: list[str] | None) -> ShardsChanged: ...
    async def resume(self, shards: list[str] | None) -> ShardsChanged: ...
    async def restart_worker(self, name: str) -> WorkerRestarted: ...
    async def log_tail(self, worker: str, lines: int = LOG_TAIL_LINES) -> str: ...
    async def stats(self) -> RunStats: ...
    async def probes(self, only: set[str] | None = None) -> ProbeReport: ...
    async def resume_hint(self) -> ResumeHint: ...
    async def close(self) -> None: ...
    supervised: bool  # a live supervisor answers here (HostSource), not a recording


def _classify(exc: RunClientError) -> SourceError:
    if isinstance(exc.__cause__, TransportError):
        return SourceError(str(exc), SourceErrorKind.CONNECTION)
    if exc.kind == ClientErrorKind.UNREACHABLE and str(exc).startswith("no supervisor"):
        return SourceError(str(exc), SourceErrorKind.NO_SUPERVISOR)
    if exc.kind == ClientErrorKind.UNREACHABLE:
        return SourceError(str(exc), SourceErrorKind.CONNECTION)
    return SourceError(str(exc), SourceErrorKind.ERROR)


class HostSource:
    """A run on a host. `transport` may be given (tests, `regen demo`); otherwise it is opened from `host` with
    the SSH options `ssh`. accept_new_command: the command shown for a host not yet in known_hosts (default:
    `regen tui HOST --run-dir DIR ... --accept-new`)."""

    supervised = True  # a live supervisor answers here: its disappearance is a death, not the end of a recording

    def __init__(self, host: str, run_dir: str | None, *, host_python: str = "python3",
                 transport: Transport | None = None, ssh: SshOptions = SshOptions(),
                 accept_new_command: str | None = None):
        self.host = host
        self.run_dir = run_dir
        self.host_python = host_python
        self.transport = transport
        self.ssh = ssh
        self.accept_new_command = accept_new_command or regen_command(
            "tui", host, *(["--run-dir", run_dir] if run_dir else []),
            *(["--host-python", host_python] if host_python != "python3" else []), ssh=ssh, accept_new=True)
        self.client: RunClient | None = None
        self._owns_transport = transport is None
        self._connecting = asyncio.Lock()  # the telemetry and probe workers both connect at start
        self.refused: SourceError | None = None  # kept until reconnect(): the host refused us, retrying cannot help
        self.close_error = ""
        self._notes: list[SourceNote] = []

    @property
    def protocol_note(self) -> str:
        return self.client.protocol_note if self.client is not None else ""

    def take_notes(self) -> list[SourceNote]:
        notes, self._notes = self._notes, []
        return notes

    def _refusal(self, exc: TransportError) -> SourceError:
        text = f"{self.host} refused the connection: {exc}"
        if exc.unknown_host_key:
            text += f" To record the key and connect, quit and run: {self.accept_new_command}"
        return SourceError(text, SourceErrorKind.REFUSED)

    async def connect(self) -> None:
        async with self._connecting:
            await self._connect()

    async def _connect(self) -> None:
        if self.refused is not None:
            raise self.refused
        if self.transport is None:
            try:
                self.transport = await open_transport(self.host, **self.ssh.connect_kwargs())
            except TransportError as exc:
                # not transient: the operator must act
                if exc.kind in (ConnectErrorKind.HOST_KEY, ConnectErrorKind.AUTH):
                    self.refused = self._refusal(exc)
                    raise self.refused from exc
                raise SourceError(f"cannot connect to {self.host}: {exc}", SourceErrorKind.CONNECTION) from exc
        if self.run_dir is None:
            return
        if self.client is None:
            self.client = await self._make_client(self.transport, self.run_dir)
        self.client.transport = self.transport  # after a reconnect: the new connection
        await self._ensure_channel()

    async def _make_client(self, transport: Transport, run_dir: str) -> RunClient:
        from console.host.deploy import client_for  # reads .regen/launch.json: the python and engine the run uses
        from console.host.run_dir_lookup import NoSuchRunDir

        try:
            return await client_for(transport, run_dir, self.host_python)
        except NoSuchRunDir as exc:
            raise SourceError(str(exc), SourceErrorKind.ERROR) from exc
        except RunClientError as exc:
            if isinstance(exc.__cause__, TransportError):
                raise SourceError(str(exc), SourceErrorKind.CONNECTION) from exc
            # not started by `regen start` (or unreadable launch file): the configured python, no PYTHONPATH
            return RunClient(transport, run_dir, host_python=self.host_python)

    async def _ensure_channel(self) -> None:
        """The ops of an attached console go over one control channel (RunClient.open_channel). One whose process
        ended is opened again here, before the next op; the op that was in flight then is never sent again. An
        engine without the channel (protocol_note) is asked again only after a reconnect."""
        client = self.client
        if client is None or client.protocol_note:
            return
        channel = client.channel
        if channel is not None:
            closed = channel.closed
            if closed is None:
                return
            if closed.transport is None:  # a lost connection has its own alert (connection lost)
                self._notes.append(SourceNote("warning", f"{closed}; opening a new one",
                                              key=f"console.channel.{time.time()}"))
            await client.close_channel()
        try:
            await client.open_channel()
        except RunClientError as exc:
            raise _classify(exc) from exc
        if client.protocol_note:
            self._notes.append(SourceNote("warning", client.protocol_note, key="console.protocol"))

    async def reconnect(self) -> None:
        self.refused = None  # the operator asked again (ctrl+r): maybe the cause was fixed
        if self.client is not None:
            self.client.protocol_note = ""  # say hello again: the run may have been started again with a newer engine
            if self._owns_transport:  # its channel runs on the connection about to be closed
                await self._close_channel(self.client)
        if self._owns_transport and self.transport is not None:
            # the client keeps the closed connection until connect() gives it the new one: _need_client() lets no op
            # reach it meanwhile (self.transport is None)
            old, self.transport = self.transport, None
            try:
                await old.close()
            except TransportError as exc:  # the old connection is gone anyway; say so, then open a new one
                self.close_error = f"closing the old connection to {self.host}: {exc}"
        await self.connect()
        if self.client is not None:
            self.client.transport = self._need_transport()

    def _need_transport(self) -> Transport:
        if self.transport is None:
            raise SourceError(f"not connected to {self.host}", SourceErrorKind.CONNECTION)
        return self.transport

    def _need_client(self) -> RunClient:
        if self.client is None:
            raise SourceError("no run dir given (regen tui HOST --run-dir DIR)" if self.run_dir is None
                              else f"not connected to {self.host}",
                              SourceErrorKind.NO_SUPERVISOR if self.run_dir is None else SourceErrorKind.CONNECTION)
        self._need_transport()  # a failed reconnect left the client without a connection
        return self.client

    async def _close_channel(self, client: RunClient) -> None:
        try:
            await client.close_channel()
        except RunClientError as exc:  # its process is gone with the connection anyway; say so
            self.close_error = str(exc)

    async def _call(self, op: str, *args):
        client = self._need_client()
        async with self._connecting:
            await self._ensure_channel()
        try:
            return await getattr(client, op)(*args)
        except RunClientError as exc:
            raise _classify(exc) from exc

    async def status(self, shards: bool = True) -> RunStatus:
        """shards=False: without the shard list (RunClient.status)."""
        return await self._call("status", shards)

    async def last_status(self) -> RunStatus:
        """What the run dir recorded (engine.ctl last-status): for a run whose supervisor is gone."""
        return await self._call("last_status")

    async def resume_hint(self) -> ResumeHint:
        """`cd DIR && regen start ...` from the run's start record, or why there is none (console.host.start_record)."""
        if self.client is None:
            await self.connect()
        client = self._need_client()  # none without a run dir: no start record to read
        record, why = await start_record.read(self._need_transport(), client.run_dir)
        return ResumeHint(record.resume_hint(), record.where()) if record is not None else ResumeHint(note=why)

    async def pause(self, shards: list[str] | None) -> ShardsChanged:
        return await self._call("pause", shards)

    async def resume(self, shards: list[str] | None) -> ShardsChanged:
        return await self._call("resume", shards)

    async def restart_worker(self, name: str) -> WorkerRestarted:
        return await self._call("restart_worker", name)

    async def follow(self, since: float | None) -> AsyncIterator[Event]:
        """The run's events (RunClient.follow). A control channel whose process ended while the connection holds is
        opened again here (the operator is told) and the follow goes on from the last event's ts: a new connection
        is for a lost one."""
        client = self._need_client()
        reopened = False  # the channel was opened again and no event came since: its next end is not retried here
        while True:
            try:
                async for ev in client.follow(since, on_malformed=self._malformed):
                    since, reopened = ev.ts, False
                    yield ev
                return
            except TransportError as exc:
                raise SourceError(f"telemetry stream from {self.host} ended ({exc.kind}): {exc}",
                                  SourceErrorKind.CONNECTION) from exc
            except RunClientError as exc:
                ended = exc.__cause__
                if not (isinstance(ended, ChannelClosed) and ended.transport is None) or reopened:
                    raise _classify(exc) from exc
                reopened = True
                async with self._connecting:
                    await self._ensure_channel()

    def _malformed(self, why: str) -> None:
        """A telemetry line that is not an event of this console's wire: skipped, and said once per kind of fault."""
        self._notes.append(SourceNote("warning", f"{why} (line skipped)", key=f"console.malformed.{why[:120]}"))

    async def _run(self, command: str, timeout: float, what: str):
        assert self.transport is not None
        try:
            return await self.transport.run(command, timeout=timeout)
        except TransportError as exc:
            raise SourceError(f"{what}: cannot reach {self.host}: {exc}", SourceErrorKind.CONNECTION) from exc

    async def log_tail(self, worker: str, lines: int = LOG_TAIL_LINES) -> str:
        """The supervisor reads the log where the server runs (a [[hosts]] host, a [slurm] job's dir); with no
        supervisor (an ended run) or an engine without the op, the run dir's own workers/ are read here."""
        client = self._need_client()
        try:
            return (await client.log_tail(worker, lines)).text
        except NoSupervisor:
            pass
        except RunClientError as exc:
            if "unknown op" not in str(exc) and "invalid choice" not in exc.stderr:
                raise _classify(exc) from exc
        path = f"{client.run_dir}/workers/{worker}/server.log"
        res = await self._run(f"tail -n {int(lines)} -- {shlex.quote(path)}", TAIL_TIMEOUT_S, f"log of {worker}")
        if res.exit_status != 0:
            why = res.error or (f"exit status {res.exit_status}" if res.exit_status is not None else "no exit status")
            raise SourceError(f"tail {path} on {self.host}: {why}; stderr: {res.stderr.strip() or '(empty)'}")
        return res.stdout

    async def stats(self) -> RunStats:
        client = self._need_client()
        command = engine_command(client.host_python, ["-m", "engine.store.stats", client.run_dir, "--json"],
                                 engine_path=client.engine_path)
        res = await self._run(command, STATS_TIMEOUT_S, "stats")
        # exit 0: fine, 1: quality flagged (both print the stats JSON); 2: the run dir could not be read
        last = next((ln for ln in reversed(res.stdout.splitlines()) if ln.startswith("{")), None)
        if last is None:
            why = res.error or f"exit status {res.exit_status}"
            raise SourceError(f"`{command}` on {self.host}: {why}, no JSON; stderr: {res.stderr.strip()[-500:] or '(empty)'}")
        data = orjson.loads(last)
        if "error" in data:
            raise SourceError(f"stats of {client.run_dir}: {data['error']}")
        try:
            return RunStats.from_dict(data, f"the stats report of {client.run_dir} on {self.host}")
        except WireError as exc:
            raise SourceError(str(exc)) from exc

    async def probes(self, only: set[str] | None = None) -> ProbeReport:
        from console.host.preflight import fleet_probes
        from probes.catalog import CATALOG
        from probes.runner import run_probes

        connect_s = 0.0
        if self.transport is None:
            started = time.monotonic()
            await self.connect()
            connect_s = time.monotonic() - started
        try:
            cfg, ctx, live = await self._probe_context()
        except ConfigError as exc:  # the run's config fails the schema: the `config` probe says each error
            return config_failed_report(self.host, exc)
        # a running supervisor's workers hold the worker ports: "ports busy" would be a false FAIL
        catalog = [p for p in CATALOG if not (live and p.id == "ports")]
        if cfg is None or not cfg.hosts:
            report = await run_probes(self.transport, self.host, ctx, only, catalog=catalog)
            report.connect_s = connect_s  # the summary says the whole wait, the connection's share with it
        else:
            report = await fleet_probes(self.transport, self.host, cfg, only, catalog, self.ssh)
        if cfg is not None:
            report.results.insert(0, config_passed(cfg, report))
        return report

    async def _probe_context(self):
        from console.host.preflight import context_from_config
        from engine.config.load import config_from_dict
        from probes.context import ProbeContext

        python = self.client.host_python if self.client else self.host_python
        if self.client is None:
            return None, ProbeContext(python=python), False
        path = f"{self.client.run_dir}/run.toml"
        res = await self._run(f"cat -- {shlex.quote(path)}", TAIL_TIMEOUT_S, "read run.toml")
        if res.exit_status != 0:
            return None, ProbeContext(python=python), False
        try:
            data = tomllib.loads(res.stdout)
        except tomllib.TOMLDecodeError as exc:
            raise SourceError(f"{self.host}:{path} is not a usable run config: {exc}") from exc
        cfg = config_from_dict(data, source_path=f"{self.host}:{path}")  # a ConfigError is the report's config FAIL
        live = True
        try:
            await self.status()
        except SourceError:
            live = False
        # attached to this run dir: its live supervisor is the run's own (run_dir.resume says so, not FAIL)
        return cfg, dataclasses.replace(context_from_config(cfg), attached=True), live

    async def close(self) -> None:
        if self.client is not None:
            await self._close_channel(self.client)
        if self._owns_transport and self.transport is not None:
            await self.transport.close()


class ReplaySource:
    """A recorded telemetry.jsonl (a finished run, or frozen data for tests): read-only.

    follow() yields every recorded event (from `since`) and ends, like following a run whose
    supervisor has exited; control operations are refused with a message."""

    supervised = False  # a recording ends; nothing died

    def __init__(self, telemetry: Path, *, status: RunStatus | None = None, stats: dict[str, Any] | None = None,
                 logs: dict[str, str] | None = None, probe_report: ProbeReport | None = None, host: str = "replay",
                 run_dir: str | None = None):
        self.telemetry = Path(telemetry)
        self.host = host
        self.run_dir = run_dir or str(self.telemetry.parent)
        self._status = status
        self._stats = stats
        self._logs = logs or {}
        self._report = probe_report
        self.requests: list[tuple[str, Any]] = []
        self.protocol_note = ""
        self._notes: list[SourceNote] = []

    def take_notes(self) -> list[SourceNote]:
        notes, self._notes = self._notes, []
        return notes

    async def connect(self) -> None:
        if not self.telemetry.exists():
            raise SourceError(f"{self.telemetry}: no such file (FileNotFoundError)", SourceErrorKind.ERROR)

    async def reconnect(self) -> None:
        await self.connect()

    async def status(self, shards: bool = True) -> RunStatus:
        if self._status is None or not self._status.running:
            raise SourceError("replay: no supervisor (a recorded run)", SourceErrorKind.NO_SUPERVISOR)
        return self._status

    async def resume_hint(self) -> ResumeHint:
        return ResumeHint()  # a replay is not resumed from here

    async def last_status(self) -> RunStatus:
        """A recording with an offline status (running false) has one; otherwise there is nothing more to read."""
        if self._status is not None and not self._status.running:
            return self._status
        raise SourceError("replay: no last status recorded", SourceErrorKind.NO_SUPERVISOR)

    def _refuse(self, op: str, arg: Any) -> NoReturn:
        self.requests.append((op, arg))
        raise SourceError(f"{op}: a replay of {self.telemetry} is read-only")

    async def pause(self, shards):
        return self._refuse("pause", shards)

    async def resume(self, shards):
        return self._refuse("resume", shards)

    async def restart_worker(self, name):
        return self._refuse("restart_worker", name)

    async def follow(self, since: float | None) -> AsyncIterator[Event]:
        with open(self.telemetry, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    ev = parse_event(line)
                except UnknownEventType:
                    continue  # an event type this console does not know
                except ValueError as exc:
                    self._notes.append(SourceNote("warning", f"{self.telemetry}: {exc} (line skipped)",
                                                  key=f"console.malformed.{str(exc)[:120]}"))
                    continue
                if since is None or ev.ts >= since:
                    yield ev

    async def log_tail(self, worker: str, lines: int = LOG_TAIL_LINES) -> str:
        if worker in self._logs:
            return self._logs[worker]
        path = self.telemetry.parent / "workers" / worker / "server.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            raise SourceError(f"log of {worker}: {path}: {exc}") from exc

    async def stats(self) -> RunStats:
        if self._stats is not None:
            return RunStats.from_dict(self._stats, "the recorded stats report")
        from engine.store.stats import compute_stats
        from engine.store.stats_parts import StatsReadError

        try:
            return compute_stats(self.telemetry.parent)
        except StatsReadError as exc:
            raise SourceError(str(exc)) from exc

    async def probes(self, only: set[str] | None = None) -> ProbeReport:
        if self._report is None:
            return ProbeReport(host=self.host, results=[], started_at=time.time(), duration_s=0.0)
        if only:
            return ProbeReport(self._report.host, [r for r in self._report.results if r.id in only],
                               self._report.started_at, self._report.duration_s)
        return self._report

    async def close(self) -> None:
        return None
