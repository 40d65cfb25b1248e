"""Command palette provider: every console action, searchable by name."""
from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

ACTIONS = [
    ("Show Preflight", "tab('preflight')", "the probe table"),
    ("Show Workers", "tab('workers')", "GPU workers, throughput, VRAM, log"),
    ("Show Shards", "tab('shards')", "shard progress, pause/resume"),
    ("Show Data quality", "tab('quality')", "loss-mask histogram and stats"),
    ("Show Disk", "tab('disk')", "free space and time until full"),
    ("Show Alerts", "tab('alerts')", "alert list"),
    ("Rerun all probes", "rerun_probes", "run every preflight probe again"),
    ("Rerun selected probe", "rerun_probe", "run the highlighted probe again"),
    ("Export probe report", "export_probes", "write the report as JSON (regen.probe/1)"),
    ("Restart selected worker", "restart_worker", "asks for confirmation"),
    ("Reload worker log", "refresh_log", "tail -n 200 of the selected worker's server.log"),
    ("Pause selected shards", "pause_shard", "the selection, else the cursor's shard; in-flight requests finish"),
    ("Resume selected shards", "resume_shard", "the selection, else the cursor's shard"),
    ("Filter shards (next filter)", "shards('cycle_filter')", "all, running, paused, pending, done, problems"),
    ("Sort shards (next order)", "shards('cycle_sort')", "id, progress, empty share, truncated share"),
    ("Next shard with a problem", "shards('next_problem')", "empty > 5%, truncated > 10%, or a runaway stopped"),
    ("Select shards matching the filter", "shards('select_listed')", "then p / r pause or resume them"),
    ("Clear shard selection", "shards('clear_selection')", ""),
    ("Pause all shards", "pause_all", ""),
    ("Resume all shards", "resume_all", ""),
    ("Refresh stats", "refresh_stats", "run engine.store.stats on the host now"),
    ("Reconnect now", "reconnect", "skip the backoff wait"),
    ("Help", "help", "keys and what they do"),
    ("Quit console (the run continues)", "quit", ""),
]


class RegenCommands(Provider):
    async def discover(self) -> Hits:
        for name, action, help_text in ACTIONS:
            yield DiscoveryHit(name, partial(self.app.run_action, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, action, help_text in ACTIONS:
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), partial(self.app.run_action, action), help=help_text)
