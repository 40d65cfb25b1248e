"""Shards tab: progress per shard; pause/resume one or all (the result comes back in status)."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from console.tui.model import RunModel
from console.tui.widgets import STATE_STYLE, bar, pct, selected_row_key, sync_table

COLUMNS = ["shard", "state", "progress", "samples", "tokens", "empty %", "truncated %"]


def state_cell(state: str) -> Text:
    if state == "paused":
        return Text("⏸ paused", style="bold black on yellow")
    return Text(state, style=STATE_STYLE.get(state, ""))


class ShardsPanel(Vertical):
    BINDINGS = [
        Binding("p", "app.pause_shard", "Pause"),
        Binding("r", "app.resume_shard", "Resume"),
        Binding("P", "app.pause_all", "Pause all"),
        Binding("R", "app.resume_all", "Resume all"),
    ]

    def compose(self) -> ComposeResult:
        # both kept, not queried: a status or telemetry batch still queued while the app tears the DOM down (and
        # timers asking for the selection) must find them, not raise NoMatches
        self._summary = Static(id="shards-summary")
        yield self._summary
        table = DataTable(id="shards-table", cursor_type="row", zebra_stripes=True)
        self._table = table
        for c in COLUMNS:
            table.add_column(c, key=c)
        yield table

    @property
    def selected_shard(self) -> str | None:
        return selected_row_key(self._table)

    def refresh_from(self, m: RunModel) -> None:
        rows = []
        counts: dict[str, int] = {}
        for s in sorted(m.shards.values(), key=lambda s: s.id):
            counts[s.state] = counts.get(s.state, 0) + 1
            e, t = s.empty_share, s.truncated_share
            rows.append((s.id, (
                s.id, state_cell(s.state), f"{bar(s.fraction)} {100 * s.fraction:5.1f}%", f"{s.done}/{s.total}",
                f"{s.output_tokens:,}", Text(pct(e), style="bold red" if e is not None and e > 0.05 else ""),
                Text(pct(t), style="yellow" if t is not None and t > 0.10 else ""))))
        sync_table(self._table, rows, COLUMNS)
        summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no shards yet"
        text = Text.from_markup(
            f"{len(m.shards)} shards: {summary}   [dim]p pause · r resume · P pause all · R resume all[/]")
        brake = m.brake
        if brake is not None and brake.engaged:
            text.append(f"\n{m.brake_line()}", style="bold red")
            text.append("\ndispatch is paused run-wide; R (resume all) releases the brake and starts its window "
                        "over. Likely causes: " + "; ".join(brake.causes), style="red")
        self._summary.update(text)
