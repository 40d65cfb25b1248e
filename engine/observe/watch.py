"""The run's periodic watch: the disk guard, the data-quality alerts and the throughput-drop alert.

Each tick it reads what it watches and raises or clears its alerts (Telemetry.condition: once when a
condition starts, `cleared` when it ends). It decides; the supervisor acts on what it says (a full disk
holds dispatch).
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from engine.config.load import RunConfig
from engine.run.counts import ShardCounts
from engine.telemetry import Telemetry, ThroughputWatch, disk_events
from engine.api.events import DispatchEvent

QUALITY_MIN_SAMPLES = 50  # a share over fewer committed samples of a shard is noise
COMMIT_RESERVE_SHARE = 0.1  # dispatch stops at alerts.disk_free_min_gb; commits go on until a tenth of it is left


class RunWatch:
    def __init__(self, cfg: RunConfig, run_dir: Path, telemetry: Telemetry):
        self.cfg = cfg
        self.run_dir = run_dir
        self.telemetry = telemetry
        self.disk_full = False  # free space on the run dir's disk under alerts.disk_free_min_gb
        self._run_free: int | None = None
        self._throughput = ThroughputWatch()

    # -- disk -------------------------------------------------------------------------------------
    def check_disk(self) -> bool:
        """Emit the disk readings; say whether the disk-full state changed."""
        events = disk_events([self.run_dir, Path("/dev/shm")])
        for ev in events:
            self.telemetry.emit(ev)
        run_disk = events[0] if events and events[0].path == str(self.run_dir) else None
        if run_disk is None:
            return False
        min_bytes = self.cfg.alerts.disk_free_min_gb * 2**30
        self._run_free = run_disk.free_bytes
        low = run_disk.free_bytes < min_bytes
        changed = low != self.disk_full
        self.disk_full = low
        self.telemetry.condition(
            "disk-low", low, "critical",
            f"disk low: {_size(run_disk.free_bytes)} free under {self.run_dir}: dispatch paused",
            f"alerts.disk_free_min_gb = {self.cfg.alerts.disk_free_min_gb}; dispatch resumes when space is freed")
        return changed

    def disk_ok_for_commit(self) -> bool:
        free = self._run_free
        return free is None or free > self.cfg.alerts.disk_free_min_gb * 2**30 * COMMIT_RESERVE_SHARE

    # -- data quality -----------------------------------------------------------------------------
    def quality(self, shards: Mapping[str, ShardCounts]) -> None:
        a = self.cfg.alerts
        for sid, p in shards.items():
            n = p.done
            if n < QUALITY_MIN_SAMPLES:
                continue
            empty_share, trunc_share = p.empty / n, p.truncated / n
            self.telemetry.condition(
                f"empty:{sid}", empty_share > a.empty_share, "error",
                f"shard {sid}: {empty_share:.0%} empty answers (threshold alerts.empty_share {a.empty_share:.0%})",
                f"{p.empty} of {n} samples are empty answers (e.g. <think>\\n\\n</think>\\n\\nOK.<|im_end|>)")
            self.telemetry.condition(
                f"truncated:{sid}", trunc_share > a.truncated_share, "warning",
                f"shard {sid}: {trunc_share:.0%} truncated answers (threshold alerts.truncated_share"
                f" {a.truncated_share:.0%})",
                f"{p.truncated} of {n} samples hit max_new_tokens (finish_reason length)")
            if self.cfg.runaway.enabled:
                rep_share, level = p.repetition / n, self.cfg.runaway.alert_share
                self.telemetry.condition(
                    f"repetition:{sid}", rep_share > level, "warning",
                    f"shard {sid}: {rep_share:.0%} answers stopped as runaway repetition (threshold"
                    f" runaway.alert_share {level:.0%})",
                    f"{p.repetition} of {n} samples fell into a token loop and were stopped (finish_reason"
                    " repetition); greedy or low-temperature sampling loops more: check sampling.temperature and"
                    " sampling.presence_penalty")

    # -- throughput -------------------------------------------------------------------------------
    def throughput(self, figures: DispatchEvent, work_waiting: bool) -> None:
        """Only while work is waiting: the tail of a run (input running dry) is not a drop."""
        busy = (figures.state == "running" and figures.in_flight > 0 and work_waiting
                and figures.tokens_per_s is not None)
        dropped, why = self._throughput.dropped(figures.tokens_per_s or 0.0, busy)
        self.telemetry.condition("throughput-drop", dropped, "warning", f"throughput dropped: {why}", why)


def _size(nbytes: int) -> str:
    """GiB, or MiB under one GiB (a nearly full disk must not read "0.0 GiB")."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
