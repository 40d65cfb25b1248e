"""Data quality tab: the loss-mask histogram and the other `engine.store.stats` figures, flags highlighted."""
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


SUPERSCRIPT = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")
HIST_LEGEND = "bar 2ᵏ: sums of 2ᵏ to 2ᵏ⁺¹−1"


def bin_label(low: int) -> str:
    """A log2 bin by its lower end: 0, or 2ᵏ (short enough that a dozen bins fit side by side)."""
    return "0" if low <= 0 else "2" + str(low.bit_length() - 1).translate(SUPERSCRIPT)


def _share(c: dict | None) -> str:
    return "N/A" if not c else f"{c['count']:,} ({c['share']:.1%})"


def _num(v) -> str:
    return "N/A" if v is None else f"{v:,.0f}"


def figures(s: dict) -> Group:
    t = Table(show_header=False, box=None, expand=True)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("samples", f"{s.get('samples', 0):,}")
    t.add_row("empty answers", _share(s.get("empty")))
    t.add_row("truncated (length)", _share(s.get("truncated")))
    t.add_row("stopped (repetition)", _share(s.get("repetition")))
    t.add_row("aborted", _share(s.get("aborted")))
    for k, c in (s.get("reasoning") or {}).items():
        t.add_row(f"thinking {k}", _share(c))
    lm = (s.get("loss_mask") or {}).get("distribution") or {}
    t.add_row("loss-mask sum", "  ".join(f"{k} {_num(lm.get(k))}" for k in ("mean", "min", "p50", "p90", "p99", "max")))
    cut = s.get("cut") or {}
    if cut:
        t.add_row(f"cut at {cut.get('train_max_length')}",
                  f"{cut.get('supervised_tokens_cut', 0):,} of {cut.get('supervised_tokens_total', 0):,} supervised "
                  f"tokens ({cut.get('cut_share', 0):.1%}); {cut.get('samples_cut', 0):,} samples cut, "
                  f"{cut.get('samples_unsupervised', 0):,} unsupervised")
    mc = s.get("mask_check") or {}
    t.add_row("mask check", f"{mc.get('mode')}: {mc.get('rows_checked', 0):,} rows, {mc.get('mismatches', 0)} mismatches")
    parts = s.get("parts") or {}
    t.add_row("parts", f"{parts.get('read', 0)} read of {parts.get('committed', 0)} committed "
              f"({parts.get('listed_from')}), {parts.get('uncommitted_ignored', 0)} uncommitted ignored")
    groups = Table(title="by worker / source", expand=True)
    for c in ("group", "samples", "empty", "truncated", "repetition", "mean output"):
        groups.add_column(c)
    for kind in ("by_worker", "by_source"):
        for g in s.get(kind) or []:
            flagged = g.get("flagged") or []
            groups.add_row(f"{kind[3:]} {g['name']}", f"{g['samples']:,}",
                           Text(_share(g.get("empty")), style="bold red" if "empty" in flagged else ""),
                           Text(_share(g.get("truncated")), style="yellow" if "truncated" in flagged else ""),
                           Text(_share(g.get("repetition")), style="yellow" if "repetition" in flagged else ""),
                           "N/A" if g.get("mean_output") is None else f"{g['mean_output']:.0f}")
    flags = [Text(f"⚑ {f['severity'].upper()}: {f['text']}", style="bold red" if f["severity"] == "error" else "bold yellow")
             for f in s.get("flags") or []]
    if not flags:
        flags = [Text("no quality flags", style="green")]
    notes = [Text(f"note: {n}", style="dim") for n in s.get("notes") or []]
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
        s = m.stats
        when = "" if m.stats_at is None else time.strftime(" at %H:%M:%S UTC", time.gmtime(m.stats_at))
        if m.stats_error:
            line = Text(f"stats failed{when}: {m.stats_error}", style="bold red")
        elif s is not None:
            line = Text(f"{s.get('samples', 0):,} samples{when} (computed in {s.get('elapsed_s', 0):.1f}s); "
                        "refreshed every 30 s while this tab is open · s: now")
        else:
            line = Text("statistics not computed yet (s: compute now)")
        status.update(Group(*brake_lines(m), line))
        hist = self.query_one("#loss-hist", ChartFrame)
        if s is None:
            hist.show_note(f"no statistics: {m.stats_error}" if m.stats_error else
                           "statistics not computed yet (s: compute now)")
            return
        bins = (s.get("loss_mask") or {}).get("histogram") or []
        if not bins or not s.get("samples"):
            hist.show_note("no samples committed yet")
        else:
            plot = hist.show_plot()
            plot.clear()
            styles = ["red" if b["low"] <= 7 and b["share"] > 0.05 else "cyan" for b in bins]
            plot.bar([bin_label(b["low"]) for b in bins], [100.0 * b["share"] for b in bins], bar_style=styles,
                     hires_mode=HiResMode.QUADRANT)
            plot.set_ylabel("% samples")
            plot.set_xlabel(HIST_LEGEND)
        self.query_one("#quality-figures", Static).update(figures(s))
