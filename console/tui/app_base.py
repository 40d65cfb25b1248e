"""The console app's state and what every part of it shares: the model, the source, the tabs marked for a redraw (only
the visible one redraws). console.tui.app composes it with its parts: the follow (app_follow), the control ops
(app_control), the log, stats and probe workers (app_panels)."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Callable

from textual.app import App
from textual.widgets import TabbedContent

from console.host.follow import RunFollower
from console.host.source import DataSource
from console.tui.widgets import NextStep, RunHeader
from console.view.model import RunModel
from console.view.model_parts import AlertView
from engine.api.wire import Severity

STATUS_EVERY_S = 10.0
STATS_EVERY_S = 30.0
NOTIFY_MAX_AGE_S = 120.0  # backfilled alerts older than this go to the list, not to a toast
TABS = ["preflight", "workers", "shards", "quality", "disk", "alerts"]
PANEL_OF_SECTION = {"workers": "workers", "shards": "shards", "disk": "disk", "alerts": "alerts", "stats": "quality"}
NOT_PROBED = object()


class AppBase(App):
    """The state the app's parts share, and the redraw of what changed."""
    _header: RunHeader
    _next_step: NextStep
    _tabs: TabbedContent
    _panels: dict[str, Any]

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
        self._probed_supervisor: object = NOT_PROBED  # the supervisor pid run_dir.resume last saw (None: none)

    @property
    def active_tab(self) -> str:
        return self._tabs.active

    def panel(self, tab: str):
        return self._panels[tab]

    # -- drawing -----------------------------------------------------------------------------
    def _draw_header(self) -> None:
        self._header.show(self.model, self.clock(), self.monotonic())
        self._next_step.show(self.model)

    def _run_gone(self) -> bool:
        return self.model.gone

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

    def _notify_alerts(self) -> None:
        now = self.clock()
        fresh = [a for a in self.model.take_new_alerts()
                 if now - a.ts <= NOTIFY_MAX_AGE_S and a.severity != Severity.INFO]
        for a in fresh[-3:]:
            self.notify(a.text, title=f"{a.severity} ({a.origin})",
                        severity="error" if a.severity in (Severity.ERROR, Severity.CRITICAL) else "warning",
                        timeout=10 if a.severity != Severity.CRITICAL else 30)

    def _take_source_notes(self) -> bool:
        """What the source saw on its way (an engine without the control channel, a channel reopened): alerts; the
        engine's protocol note also stays in the header. Whether anything changed."""
        notes = self.source.take_notes()
        changed = bool(notes) or self.model.protocol_note != self.source.protocol_note
        self.model.protocol_note = self.source.protocol_note
        for note in notes:
            self.model.add_alert(AlertView(self.clock(), note.severity, note.text, key=note.key, origin="console"))
        return changed

    def run_probes(self, only: set[str] | None = None) -> Any:
        raise NotImplementedError  # console.tui.app_panels.PanelsApp's
