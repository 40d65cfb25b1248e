"""The console app's on-demand readings: a worker's log tail, the run's stats (the Data quality tab) and the probes (the
Preflight tab), each fetched in its own Textual worker, and the probe report's export."""
from __future__ import annotations

import json
import time

from textual import work

from console.host.follow import SourceError
from console.tui.app_base import AppBase
from console.tui.messages import LogTail, ProbeReportReady, StatsReceived


class PanelsApp(AppBase):
    """The log, stats and probe workers and their key actions."""

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
