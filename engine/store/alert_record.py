"""The alerts raised now: one per condition (its key), recorded with the run in state.sqlite while it holds.
A raise of a key already raised is not said again (also across a restart: the rows are loaded), a clear removes the
row and is said only when the key was raised. Without a store the record is kept in memory; a row that cannot be
written is logged and `write_error` says why.
"""
from __future__ import annotations

import logging
from typing import Protocol

from engine.store.shard_store import StoredAlert
from engine.api.events import AlertEvent
from engine.api.wire import AlertKind

log = logging.getLogger("regen.alerts")


class AlertStore(Protocol):
    """Where the record is kept (engine.store.shard_store.ShardStore); its errors are OSErrors (StoreError)."""

    def raised_alerts(self) -> list[StoredAlert]: ...

    def record_alert(self, alert: StoredAlert) -> None: ...

    def drop_alert(self, key: str) -> None: ...


def as_event(row: StoredAlert) -> AlertEvent:
    """A recorded row as the alert it was raised with (its ts: when it was raised)."""
    return AlertEvent(ts=row.raised_at, severity=row.severity, text=row.text, evidence=row.evidence, key=row.key,
                      kind=AlertKind.RAISED)


def as_row(alert: AlertEvent) -> StoredAlert:
    return StoredAlert(key=alert.key, severity=str(alert.severity), text=alert.text, evidence=alert.evidence,
                       raised_at=alert.ts)


def raised_alerts_in(store: AlertStore) -> list[AlertEvent]:
    """The alerts a run dir records as raised (a run whose supervisor is gone), oldest first."""
    return [as_event(row) for row in store.raised_alerts()]


class AlertRecord:
    def __init__(self) -> None:
        self._raised: dict[str, AlertEvent] = {}
        self._store: AlertStore | None = None
        self.write_error: str | None = None  # why the last write to the store failed; None once one succeeds

    def __contains__(self, key: str) -> bool:
        return key in self._raised

    def get(self, key: str) -> AlertEvent | None:
        return self._raised.get(key)

    def raised(self) -> list[AlertEvent]:
        """Every alert raised now, oldest first."""
        return sorted(self._raised.values(), key=lambda a: (a.ts, a.key))

    def attach(self, store: AlertStore) -> list[AlertEvent]:
        """Keep the record in `store` from now on: load what an earlier supervisor raised (returned), and write what
        was raised here before. A record that cannot be read is said (log, write_error) and kept in memory."""
        try:
            loaded = raised_alerts_in(store)
        except OSError as exc:
            self._failed(f"cannot load the raised alerts: {exc}")
            return []
        self._store = store
        here = dict(self._raised)
        self._raised = {a.key: a for a in loaded}
        for key, alert in here.items():
            if key not in self._raised:  # raised before the store was open, and not by an earlier supervisor
                self._raised[key] = alert
                self._write(alert)
        if loaded:
            log.info("%d alert(s) raised by an earlier supervisor are still raised until their condition is judged "
                     "again: %s", len(loaded), ", ".join(a.key for a in loaded))
        return loaded

    def raise_(self, alert: AlertEvent) -> bool:
        """Record a raised alert; False (nothing recorded) when its key is raised already."""
        if alert.key in self._raised:
            return False
        self._raised[alert.key] = alert
        self._write(alert)
        return True

    def clear(self, key: str) -> AlertEvent | None:
        """Remove a raised alert; the alert that was raised, or None when the key was not raised."""
        alert = self._raised.pop(key, None)
        if alert is not None and self._store is not None:
            try:
                self._store.drop_alert(key)
                self.write_error = None
            except OSError as exc:
                self._failed(str(exc))
        return alert

    def _write(self, alert: AlertEvent) -> None:
        if self._store is None:
            return
        try:
            self._store.record_alert(as_row(alert))
            self.write_error = None
        except OSError as exc:
            self._failed(str(exc))

    def _failed(self, why: str) -> None:
        self.write_error = why
        log.error("alert record: %s; the raised alerts are kept in memory (a restarted supervisor would not know "
                  "them)", why)
