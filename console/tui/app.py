"""The operations console: RegenApp(source) and run_tui(host, run_dir).

I/O runs in Textual workers (one group per job) and comes back as typed messages
(console/tui/messages.py); the model (console/view/model.py) folds it; only the visible tab
redraws. Quitting or losing the connection never stops the run: the app sends no stop.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Callable

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Footer, TabbedContent, TabPane

from console.host.follow import Backoff, FollowState, RunFollower
from console.view.model import ConnectionState
from console.tui.messages import (ConnectionChanged, ControlDone, LogTail, ProbeReportReady, StatsReceived,
                                  StatusReceived, TelemetryBatch)
from console.view.model import AlertView, RunModel
from console.tui.palette import RegenCommands
from console.tui.panel_alerts import AlertsPanel
from console.tui.panel_disk import DiskPanel
from console.tui.panel_preflight import PreflightPanel
from console.tui.panel_quality import QualityPanel
from console.tui.panel_shards import ShardsPanel
from console.tui.panel_workers import WorkersPanel
from console.tui.screens import ConfirmScreen, HelpScreen
from console.host.ssh_options import SshOptions
from console.host.source import DataSource, HostSource, SourceError
from console.tui.widgets import NextStep, RunHeader
from engine.api.ops import ShardsChanged, WorkerRestarted
from engine.api.status import RunStatus
from console.view.model import ResumeHint

BATCH_INTERVAL_S = 0.25  # telemetry is posted at most 4 times a second
STATUS_EVERY_S = 10.0
# the periodic status leaves out the shard list (the shard events keep it; 10,000 shards are ~2 MB a reply): the
# follower asks a full one at each (re)connect, and a poll does when none came for this long, in case an event was
# lost (telemetry not writable)
FULL_STATUS_EVERY_S = 300.0
STATS_EVERY_S = 30.0
LOG_EVERY_S = 5.0
BACKFILL_S = 3600.0  # on first attach: the last hour of telemetry
BACKOFF_MAX_S = 60.0
DISCONNECTED = (ConnectionState.RECONNECTING, ConnectionState.LOST)
_NOT_PROBED = object()
LOST_AFTER = 5  # failed attempts before "reconnecting" becomes "lost"
REFUSED_TOAST_S = 600.0  # the host refused us (host key, auth): the remedy stays on screen
ENDED_CHECK_S = 15.0
NOTIFY_MAX_AGE_S = 120.0  # backfilled alerts older than this go to the list, not to a toast
CONTROL_CHUNK = 1000  # shard ids per control command (a command line on the host stays far under its limits)

CONTROL_ACTIONS = ("pause_shard", "resume_shard", "pause_all", "resume_all", "restart_worker")
TABS = ["preflight", "workers", "shards", "quality", "disk", "alerts"]
PANEL_OF_SECTION = {"workers": "workers", "shards": "shards", "disk": "disk", "alerts": "alerts", "stats": "quality"}


class RegenApp(App):
    TITLE = "regen"
    COMMANDS = App.COMMANDS | {RegenCommands}
    CSS = """
    RunHeader { height: 1; background: $panel; }
    TabbedContent { height: 1fr; }
    #hosts-table { height: auto; max-height: 7; margin-bottom: 1; }
    #workers-table { height: auto; max-height: 11; }
    #workers-charts { height: 14; }
    #workers-bottom { height: 1fr; }
    #sparklines { width: 44; border: round $primary; border-title-align: left; }
    .spark-row { height: 1; }
    .spark-row Label { width: 10; }
    .spark-row Sparkline { width: 1fr; }
    #worker-log { width: 1fr; border: round $primary; }
    TimeChart { border: round $primary; width: 1fr; }
    #disk-table { height: auto; }
    #disk-chart { height: 1fr; }
    #shards-hints { height: auto; padding: 0 1; color: $text-muted; }
    #shards-summary, #preflight-summary, #quality-status { height: auto; padding: 0 1; }
    #probe-table { width: 3fr; }
    #probe-detail-box { width: 2fr; }
    #loss-hist { width: 1fr; border: round $primary; }
    #quality-figures-box { width: 1fr; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit (run continues)"),
        Binding("q", "quit_ended", "Quit"),  # shown instead of the one above once the run's supervisor is gone
        Binding("question_mark", "help", "Help"),
        Binding("ctrl+r", "reconnect", "Reconnect"),
        Binding("y", "copy_next_step", "Copy resume line"),
        *[Binding(str(i + 1), f"tab('{t}')", t.capitalize(), show=False) for i, t in enumerate(TABS)],
    ]

    def __init__(self, source: DataSource, *, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, live: bool = True,
                 export_dir: Path | None = None, run_probes_on_start: bool = True):
        """live=False: no timers and no background polling (frozen data for snapshots); clock/monotonic: the
        time the header shows (frozen in tests)."""
        super().__init__()
        self.source = source
        self.clock = clock
        self.monotonic = monotonic
        self.live = live
        self.export_dir = export_dir or Path.cwd()
        self.run_probes_on_start = run_probes_on_start
        self.model = RunModel(source.host, source.run_dir or "")
        self._stale: set[str] = set(TABS)
        self._wake_follow = asyncio.Event()
        self._follower: RunFollower | None = None
        self._log_worker: str | None = None
        self.events_applied = 0
        self.last_event_on_screen: tuple[float, float] | None = None  # (event ts, wall time it was drawn)
        self._full_status_at: float | None = None  # monotonic time of the last status with its shard list
        self._hints_gone = False  # the footer's hints are a gone run's (no pause/resume, plain Quit)
        self._probed_supervisor: object = _NOT_PROBED  # the supervisor pid run_dir.resume last saw (None: none)

    # -- layout ------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield RunHeader(id="run-header")
        yield NextStep(id="next-step")
        with TabbedContent(initial="workers", id="tabs"):
            with TabPane("Preflight", id="preflight"):
                yield PreflightPanel(id="panel-preflight")
            with TabPane("Workers", id="workers"):
                yield WorkersPanel(id="panel-workers")
            with TabPane("Shards", id="shards"):
                yield ShardsPanel(id="panel-shards")
            with TabPane("Data quality", id="quality"):
                yield QualityPanel(id="panel-quality")
            with TabPane("Disk", id="disk"):
                yield DiskPanel(id="panel-disk")
            with TabPane("Alerts", id="alerts"):
                yield AlertsPanel(id="panel-alerts")
        yield Footer()

    def on_mount(self) -> None:
        self.title = f"regen · {self.source.host}"
        # kept, not queried: a modal screen on top must not hide them from the data handlers
        self._header = self.query_one(RunHeader)
        self._next_step = self.query_one(NextStep)
        self._tabs = self.query_one("#tabs", TabbedContent)
        self._panels = {t: self.query_one(f"#panel-{t}") for t in TABS}
        self._draw_header()
        self.start_io()
        if self.live:
            self.set_interval(1.0, self._draw_header)
            self.set_interval(STATUS_EVERY_S, self.poll_status)
            self.set_interval(STATS_EVERY_S, self._stats_tick)
            self.set_interval(LOG_EVERY_S, self._log_tick)

    def start_io(self) -> None:
        self.follow_telemetry()
        self.fetch_resume_hint()

    @work(group="hint", exit_on_error=False)
    async def fetch_resume_hint(self) -> None:
        """The run's start record, read once: a death shows the `regen start` that resumes this run."""
        try:
            self.model.resume_hint = await self.source.resume_hint()
        except SourceError as exc:
            self.model.resume_hint = ResumeHint(note=f"the run's start record could not be read: {exc}")
        if self.run_probes_on_start:
            self.run_probes()

    @property
    def active_tab(self) -> str:
        return self._tabs.active

    def panel(self, tab: str):
        return self._panels[tab]

    # -- drawing -----------------------------------------------------------------------------
    def _draw_header(self) -> None:
        self._header.show(self.model, self.clock(), self.monotonic())
        self._next_step.show(self.model)

    def action_copy_next_step(self) -> None:
        """The resume line to the terminal's clipboard (OSC 52: works over SSH where the terminal allows it)."""
        hint = self.model.next_step()
        if hint is None or not hint.command:
            self.notify("nothing to copy: the run is live" if hint is None else hint.note, title="resume line")
            return
        self.copy_to_clipboard(hint.command)
        self.notify(hint.command, title="copied to the clipboard")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """A run whose supervisor is gone (a replay, a finished run) has nothing to pause, resume or restart, and
        no run that continues after quitting: those hints are hidden."""
        ended = self._run_gone()
        if action in CONTROL_ACTIONS or action == "quit":
            return not ended
        if action == "quit_ended":
            return ended
        if action == "copy_next_step":
            return self.model.next_step() is not None
        return True

    def _run_gone(self) -> bool:
        return self.model.gone

    async def action_quit_ended(self) -> None:
        await self.action_quit()

    def _mark(self, sections: set[str]) -> None:
        gone = self._run_gone()
        if gone != self._hints_gone and self.screen_stack:  # none while the app shuts down
            self._hints_gone = gone
            self.refresh_bindings()  # the supervisor went (or came back): the footer's hints follow
        for s in sections:
            if s in PANEL_OF_SECTION:
                self._stale.add(PANEL_OF_SECTION[s])
        self._draw_header()
        self._draw_active()

    def _draw_active(self) -> None:
        tab = self.active_tab
        if tab in self._stale and tab != "preflight":
            self._stale.discard(tab)
            self.panel(tab).refresh_from(self.model)

    @on(TabbedContent.TabActivated)
    def _tab_shown(self, event: TabbedContent.TabActivated) -> None:
        self._draw_active()
        tab = self.active_tab
        if tab == "quality" and (self.model.stats_at is None or self.clock() - self.model.stats_at > STATS_EVERY_S):
            self.fetch_stats()
        if tab == "workers":
            self._log_tick()
        self._focus_table(tab)

    def _focus_table(self, tab: str) -> None:
        """Focus the tab's table (else its first focusable widget, else nothing): focus left in the hidden
        tab would switch TabbedContent straight back to it (key 4 on the Preflight tab did nothing)."""
        panel = self.panel(tab)
        tables = [w for w in panel.query("DataTable, ShardTable") if w.focusable]  # not the Workers tab's hosts
        focusable = [w for w in panel.query("*") if w.focusable]
        target = tables[0] if tables else (focusable[0] if focusable else None)
        if target is not None:
            target.focus()
        else:
            self.set_focus(None)

    # -- telemetry ---------------------------------------------------------------------------
    @work(exclusive=True, group="follow", exit_on_error=False)
    async def follow_telemetry(self, again: bool = False) -> None:
        """The one follow loop (console/host/follow.py) feeding the model. again: after a refusal, start over through
        source.reconnect() (which forgets the refusal)."""
        if self._follower is None:
            def on_state(st: FollowState) -> None:
                self.post_message(ConnectionChanged(st.state, st.retry_in_s, st.error))

            def on_status(status: RunStatus) -> None:
                self.post_message(StatusReceived(status))

            def on_warning(text: str) -> None:
                self.post_message(ControlDone("last_status", False, text))

            self._follower = RunFollower(
                self.source, since=self.model.last_ts if self.model.last_ts is not None else self.clock() - BACKFILL_S,
                on_state=on_state, on_status=on_status, on_warning=on_warning,
                backoff=Backoff(first_s=1.0, max_s=BACKOFF_MAX_S, lost_after=LOST_AFTER),
                ended_check_s=ENDED_CHECK_S, watch_ended=self.live, wake=self._wake_follow)
        await self._pump(self._follower.events(again))

    async def _fetch_last_status(self) -> None:
        """The supervisor is gone: what its run dir recorded (how it ended, its fatal cause) is the state to show."""
        try:
            status = await self.source.last_status()
        except SourceError as exc:
            if exc.kind != "no_supervisor":  # a recording without a status has nothing more to say; else: say it
                self.post_message(ControlDone("last_status", False, f"the run dir's last state could not be read: {exc}"))
            return
        self.post_message(StatusReceived(status))

    async def _pump(self, events) -> None:
        """Read events as they come; post them in batches, at most one batch per BATCH_INTERVAL_S."""
        buf: list = []
        arrived = asyncio.Event()

        async def read() -> None:
            async for ev in events:
                buf.append(ev)
                arrived.set()

        reader = asyncio.ensure_future(read())
        try:
            while True:
                waiter = asyncio.ensure_future(arrived.wait())
                await asyncio.wait({reader, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if buf:
                    batch = buf[:]
                    buf.clear()
                    arrived.clear()
                    self.post_message(TelemetryBatch(batch))
                    if not reader.done():
                        await asyncio.sleep(BATCH_INTERVAL_S)
                    continue
                if reader.done():
                    reader.result()  # raises the stream's error (SourceError) if it had one
                    return
        finally:
            if not reader.done():
                reader.cancel()

    def on_telemetry_batch(self, msg: TelemetryBatch) -> None:
        changed = self.model.apply_all(msg.events)
        if self._take_source_notes():  # e.g. a telemetry line skipped as malformed
            changed |= {"alerts", "header"}
        self.events_applied += len(msg.events)
        self._mark(changed)
        self._notify_alerts()
        if msg.events:
            self.last_event_on_screen = (msg.events[-1].ts, time.time())

    def _notify_alerts(self) -> None:
        now = self.clock()
        fresh = [a for a in self.model.take_new_alerts() if now - a.ts <= NOTIFY_MAX_AGE_S and a.severity != "info"]
        for a in fresh[-3:]:
            self.notify(a.text, title=f"{a.severity} ({a.origin})",
                        severity="error" if a.severity in ("error", "critical") else "warning",
                        timeout=10 if a.severity != "critical" else 30)

    def on_status_received(self, msg: StatusReceived) -> None:
        if not msg.status.shards_omitted:
            self._full_status_at = self.monotonic()
        self._take_source_notes()
        self._mark(self.model.apply_status(msg.status))
        self._notify_alerts()
        self._rejudge_resume()

    def _rejudge_resume(self) -> None:
        """run_dir.resume judges who runs the run dir: judged again when the supervisor changes (a new pid, or none)."""
        supervisor = self.model.pid if self.model.running else None
        if not self.run_probes_on_start or supervisor == self._probed_supervisor:
            return
        first = self._probed_supervisor is _NOT_PROBED
        self._probed_supervisor = supervisor
        if not first:  # the first status comes with the start's full probe run
            self.run_probes({"run_dir.resume"})

    def _take_source_notes(self) -> bool:
        """What the source saw on its way (an engine without the control channel, a channel reopened): alerts; the
        engine's protocol note also stays in the header. Whether anything changed."""
        notes = self.source.take_notes()
        changed = bool(notes) or self.model.protocol_note != self.source.protocol_note
        self.model.protocol_note = self.source.protocol_note
        for note in notes:
            self.model.add_alert(AlertView(self.clock(), note.severity, note.text, key=note.key, origin="console"))
        return changed

    def on_connection_changed(self, msg: ConnectionChanged) -> None:
        conn = self.model.connection
        before = conn.state
        conn.state, conn.error = ConnectionState(msg.state), msg.error
        conn.retry_at = None if msg.retry_in_s is None else self.monotonic() + msg.retry_in_s
        conn.since = self.monotonic()
        now = self.clock()
        if msg.state in DISCONNECTED and before not in DISCONNECTED:
            self.model.add_alert(AlertView(now, "error", f"connection lost: {msg.error}", key=f"console.conn.lost.{now}",
                                           origin="console"))
        elif msg.state == ConnectionState.CONNECTED and before in DISCONNECTED:
            self.model.add_alert(AlertView(now, "info", "connection regained; history backfilled",
                                           key=f"console.conn.ok.{now}", origin="console"))
            self.notify("connection regained; history backfilled", title="connection")
        elif msg.state == ConnectionState.REFUSED and before != ConnectionState.REFUSED:
            self.model.add_alert(AlertView(now, "critical", msg.error, key=f"console.refused.{now}", origin="console"))
            self.notify(msg.error, title="connection refused", severity="error", timeout=REFUSED_TOAST_S)
        elif msg.state == ConnectionState.ENDED and before != ConnectionState.ENDED and msg.error:
            # the stream's end and the control socket's refusal: the supervisor is gone; dead unless it said otherwise
            dead = getattr(self.source, "supervised", False) and self.model.mark_dead(now, msg.error)
            if not dead:
                self.model.add_alert(AlertView(now, "info", msg.error, key=f"console.ended.{msg.error}",
                                               origin="console"))
        self._take_source_notes()
        # every figure's liveness follows the connection and the supervisor (console/view/liveness.py); "shards": its
        # control hints follow the run being gone
        self._mark({"alerts", "header", "shards", "workers", "disk"})
        self._notify_alerts()

    @work(exclusive=True, group="status", exit_on_error=False)
    async def poll_status(self) -> None:
        if self.model.connection.state != ConnectionState.CONNECTED:
            return
        full = self._full_status_at is None or self.monotonic() - self._full_status_at >= FULL_STATUS_EVERY_S
        try:
            status = await self.source.status(shards=full)
        except SourceError as exc:
            if exc.kind == "no_supervisor":
                self.post_message(ConnectionChanged(ConnectionState.ENDED, error=str(exc)))
                await self._fetch_last_status()
            return  # a connection failure shows through the telemetry stream's reconnect
        self.post_message(StatusReceived(status))

    def action_reconnect(self) -> None:
        if self.model.connection.state == ConnectionState.REFUSED:  # the follow worker stopped: start it again
            self.follow_telemetry(again=True)
        self._wake_follow.set()
        self.poll_status()

    # -- control operations ------------------------------------------------------------------
    @work(group="control", exit_on_error=False)
    async def control(self, op: str, arg) -> None:
        label = {"pause": "pause", "resume": "resume", "restart_worker": "restart worker"}[op]
        target = "all shards" if arg is None else (arg if isinstance(arg, str) else shards_text(arg))
        # a selection of thousands of shards goes in chunks: each is one command line on the host
        calls = [arg] if arg is None or isinstance(arg, str) else [arg[i:i + CONTROL_CHUNK]
                                                                  for i in range(0, len(arg), CONTROL_CHUNK)]
        result: ShardsChanged | WorkerRestarted | None = None
        for n, chunk in enumerate(calls):
            try:
                result = await getattr(self.source, op)(chunk)
            except SourceError as exc:
                sent = f" ({n * CONTROL_CHUNK:,} of the {len(arg):,} were sent and done)" if n else ""
                self.post_message(ControlDone(op, False, f"{label} {target} failed: {exc}{sent}"))
                return
        self.post_message(ControlDone(op, True, f"{label} {target}: done", result))
        try:
            status = await self.source.status()
        except SourceError as exc:
            self.post_message(ControlDone(op, False, f"{label} {target} was sent, but status failed: {exc}"))
            return
        self.post_message(StatusReceived(status))

    def on_control_done(self, msg: ControlDone) -> None:
        if self._take_source_notes():
            self._mark({"alerts", "header"})
        self.notify(msg.text, title="control", severity="information" if msg.ok else "error",
                    timeout=5 if msg.ok else 15)

    def action_pause_shard(self) -> None:
        """Pause the selected shards, else the one under the cursor."""
        if targets := self.panel("shards").targets():
            self.control("pause", targets)

    def action_resume_shard(self) -> None:
        if targets := self.panel("shards").targets():
            self.control("resume", targets)

    def action_shards(self, op: str) -> None:
        """A Shards-tab action from the command palette (cycle_filter, cycle_sort, next_problem, select_listed,
        clear_selection): shown on the Shards tab."""
        self._tabs.active = "shards"
        getattr(self.panel("shards"), f"action_{op}")()

    def action_pause_all(self) -> None:
        self.control("pause", None)

    def action_resume_all(self) -> None:
        self.control("resume", None)

    def action_restart_worker(self) -> None:
        name = self.panel("workers").selected_worker
        if name is None:
            self.notify("no worker selected", severity="warning")
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self.control("restart_worker", name)

        self.push_screen(ConfirmScreen(f"Restart worker {name}?\n\nIts in-flight requests are aborted and re-queued;"
                                       " the server is stopped and launched again."), answered)

    # -- log tail, stats, probes --------------------------------------------------------------
    @on(DataTable.RowHighlighted, "#workers-table")
    def _worker_selected(self, event: DataTable.RowHighlighted) -> None:
        name = event.row_key.value
        if name != self._log_worker:
            self._log_worker = name
            self.fetch_log(name)

    def _log_tick(self) -> None:
        if self.active_tab == "workers" and (name := self.panel("workers").selected_worker):
            self._log_worker = name
            self.fetch_log(name)

    def action_refresh_log(self) -> None:
        self._log_tick()

    @work(exclusive=True, group="log", exit_on_error=False)
    async def fetch_log(self, worker: str) -> None:
        try:
            self.post_message(LogTail(worker, await self.source.log_tail(worker)))
        except SourceError as exc:
            self.post_message(LogTail(worker, "", str(exc)))

    def on_log_tail(self, msg: LogTail) -> None:
        self.panel("workers").show_log(msg.worker, msg.text, msg.error)

    def _stats_tick(self) -> None:
        if self.active_tab == "quality":
            self.fetch_stats()

    def action_refresh_stats(self) -> None:
        self.fetch_stats()
        self.notify("computing statistics on the host", timeout=3)

    @work(exclusive=True, group="stats", exit_on_error=False)
    async def fetch_stats(self) -> None:
        if self.source.run_dir is None:
            self.post_message(StatsReceived(None, "no run dir given (regen tui HOST --run-dir DIR)"))
            return
        try:
            self.post_message(StatsReceived(await self.source.stats()))
        except SourceError as exc:
            self.post_message(StatsReceived(None, str(exc)))

    def on_stats_received(self, msg: StatsReceived) -> None:
        self.model.stats_at = self.clock()
        if msg.stats is not None:
            self.model.stats, self.model.stats_error = msg.stats, ""
        else:
            self.model.stats_error = msg.error
        self._mark({"stats"})

    @work(exclusive=True, group="probes", exit_on_error=False)
    async def run_probes(self, only: set[str] | None = None) -> None:
        try:
            report = await self.source.probes(only)
        except SourceError as exc:
            self.notify(f"probes could not run: {exc}", severity="error", timeout=15)
            return
        self.post_message(ProbeReportReady(report, partial=only is not None))

    def on_probe_report_ready(self, msg: ProbeReportReady) -> None:
        self.panel("preflight").set_report(msg.report, msg.partial)

    def action_rerun_probes(self) -> None:
        self.notify("running every probe", timeout=3)
        self.run_probes()

    def action_rerun_probe(self) -> None:
        p = self.panel("preflight").selected_probe
        if p is not None:
            self.notify(f"running {p.id}", timeout=3)
            self.run_probes({p.id})

    def action_export_probes(self) -> None:
        report = self.panel("preflight").report
        if report is None:
            self.notify("no probe report yet", severity="warning")
            return
        host = "".join(c if c.isalnum() or c in "-_." else "_" for c in report.host)
        path = self.export_dir / f"probe-{host}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(self.clock()))}.json"
        try:
            path.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        except OSError as exc:
            self.notify(f"could not write {path}: {exc}", severity="error", timeout=15)
            return
        self.notify(f"probe report written to {path}", title="export")

    # -- navigation ----------------------------------------------------------------------------
    def action_tab(self, tab: str) -> None:
        self._tabs.active = tab

    def action_help(self) -> None:
        self.push_screen(HelpScreen())


def shards_text(ids: list[str]) -> str:
    return ", ".join(ids) if len(ids) <= 3 else f"{len(ids):,} shards ({ids[0]} … {ids[-1]})"


async def run_tui_async(host: str, run_dir: str | None, *, host_python: str = "python3", transport=None,
                        ssh: SshOptions = SshOptions(), accept_new_command: str | None = None) -> int:
    source = HostSource(host, run_dir, host_python=host_python, transport=transport, ssh=ssh,
                        accept_new_command=accept_new_command)
    app = RegenApp(source)
    try:
        await app.run_async()
    finally:
        await source.close()
    return int(app.return_code or 0)


def run_tui(host: str, run_dir: str | None, *, host_python: str = "python3", transport=None,
            ssh: SshOptions = SshOptions(), accept_new_command: str | None = None):
    """Run the console until the operator quits (the run is never stopped by it). Returns the exit code;
    called from inside a running event loop (e.g. `regen demo`), it returns the coroutine to await instead.
    ssh: the SSH options of every connection it opens; accept_new_command: what to run for a host whose key is
    not yet known (default: built from host, run dir and ssh)."""
    coro = run_tui_async(host, run_dir, host_python=host_python, transport=transport, ssh=ssh,
                         accept_new_command=accept_new_command)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    return coro
