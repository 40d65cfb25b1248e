"""Workers tab: a multi-host run's hosts (a [slurm] run's allocations), one row per GPU worker, tok/s sparklines,
throughput and VRAM charts, the log tail."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Label, Log

from console.view.batch_text import batch_text, queued_text
from console.view.cache_text import cache_text
from console.view.tuning_text import conservativeness_text, retracted_text
from console.view.log_polls import without_polls
from console.tui.charts import TimeChart
from console.tui.host_table import HostTable
from console.view.host_table import groups_text
from console.view.liveness import Freshness
from console.view.model import RunModel
from console.view.model_parts import WorkerView, na
from console.tui.sparkline import ScaledSparkline, on_scale
from console.tui.widgets import FigureTable, selected_row_key, styled, sync_table
from engine.api.wire import LIVE_WORKER_STATES, in_flight_text, pid_text

# numbers and states first, the text columns last: a narrow terminal scrolls them off, never the figures
COLUMNS = ["worker", "state", "pid", "gpus", "tok/s", "running", "queued", "in flight", "VRAM used/total", "util",
           "temp", "restarts", "retracted", "conserv.", "batch (source)", "cache hit", "error"]


LOG_LINES = 200  # what the host sends (HostSource.log_tail)
SPARK_POINTS = 120  # four minutes at the supervisor's 2 s tick
SIMULATED_PREFIX = "simulated"


def no_gpu_text(m: RunModel) -> str:
    """Why the VRAM chart is empty, for its body."""
    errors = sorted({(f"{g.host}: " if g.host else "") + g.error for g in m.gpus.values() if g.error})
    if errors:
        return "no GPU readings: " + "; ".join(errors)
    return "no GPU readings yet" if not m.gpus else "no GPU memory readings"


def worker_cells(m: RunModel, w: WorkerView) -> tuple:
    """One row; a worker whose figures are no longer live (console/view/liveness.py) shows why instead of its last
    readings: `gone`, `ended`, `stale 14s` (the state it last reported beside it), its rates and requests as "-"."""
    alive = m.worker_liveness(w)
    g = m.worker_gpu(w)
    used, total = g["mem_used_mb"], g["mem_total_mb"]
    vram = "N/A" if used is None or total is None else f"{used / 1024:.1f}/{total / 1024:.1f} GiB"
    if alive.freshness in (Freshness.ENDED, Freshness.GONE) and w.state in LIVE_WORKER_STATES:
        state = Text(f"{alive.mark()} (was {w.state})", style="bold red" if alive.freshness is Freshness.GONE else "dim")
    elif alive.freshness is Freshness.STALE:
        state = Text(f"{w.state} ({alive.mark(m.last_ts)})", style="yellow")
    else:
        state = styled(w.state)
    if alive.freshness in (Freshness.ENDED, Freshness.GONE):
        gone = "-"
        return (w.name, state, pid_text(w.pid, w.node, w.job_id), ",".join(map(str, w.gpus)), gone, gone, gone, gone,
                gone, gone, gone,
                str(w.restarts), gone, conservativeness_text(w.conservativeness, w.conservativeness_source),
                batch_text(w.batch_size, w.batch_source, w.discovered_batch, w.discovered_source),
                cache_text(w.prompt_tokens, w.cached_tokens), (w.error or alive.why)[:60])
    return (w.name, state, pid_text(w.pid, w.node, w.job_id), ",".join(map(str, w.gpus)), na(w.tok_s, "{:,.0f}"),
            na(w.running, "{:.0f}"), queued_text(w.queued, w.held),
            in_flight_text(w.in_flight, w.capacity, w.in_flight_source, m.router_in_flight), vram,
            na(g["util_pct"], "{:.0f}%"), na(g["temp_c"], "{:.0f}°C"), str(w.restarts), retracted_text(w.retracted),
            conservativeness_text(w.conservativeness, w.conservativeness_source),
            batch_text(w.batch_size, w.batch_source, w.discovered_batch, w.discovered_source),
            cache_text(w.prompt_tokens, w.cached_tokens), (w.error or "")[:60])


class WorkersPanel(Vertical):
    BINDINGS = [
        Binding("x", "app.restart_worker", "Restart worker"),
        Binding("l", "app.refresh_log", "Reload log"),
        Binding("h", "toggle_polls", "Show polls"),
    ]

    def compose(self) -> ComposeResult:
        self._groups = Label(id="slurm-groups")  # a [slurm] run's groups granted / pending / wanted
        self._groups.display = False
        self._groups_shown: Text | None = None
        yield self._groups
        self._hosts = HostTable(id="hosts-table")
        yield self._hosts
        table = FigureTable(id="workers-table", cursor_type="row", zebra_stripes=True)
        # kept, not queried: timers may still ask for the selection while the app tears the DOM down
        self._table = table
        for c in COLUMNS:
            table.add_column(c, key=c)
        yield table
        self._throughput = TimeChart("throughput (tok/s)", "tok/s", id="throughput-chart")
        self._vram = TimeChart("VRAM used (GiB)", "GiB", id="vram-chart")
        with Horizontal(id="workers-charts"):
            yield self._throughput
            yield self._vram
        with Horizontal(id="workers-bottom"):
            self._sparks = VerticalScroll(id="sparklines")
            self._sparks.border_title = "tok/s per worker"
            self._spark_rows: dict[str, ScaledSparkline] = {}
            yield self._sparks
            self._log = Log(id="worker-log", max_lines=LOG_LINES + 1)  # + the empty line after the last newline
            self._log.border_title = "server.log"
            self._log_shown: tuple[str, list[str]] | None = None  # (worker, lines) the log shows
            self._log_raw: tuple[str, str, str] | None = None  # (worker, text, error) as the host sent it
            self.show_polls = False  # regen's own GET /metrics, /health ... lines: most of a tail
            yield self._log

    @property
    def selected_worker(self) -> str | None:
        return selected_row_key(self._table)

    def refresh_from(self, m: RunModel) -> None:
        groups = groups_text(m)
        if groups != self._groups_shown:  # set only on a change: each update asks the screen for a layout
            self._groups_shown = groups
            self._groups.display = groups is not None
            self._groups.update(groups or "")
        self._hosts.show(m)
        rows = []
        for w in sorted(m.workers.values(), key=lambda w: (w.host, w.name)):
            rows.append((w.name, worker_cells(m, w)))
        sync_table(self._table, rows, COLUMNS)
        self._sparklines(m)
        series = [("all", m.throughput, 1.0)] + [(w.name, w.tok_history, 1.0)
                                                  for w in sorted(m.workers.values(), key=lambda w: w.name)]
        self._throughput.draw(series)
        gpus = sorted(m.gpus.values(), key=lambda g: (g.host, g.index))
        vram = self._vram
        vram.draw([(g.label, g.mem_history, 1 / 1024) for g in gpus], empty=no_gpu_text(m))
        simulated = sorted({g.name for g in gpus if g.name and g.name.startswith(SIMULATED_PREFIX)})
        vram.border_subtitle = ", ".join(simulated)

    def _sparklines(self, m: RunModel) -> None:
        """One scale for every worker (0 to the highest rate any of them showed), printed in the title: a slow
        worker reads as slow next to a fast one."""
        box = self._sparks
        workers = sorted(m.workers.values(), key=lambda w: (w.host, w.name))
        recent = {w.name: w.tok_history.values()[-SPARK_POINTS:] for w in workers}
        top = max((max(v) for v in recent.values() if v), default=0.0)
        length = max((len(v) for v in recent.values()), default=0)
        box.border_title = f"tok/s per worker (scale 0–{top:,.0f})"
        for w in workers:
            values = on_scale(recent[w.name], top, length)
            if (spark := self._spark_rows.get(w.name)) is not None:
                spark.data = values
            else:
                spark = self._spark_rows[w.name] = ScaledSparkline(values)
                row_id = f"spark-{w.name.encode().hex()}"  # a multi-host name (h1.gpu0) is no valid widget id
                box.mount(Horizontal(Label(f"{w.name:>8} "), spark, id=row_id, classes="spark-row"))

    def action_toggle_polls(self) -> None:
        self.show_polls = not self.show_polls
        self._log_shown = None  # rewritten whole: the lines shown change
        if self._log_raw is not None:
            self.show_log(*self._log_raw)

    def show_log(self, worker: str, text: str, error: str = "") -> None:
        """The log shows `text` (the tail of the worker's server.log) without regen's own polls unless asked (`h`);
        a tail that continues the one shown is appended, not rewritten: clearing the log asks the whole screen for a
        layout every LOG_EVERY_S."""
        self._log_raw = (worker, text, error)
        log = self._log
        title = f"{worker}: server.log (last {LOG_LINES} lines"
        if error:
            lines = [f"(could not read the log: {error})"]
        elif not text:
            lines = ["(empty log)"]
        elif self.show_polls:
            lines = text.splitlines()
            title += "; h hides regen's polls"
        else:
            tail = without_polls(text.splitlines())
            lines = tail.lines or ["(only regen's polls)"]
            if tail.polls_hidden:
                title += f"; {tail.polls_hidden} of regen's polls hidden, h shows them"
        log.border_title = title + ")"
        body = "\n".join(lines) + "\n"
        shown = self._log_shown
        self._log_shown = (worker, lines)
        if shown is not None and shown[0] == worker and not error and text:
            new = appended(shown[1], lines)
            if new is not None:
                if new:
                    log.write("\n".join(new) + "\n")
                return
        log.clear()
        log.write(body)


def appended(old: list[str], new: list[str]) -> list[str] | None:
    """What to append to a log showing `old` for it to end with `new`: the lines of `new` after the longest start
    of it that `old` ends with; None if `new` does not continue `old` (a rotated or truncated log)."""
    if not old or not new:
        return None
    last = old[-1]
    for k in range(min(len(old), len(new)), 0, -1):  # overlap, longest first
        if new[k - 1] == last and old[-k:] == new[:k]:
            return new[k:]
    return None
