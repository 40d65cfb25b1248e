"""Shards tab: summary by state, virtual rows, filter, sort, jump to a problem, selection, pause/resume."""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import Static

from console.view.model import RunModel
from console.view.shard_list import SORT_TEXT, ShardList, ShardSummary
from console.tui.shard_table import ShardTable
from engine.api.wire import ShardState

# the shard states the summary line names even at 0
SHOWN_ALWAYS = (ShardState.DONE, ShardState.RUNNING, ShardState.PENDING, ShardState.PAUSED)

HINTS = "f filter · s sort · n next problem · space select · a select listed · c clear"
CONTROL_HINTS = " · p/r selection/cursor · P/R all"  # not for a run whose supervisor is gone: nothing to pause


def summary_text(s: ShardSummary, filter: str, sort: str) -> Text:
    text = Text(f"{s.total:,} shards: ", style="bold")
    if not s.total:
        text.append("no shards yet")
    parts = [(s.done, "done", "bold cyan"), (s.running, "running", "bold green"), (s.pending, "pending", "dim"),
             (s.paused, "paused", "bold yellow"), (s.other, "stopping/stopped", "dim")]
    shown = [(n, word, style) for n, word, style in parts if n or word in SHOWN_ALWAYS]
    for i, (n, word, style) in enumerate(shown if s.total else []):
        text.append(" · " if i else "")
        text.append(f"{n:,} {word}", style=style if n else "")
    if s.total:
        text.append(" · ")
        text.append(f"⚑ {s.problems:,} with problems", style="bold red" if s.problems else "")
    text.append(f"\nshowing {filter} ({s.listed:,}), sorted by {SORT_TEXT[sort]}")
    if s.selected:
        text.append(f" · {s.selected:,} selected", style="bold magenta")
    return text


class ShardsPanel(Vertical):
    BINDINGS = [
        Binding("p", "app.pause_shard", "Pause"),
        Binding("r", "app.resume_shard", "Resume"),
        Binding("P", "app.pause_all", "Pause all"),
        Binding("R", "app.resume_all", "Resume all"),
        Binding("f", "cycle_filter", "Filter"),
        Binding("s", "cycle_sort", "Sort"),
        Binding("n", "next_problem", "Next problem"),
        Binding("space", "toggle_select", "Select", show=False),  # the hints line above the table lists these
        Binding("a", "select_listed", "Select listed", show=False),
        Binding("c", "clear_selection", "Clear selection", show=False),
    ]

    def compose(self) -> ComposeResult:
        # kept, not queried: a status or telemetry batch still queued while the app tears the DOM down (and
        # timers asking for the selection) must find them, not raise NoMatches
        self.shards = ShardList()
        self._summary = Static(id="shards-summary")
        self._shown: tuple | None = None
        yield self._summary
        self._hints = Static(HINTS + CONTROL_HINTS, id="shards-hints")
        self._hints_gone = False
        yield self._hints
        self._table = ShardTable(self.shards, id="shards-table")
        yield self._table

    @property
    def table(self) -> ShardTable:
        return self._table

    @property
    def selected_shard(self) -> str | None:
        """The shard under the cursor."""
        return self._table.cursor_shard

    def targets(self) -> list[str]:
        """What p/r act on: the selection if any, else the cursor's shard."""
        return self.shards.targets(self.selected_shard)

    def refresh_from(self, m: RunModel) -> None:
        changed = m.take_changed_shards()
        order_changed = self.shards.set_levels(m.levels) | self.shards.update(m.shards[sid] for sid in changed)
        self._table.rows_changed(changed, order_changed)
        self._show_summary(m)
        if m.gone != self._hints_gone:
            self._hints_gone = m.gone
            self._hints.update(HINTS if m.gone else HINTS + CONTROL_HINTS)

    def _show_summary(self, m: RunModel | None = None) -> None:
        brake = m.brake if m is not None else (self._shown[3] if self._shown else None)
        line = m.brake_line() if m is not None else (self._shown[4] if self._shown else "")
        shown = (self.shards.summary(), self.shards.filter, self.shards.sort, brake, line)
        if shown == self._shown:
            return
        self._shown = shown
        text = summary_text(*shown[:3])
        if brake is not None and brake.engaged:
            text.append(f"\n{line}", style="bold red")
            text.append("\ndispatch is paused run-wide; R (resume all) releases the brake and starts its window "
                        "over. Likely causes: " + "; ".join(brake.causes), style="red")
        self._summary.update(text)

    # -- the operator's way through thousands of shards ------------------------------------------
    def _view_changed(self) -> None:
        """A new filter or order: shown from its top (the worst first, for a sort by share)."""
        self._table.rows_changed(set(), True)
        self._table.move_cursor(0)
        self._show_summary()

    def action_cycle_filter(self) -> None:
        self.shards.cycle_filter()
        self._view_changed()

    def action_cycle_sort(self) -> None:
        self.shards.cycle_sort()
        self._view_changed()

    def action_next_problem(self) -> None:
        row = self.shards.next_problem(self._table.cursor_row) if len(self.shards) else None
        if row is None:
            self.notify(f"no shard with a problem among the {self.shards.filter} shards", timeout=4)
            return
        self._table.move_cursor(row)

    def action_toggle_select(self) -> None:
        """space toggles the shard under the cursor and leaves the cursor there (Down, then space, is the shard
        the operator sees highlighted)."""
        sid = self.selected_shard
        if sid is not None:
            self.shards.toggle(sid)
            self._table.refresh_cursor_row()
            self._show_summary()

    def action_select_listed(self) -> None:
        self.shards.select_listed()
        self._table.refresh()
        self._show_summary()

    def action_clear_selection(self) -> None:
        self.shards.clear_selection()
        self._table.refresh()
        self._show_summary()
