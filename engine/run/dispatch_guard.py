"""What holds dispatch run-wide on the ledger's behalf: the data-quality brake (engine.run.brake; recorded in the
store, so a restart stays braked) and the servers' refusals (engine.run.refusals). The ledger feeds it and asks it."""
from __future__ import annotations

import logging

from engine.config.load import RunConfig
from engine.run.brake import RunBrake
from engine.api.brake import BrakeStatus
from engine.run.ledger_ports import LedgerEvents
from engine.run.refusals import RefusalWatch
from engine.store.shard_store import ShardStore

log = logging.getLogger("regen.ledger")


class DispatchGuard:
    def __init__(self, cfg: RunConfig, store: ShardStore, events: LedgerEvents):
        self.store = store
        self.events = events
        self.brake = RunBrake(cfg, str(store.run_dir))
        self.brake_note = ""  # what load() found of a recorded brake (the supervisor logs and alerts it)
        self.refusals = RefusalWatch()

    @property
    def holds(self) -> bool:
        """The data-quality brake, or the servers' refusals, hold dispatch run-wide."""
        return self.brake.engaged is not None or self.refusals.tripped is not None

    def load(self) -> None:
        """At a start: the recorded brake, judged again on the store's last samples."""
        record, after = self.store.brake()
        self.brake_note = self.brake.load(record, self.store.recent_shapes(self.brake.settings.window, after))
        if record is not None and self.brake.engaged is None:
            self._record()  # lifted by a changed [brake]
        self.judge()

    def judge(self) -> None:
        status = self.brake.judge()
        if status is None:
            return
        self._record()
        log.error("data-quality brake: dispatch paused run-wide: %s", status.text)
        self.events.brake_changed(status, True)

    def release(self) -> BrakeStatus | None:
        """`resume --all`: the brake released (its window starts over); what it braked on, None when not engaged."""
        was = self.brake.release()
        if was is not None:
            self._record(window_from=self.store.last_sample_rowid())
            log.info("data-quality brake released (it braked on: %s); its window starts over", was.text)
        return was

    def _record(self, window_from: int | None = None) -> None:
        try:
            self.store.set_brake(self.brake.record(), window_from)
        except OSError as exc:
            # a full disk: the brake holds in this run; a restart judges the store's last samples again
            log.error("%s; the brake holds in this run only", exc)
