"""Notifications from the host: critical alerts, the data-quality brake, a dead supervisor's cause and the run's
end, sent to a webhook and/or a command ([notify] in run.toml).

message.py picks the events and words them, formats.py builds each webhook body, limiter.py holds
the rate limit and de-duplication, deliver.py sends with retries, notifier.py ties them to telemetry."""
from engine.notify.message import Notification, notification_for
from engine.notify.notifier import Notifier

__all__ = ["Notification", "Notifier", "notification_for"]
