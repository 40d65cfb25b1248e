"""The console app's control ops: pause, resume (a selection of thousands of shards in chunks) and a worker restart,
each sent through the source, answered by a toast and followed by a fresh status."""
from __future__ import annotations

from textual import work

from console.host.follow import SourceError
from console.tui.app_base import AppBase
from console.tui.messages import ControlDone, StatusReceived
from console.tui.screens import ConfirmScreen
from engine.api.ops import ShardsChanged, WorkerRestarted

CONTROL_CHUNK = 1000  # shard ids per control command (a command line on the host stays far under its limits)


class ControlsApp(AppBase):
    """The control ops and their key actions."""

    @work(group="control", exit_on_error=False)
    async def control(self, op: str, arg) -> None:
        label = {"pause": "pause", "resume": "resume", "restart_worker": "restart worker"}[op]
        target = "all shards" if arg is None else (arg if isinstance(arg, str) else shards_text(arg))
        # a selection of thousands of shards goes in chunks: each is one command line on the host
        calls = [arg] if arg is None or isinstance(arg, str) else [arg[i:i + CONTROL_CHUNK]
                                                                  for i in range(0, len(arg), CONTROL_CHUNK)]
        result: ShardsChanged | WorkerRestarted | None = None
        for n, chunk in enumerate(calls):
            try:
                result = await getattr(self.source, op)(chunk)
            except SourceError as exc:
                sent = f" ({n * CONTROL_CHUNK:,} of the {len(arg):,} were sent and done)" if n else ""
                self.post_message(ControlDone(op, False, f"{label} {target} failed: {exc}{sent}"))
                return
        self.post_message(ControlDone(op, True, f"{label} {target}: done", result))
        try:
            status = await self.source.status()
        except SourceError as exc:
            self.post_message(ControlDone(op, False, f"{label} {target} was sent, but status failed: {exc}"))
            return
        self.post_message(StatusReceived(status))

    def on_control_done(self, msg: ControlDone) -> None:
        if self._take_source_notes():
            self._mark({"alerts", "header"})
        self.notify(msg.text, title="control", severity="information" if msg.ok else "error",
                    timeout=5 if msg.ok else 15)

    def action_pause_shard(self) -> None:
        """Pause the selected shards, else the one under the cursor."""
        if targets := self.panel("shards").targets():
            self.control("pause", targets)

    def action_resume_shard(self) -> None:
        if targets := self.panel("shards").targets():
            self.control("resume", targets)

    def action_shards(self, op: str) -> None:
        """A Shards-tab action from the command palette (cycle_filter, cycle_sort, next_problem, select_listed,
        clear_selection): shown on the Shards tab."""
        self._tabs.active = "shards"
        getattr(self.panel("shards"), f"action_{op}")()

    def action_pause_all(self) -> None:
        self.control("pause", None)

    def action_resume_all(self) -> None:
        self.control("resume", None)

    def action_restart_worker(self) -> None:
        name = self.panel("workers").selected_worker
        if name is None:
            self.notify("no worker selected", severity="warning")
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self.control("restart_worker", name)

        self.push_screen(ConfirmScreen(f"Restart worker {name}?\n\nIts in-flight requests are aborted and re-queued;"
                                       " the server is stopped and launched again."), answered)


def shards_text(ids: list[str]) -> str:
    return ", ".join(ids) if len(ids) <= 3 else f"{len(ids):,} shards ({ids[0]} … {ids[-1]})"
