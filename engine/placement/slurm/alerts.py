"""The alert keys of a [slurm] group's job, and which of them [notify] sends whatever notify.min_severity says: a job
that ended or was requeued, one still pending after pending_alert_s, and its start after that (engine.notify.message).

Each key is <prefix><group>:<job id> (engine/placement/slurm/link.py writes them)."""
from __future__ import annotations

ENDED = "slurm-end:"  # TIMEOUT, CANCELLED by someone else, NODE_FAIL, PREEMPTED, ... (link._ended)
REQUEUED = "slurm-requeue:"  # a node failed or the job was preempted: Slurm runs the same job again (link._ended)
PENDING_LONG = "slurm-pending-long:"  # PENDING for pending_alert_s: it will not start (Slurm's reason)
STARTED = "slurm-started:"  # ... and started after all
BELOW_MIN = "slurm-below-min"  # an elastic run: fewer groups granted than min_groups, for pending_alert_s (groups.py)
NOTIFIED = (ENDED, REQUEUED, PENDING_LONG, STARTED, BELOW_MIN)
HANDED_OVER = "slurm-handed-over:"  # TIMEOUT at the limit a hand-over was made for: said, not sent


def key(prefix: str, group: str, job_id: str) -> str:
    return f"{prefix}{group}:{job_id}"
