"""The run's periodic watch: the disk guard, the data-quality alerts and the throughput-drop alert. Each tick raises or
clears its alerts (recorded with the run, so a restarted supervisor clears what an earlier one raised); it decides,
the supervisor acts (a full disk holds dispatch)."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from engine.config.load import RunConfig
from engine.run.counts import ShardCounts
from engine.telemetry import Telemetry, ThroughputWatch, disk_events
from engine.api.events import DispatchEvent
from engine.api.wire import RunState, Severity

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
            "disk-low", low, Severity.CRITICAL,
            f"disk low: {_size(run_disk.free_bytes)} free under {self.run_dir}: dispatch paused",
            f"alerts.disk_free_min_gb = {self.cfg.alerts.disk_free_min_gb}; dispatch resumes when space is freed")
        return changed

    def disk_ok_for_commit(self) -> bool:
        free = self._run_free
        return free is None or free > self.cfg.alerts.disk_free_min_gb * 2**30 * COMMIT_RESERVE_SHARE

    # -- data quality -----------------------------------------------------------------------------
    def quality(self, shards: Mapping[str, ShardCounts]) -> None:
        """Judge every shard's shares (each time: a share that fell to its level, a level raised in run.toml, the
        runaway guard turned off, clear what an earlier supervisor raised). Under QUALITY_MIN_SAMPLES committed
        samples a shard is not judged: a share is noise, so nothing holds."""
        a, raised = self.cfg.alerts, self.telemetry.raised
        for sid, p in shards.items():
            n = p.done
            judged = n >= QUALITY_MIN_SAMPLES
            m = max(n, 1)
            empty_share, trunc_share, rep_share = p.empty / m, p.truncated / m, p.repetition / m
            level = self.cfg.runaway.alert_share
            holds = (judged and empty_share > a.empty_share, judged and trunc_share > a.truncated_share,
                     judged and self.cfg.runaway.enabled and rep_share > level)
            keys = (f"empty:{sid}", f"truncated:{sid}", f"repetition:{sid}")
            if not any(holds) and not any(k in raised for k in keys):
                continue  # the common case (a healthy or young shard): nothing to say, nothing to clear
            self.telemetry.condition(
                keys[0], holds[0], Severity.ERROR,
                f"shard {sid}: {empty_share:.0%} empty answers (threshold alerts.empty_share {a.empty_share:.0%})",
                f"{p.empty} of {n} samples are empty answers (e.g. <think>\\n\\n</think>\\n\\nOK.<|im_end|>)",
                cleared=f"cleared: shard {sid}: {empty_share:.0%} empty answers ({p.empty} of {n}), not above"
                        f" alerts.empty_share {a.empty_share:.0%}")
            self.telemetry.condition(
                keys[1], holds[1], Severity.WARNING,
                f"shard {sid}: {trunc_share:.0%} truncated answers (threshold alerts.truncated_share"
                f" {a.truncated_share:.0%})",
                f"{p.truncated} of {n} samples hit max_new_tokens (finish_reason length)",
                cleared=f"cleared: shard {sid}: {trunc_share:.0%} truncated answers ({p.truncated} of {n}), not above"
                        f" alerts.truncated_share {a.truncated_share:.0%}")
            self.telemetry.condition(
                keys[2], holds[2], Severity.WARNING,
                f"shard {sid}: {rep_share:.0%} answers stopped as runaway repetition (threshold"
                f" runaway.alert_share {level:.0%})",
                f"{p.repetition} of {n} samples fell into a token loop and were stopped (finish_reason"
                " repetition); greedy or low-temperature sampling loops more: check sampling.temperature and"
                " sampling.presence_penalty",
                cleared=f"cleared: shard {sid}: {rep_share:.0%} answers stopped as runaway repetition"
                        f" ({p.repetition} of {n}), not above runaway.alert_share {level:.0%}"
                        + ("" if self.cfg.runaway.enabled else " (the runaway guard is off)"))

    # -- throughput -------------------------------------------------------------------------------
    def throughput(self, figures: DispatchEvent, work_waiting: bool) -> None:
        """Only while work is waiting: the tail of a run (input running dry) is not a drop."""
        busy = (figures.state == RunState.RUNNING and figures.in_flight > 0 and work_waiting
                and figures.tokens_per_s is not None)
        dropped, why = self._throughput.dropped(figures.tokens_per_s or 0.0, busy)
        self.telemetry.condition("throughput-drop", dropped, Severity.WARNING, f"throughput dropped: {why}", why)


def _size(nbytes: int) -> str:
    """GiB, or MiB under one GiB (a nearly full disk must not read "0.0 GiB")."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
