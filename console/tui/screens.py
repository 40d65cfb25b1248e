"""Modal screens: the confirmation before a disruptive action, and the help screen."""
from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Markdown, Static

HELP = """\
# regen console

The console watches a run; **closing it (q) or losing the connection never stops the run**.
On reconnect (automatic, exponential backoff; `ctrl+r` now) the history is backfilled from the host.

| key | where | does |
|---|---|---|
| 1-6 | anywhere | Preflight, Workers, Shards, Data quality, Disk, Alerts |
| ctrl+p | anywhere | command palette (every action) |
| ? | anywhere | this help |
| q | anywhere | quit the console (the run goes on) |
| ctrl+r | anywhere | reconnect now |
| r / a / e | Preflight | rerun the selected probe / all probes / export the report as JSON |
| x / l | Workers | restart the selected worker (asks first) / reload its log |
| f | Shards | next filter: all, running, paused, pending, done, problems |
| s | Shards | next sort: id, progress, empty share, truncated share |
| n | Shards | next shard with a problem (empty > 5%, truncated > 10%, a runaway) |
| space / a / c | Shards | select or unselect the shard under the cursor (the cursor stays) / every listed shard / clear the selection |
| p / r | Shards | pause / resume the selection, else the shard under the cursor |
| P / R | Shards | pause all / resume all |
| s | Data quality | compute the statistics now (else every 30 s while shown) |

N/A means the host did not report the value (e.g. NVML unavailable), not zero.
"""


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]
    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Vertical { width: 64; height: auto; border: thick $warning; background: $surface; padding: 1 2; }
    ConfirmScreen Horizontal { height: auto; align: center middle; margin-top: 1; }
    ConfirmScreen Button { margin: 0 2; }
    """

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.question, id="confirm-question")
            with Horizontal():
                yield Button("Yes (y)", variant="warning", id="yes")
                yield Button("No (n)", variant="primary", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "app.pop_screen", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 96; height: auto; max-height: 90%; border: thick $primary; background: $surface; }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll():  # taller than a 40-line terminal: up/down scroll it
            yield Markdown(HELP)
