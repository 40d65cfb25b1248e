"""Data quality tab: the loss-mask histogram and the other figures of the stats report (engine.api.reports.RunStats),
flags highlighted."""
from __future__ import annotations

import time

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Static
from textual_plot import HiResMode

from console.tui.chart_frame import ChartFrame
from console.view.model import RunModel
from engine.api.reports import Count, RunStats
from engine.api.wire import Severity


SUPERSCRIPT = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")
HIST_LEGEND = "bar 2ᵏ: sums of 2ᵏ to 2ᵏ⁺¹−1"


def bin_label(low: int) -> str:
    """A log2 bin by its lower end: 0, or 2ᵏ (short enough that a dozen bins fit side by side)."""
    return "0" if low <= 0 else "2" + str(low.bit_length() - 1).translate(SUPERSCRIPT)


def _share(c: Count) -> str:
    return f"{c.count:,} ({c.share:.1%})"


def _num(v: float | None) -> str:
    return "N/A" if v is None else f"{v:,.0f}"


def figures(s: RunStats) -> Group:
    t = Table(show_header=False, box=None, expand=True)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("samples", f"{s.samples:,}")
    t.add_row("empty answers", _share(s.empty))
    t.add_row("truncated (length)", _share(s.truncated))
    t.add_row("stopped (repetition)", _share(s.repetition))
    t.add_row("aborted", _share(s.aborted))
    for k, c in s.reasoning.items():
        t.add_row(f"thinking {k}", _share(c))
    lm = s.loss_mask.distribution
    t.add_row("loss-mask sum", "  ".join(f"{k} {_num(v)}" for k, v in
                                         (("mean", lm.mean), ("min", lm.min), ("p50", lm.p50), ("p90", lm.p90),
                                          ("p99", lm.p99), ("max", lm.max))))
    cut = s.cut
    t.add_row(f"cut at {cut.train_max_length}",
              f"{cut.supervised_tokens_cut:,} of {cut.supervised_tokens_total:,} supervised "
              f"tokens ({cut.cut_share:.1%}); {cut.samples_cut:,} samples cut, "
              f"{cut.samples_unsupervised:,} unsupervised")
    mc = s.mask_check
    t.add_row("mask check", f"{mc.mode}: {mc.rows_checked:,} rows, {mc.mismatches} mismatches")
    parts = s.parts
    t.add_row("parts", f"{parts.read} read of {parts.committed} committed "
              f"({parts.listed_from}), {parts.uncommitted_ignored} uncommitted ignored")
    groups = Table(title="by worker / source", expand=True)
    for column in ("group", "samples", "empty", "truncated", "repetition", "mean output"):
        groups.add_column(column)
    for kind, members in (("worker", s.by_worker), ("source", s.by_source)):
        for g in members:
            groups.add_row(f"{kind} {g.name}", f"{g.samples:,}",
                           Text(_share(g.empty), style="bold red" if "empty" in g.flagged else ""),
                           Text(_share(g.truncated), style="yellow" if "truncated" in g.flagged else ""),
                           Text(_share(g.repetition), style="yellow" if "repetition" in g.flagged else ""),
                           "N/A" if g.mean_output is None else f"{g.mean_output:.0f}")
    flags = [Text(f"⚑ {f.severity.upper()}: {f.text}",
                  style="bold red" if f.severity == Severity.ERROR else "bold yellow")
             for f in s.flags]
    if not flags:
        flags = [Text("no quality flags", style="green")]
    notes = [Text(f"note: {n}", style="dim") for n in s.notes]
    return Group(*flags, t, groups, *notes)


def brake_lines(m: RunModel) -> list[Text]:
    """The data-quality brake: engaged with its numbers, likely causes and remedy; else its window's shares."""
    b = m.brake
    if b is None:
        return []
    if b.engaged:
        lines = [Text(f"⚑ {m.brake_line()}", style="bold red")]
        lines += [Text(f"  also {sh.text()}", style="red") for sh in b.crossed[1:]]
        lines += [Text(f"  likely cause: {c}") for c in b.causes]
        if b.remedy:
            lines.append(Text(f"  {b.remedy_for(m.host)}", style="bold"))
        return lines
    if not b.enabled:
        return [Text("brake: off ([brake] enabled = false)", style="dim")]
    shares = ", ".join(f"{sh.reason.replace('_', ' ')} {sh.share:.1%} (brakes over {sh.level:.0%})" for sh in b.window)
    return [Text(f"brake: armed over the last {b.samples}/{b.window_size} samples: {shares}", style="dim")]


class QualityPanel(Vertical):
    BINDINGS = [Binding("s", "app.refresh_stats", "Refresh stats")]

    def compose(self) -> ComposeResult:
        yield Static("statistics not computed yet (s: compute now)", id="quality-status")
        with Horizontal():
            hist = ChartFrame(id="loss-hist")
            hist.border_title = "loss-mask sum (output tokens): % of samples"
            yield hist
            with VerticalScroll(id="quality-figures-box"):
                yield Static(id="quality-figures")

    def refresh_from(self, m: RunModel) -> None:
        status = self.query_one("#quality-status", Static)
        s, error = m.stats, m.stats_error
        when = "" if m.stats_at is None else time.strftime(" at %H:%M:%S UTC", time.gmtime(m.stats_at))
        if error:
            line = Text(f"stats failed{when}: {error}", style="bold red")
        elif s is not None:
            line = Text(f"{s.samples:,} samples{when} (computed in {s.elapsed_s:.1f}s); "
                        "refreshed every 30 s while this tab is open · s: now")
        else:
            line = Text("statistics not computed yet (s: compute now)")
        status.update(Group(*brake_lines(m), line))
        hist = self.query_one("#loss-hist", ChartFrame)
        if s is None:
            hist.show_note(f"no statistics: {error}" if error else "statistics not computed yet (s: compute now)")
            return
        bins = s.loss_mask.histogram
        if not bins or not s.samples:
            hist.show_note("no samples committed yet")
        else:
            plot = hist.show_plot()
            plot.clear()
            styles = ["red" if b.low <= 7 and b.share > 0.05 else "cyan" for b in bins]
            plot.bar([bin_label(b.low) for b in bins], [100.0 * b.share for b in bins], bar_style=styles,
                     hires_mode=HiResMode.QUADRANT)
            plot.set_ylabel("% samples")
            plot.set_xlabel(HIST_LEGEND)
        self.query_one("#quality-figures", Static).update(figures(s))
