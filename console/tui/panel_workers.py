"""Workers tab: one row per GPU worker, tok/s sparklines, throughput and VRAM charts, the log tail."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import DataTable, Label, Log, Sparkline

from console.batch_text import batch_text
from console.cache_text import cache_text
from console.tui.charts import TimeChart
from console.tui.model import RunModel, Series, na
from console.tui.widgets import selected_row_key, styled, sync_table

COLUMNS = ["worker", "state", "gpus", "tok/s", "running", "queued", "in flight", "batch (source)", "cache hit",
           "VRAM used/total", "util", "temp", "restarts", "error"]


class WorkersPanel(Vertical):
    BINDINGS = [
        Binding("x", "app.restart_worker", "Restart worker"),
        Binding("l", "app.refresh_log", "Reload log"),
    ]

    def compose(self) -> ComposeResult:
        table = DataTable(id="workers-table", cursor_type="row", zebra_stripes=True)
        # kept, not queried: timers may still ask for the selection while the app tears the DOM down
        self._table = table
        for c in COLUMNS:
            table.add_column(c, key=c)
        yield table
        with Horizontal(id="workers-charts"):
            yield TimeChart("throughput (tok/s)", "tok/s", id="throughput-chart")
            yield TimeChart("VRAM used (GiB)", "GiB", id="vram-chart")
        with Horizontal(id="workers-bottom"):
            sparks = VerticalScroll(id="sparklines")
            sparks.border_title = "tok/s per worker"
            yield sparks
            log = Log(id="worker-log", max_lines=400)
            log.border_title = "server.log"
            yield log

    @property
    def selected_worker(self) -> str | None:
        return selected_row_key(self._table)

    def refresh_from(self, m: RunModel) -> None:
        rows = []
        for w in sorted(m.workers.values(), key=lambda w: (w.host, w.name)):
            g = m.worker_gpu(w)
            used, total = g["mem_used_mb"], g["mem_total_mb"]
            vram = "N/A" if used is None or total is None else f"{used / 1024:.1f}/{total / 1024:.1f} GiB"
            rows.append((w.name, (
                w.name, styled(w.state), ",".join(map(str, w.gpus)), na(w.tok_s, "{:,.0f}"), na(w.running, "{:.0f}"),
                na(w.queued, "{:.0f}"), f"{w.in_flight}/{w.capacity}",
                batch_text(w.batch_size, w.batch_source, w.discovered_batch, w.discovered_source),
                cache_text(w.prompt_tokens, w.cached_tokens), vram, na(g["util_pct"], "{:.0f}%"),
                na(g["temp_c"], "{:.0f}°C"), str(w.restarts), (w.error or "")[:60])))
        sync_table(self._table, rows, COLUMNS)
        self._sparklines(m)
        series = [("all", m.throughput, 1.0)] + [(w.name, w.tok_history, 1.0)
                                                  for w in sorted(m.workers.values(), key=lambda w: w.name)]
        self.query_one("#throughput-chart", TimeChart).draw(series)
        gpu_series = [(g.label, g.mem_history, 1 / 1024) for g in sorted(m.gpus.values(), key=lambda g: (g.host, g.index))]
        vram = self.query_one("#vram-chart", TimeChart)
        if any(len(s) for _, s, _ in gpu_series):
            vram.draw(gpu_series)
            vram.border_subtitle = ""
        else:
            vram.clear()
            errors = {(f"{g.host}: " if g.host else "") + g.error for g in m.gpus.values() if g.error}
            vram.border_subtitle = ("N/A: " + "; ".join(sorted(errors))[:80]) if errors else "N/A: no GPU samples"

    def _sparklines(self, m: RunModel) -> None:
        box = self.query_one("#sparklines", VerticalScroll)
        for w in sorted(m.workers.values(), key=lambda w: (w.host, w.name)):
            row_id = f"spark-{w.name.encode().hex()}"  # a multi-host name (h1.gpu0) is no valid widget id
            found = box.query(f"#{row_id}")
            values = w.tok_history.values()[-120:] or [0.0]
            if found:
                found.first().query_one(Sparkline).data = values
            else:
                box.mount(Horizontal(Label(f"{w.name:>8} "), Sparkline(values), id=row_id, classes="spark-row"))

    def show_log(self, worker: str, text: str, error: str = "") -> None:
        log = self.query_one("#worker-log", Log)
        log.border_title = f"{worker}: server.log (last 200 lines)"
        log.clear()
        log.write(f"(could not read the log: {error})\n" if error else (text or "(empty log)\n"))
