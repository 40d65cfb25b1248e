"""The operations console: RegenApp(source) and run_tui(host, run_dir). I/O runs in Textual workers and comes back as
typed messages (console/tui/messages.py) the model folds; only the visible tab redraws. Quitting or losing the
connection never stops the run: the app sends no stop."""
from __future__ import annotations

import asyncio

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Footer, TabbedContent, TabPane

from console.host.source import HostSource
from console.host.follow import SourceError
from console.host.ssh_options import SshOptions
from console.tui.app_base import STATS_EVERY_S, STATUS_EVERY_S, TABS
from console.tui.app_control import ControlsApp
from console.tui.app_follow import FollowingApp
from console.tui.app_panels import PanelsApp
from console.tui.palette import RegenCommands
from console.tui.panel_alerts import AlertsPanel
from console.tui.panel_disk import DiskPanel
from console.tui.panel_preflight import PreflightPanel
from console.tui.panel_quality import QualityPanel
from console.tui.panel_shards import ShardsPanel
from console.tui.panel_workers import WorkersPanel
from console.tui.screens import HelpScreen
from console.tui.widgets import NextStep, RunHeader
from console.view.model_parts import ResumeHint

LOG_EVERY_S = 5.0
CONTROL_ACTIONS = ("pause_shard", "resume_shard", "pause_all", "resume_all", "restart_worker")


class RegenApp(FollowingApp, ControlsApp, PanelsApp):
    """The console: its layout, keys and tabs over the parts (the follow, the control ops, the readings)."""
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

    async def action_quit_ended(self) -> None:
        await self.action_quit()

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

    # -- the log of the worker under the cursor ----------------------------------------------------
    @on(DataTable.RowHighlighted, "#workers-table")
    def _worker_selected(self, event: DataTable.RowHighlighted) -> None:
        name = event.row_key.value
        if name != self._log_worker:
            self._log_worker = name
            self.fetch_log(name)

    # -- navigation ----------------------------------------------------------------------------
    def action_tab(self, tab: str) -> None:
        self._tabs.active = tab

    def action_help(self) -> None:
        self.push_screen(HelpScreen())


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
