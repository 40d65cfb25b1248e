"""A [slurm] run's server groups at a glance: how many of the groups regen keeps submitted (max_groups) Slurm has
granted, how many serve and how many wait, against the min_groups the plan counts on; and, for an elastic run
(min_groups below max_groups), the one alert while fewer than min_groups are granted for pending_alert_s."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from engine.api.events import AlertEvent, Event
from engine.api.status import HostStatus, SlurmGroups
from engine.api.wire import AlertKind, Severity, WorkerState, duration_text
from engine.config.load import RunConfig
from engine.placement.slurm import alerts as job_alerts
from engine.placement.slurm.jobs import ACTIVE
from engine.placement.slurm.plan import layout_of, slurm_section

if TYPE_CHECKING:
    from engine.placement.slurm.link import SlurmLink

log = logging.getLogger("regen.slurm")
GRANTED = ("RUNNING", "CONFIGURING")  # Slurm allocated the job's nodes (CONFIGURING: they are being readied)
POLL_S = 2.0


def elastic(cfg: RunConfig) -> bool:
    """More groups are submitted than the plan counts on: the groups above min_groups use what the cluster frees."""
    layout = layout_of(cfg)
    return layout.groups > layout.groups_counted


def job_pending_alert_s(cfg: RunConfig) -> float:
    """When a group's own job is said to wait too long (its link's JobAlerts): pending_alert_s; never in an elastic
    run, where a group beyond min_groups waiting for free nodes is the plan, and the run's below-min alert
    (GroupWatch, which sets it on each link) says what matters."""
    return math.inf if elastic(cfg) else float(slurm_section(cfg).pending_alert_s)


def count_groups(hosts: Iterable[HostStatus], counted: int, wanted: int, serving: int = 0,
                 below_since: float | None = None) -> SlurmGroups:
    """The figures from each group's row (its job as Slurm said it last); `serving`: groups with a server in the
    router (the live supervisor's to say; 0 with no supervisor)."""
    states = [h.job.state for h in hosts if h.job is not None and not h.job.ended]
    granted = sum(s in GRANTED for s in states)
    pending = sum(s in ACTIVE and s not in GRANTED for s in states)
    return SlurmGroups(wanted=wanted, counted=counted, granted=granted, serving=serving, pending=pending,
                       below_since=below_since)


def offline_groups(cfg: RunConfig, hosts: Iterable[HostStatus]) -> SlurmGroups:
    """With no supervisor: the groups' last jobs as Slurm says them now (none serves: no router)."""
    layout = layout_of(cfg)
    return count_groups(hosts, layout.groups_counted, layout.groups)


class GroupWatch:
    """The live figures of a run's groups (`links`: each group's SlurmLink) and the below-min alert."""

    def __init__(self, cfg: RunConfig, links: Sequence[SlurmLink], emit: Callable[[Event], None],
                 clock: Callable[[], float] = time.monotonic):
        layout = layout_of(cfg)
        self.counted, self.wanted = layout.groups_counted, layout.groups
        self.alert_after_s = float(slurm_section(cfg).pending_alert_s)
        self.elastic = elastic(cfg)
        self.links = links
        self.emit = emit
        self.clock = clock
        self._below: tuple[float, float] | None = None  # (monotonic, epoch) since granted < counted
        self._raised = False
        for link in links:  # an elastic group waiting for nodes is no alarm: this watch's below-min alert says it
            link.alerts.pending_alert_s = job_pending_alert_s(cfg)

    def figures(self) -> SlurmGroups:
        serving = sum(any(m.state == WorkerState.READY for m in link.members) for link in self.links)
        return count_groups((link.status() for link in self.links), self.counted, self.wanted, serving,
                            self._below[1] if self._below else None)

    def judge(self) -> SlurmGroups:
        """Below min_groups for alert_after_s: one warning (sent by [notify]), cleared once enough are granted."""
        now = self.figures()
        if now.granted >= self.counted:
            self._below = now.below_since = None
            if self._raised:
                self._raised = False
                self.emit(AlertEvent(severity=Severity.INFO, kind=AlertKind.CLEARED, key=job_alerts.BELOW_MIN,
                                     text=f"slurm: {now.granted} server group(s) granted, the {self.counted} the plan "
                                          "counts on (min_groups)", evidence=now.text()))
            return now
        if self._below is None:
            self._below = (self.clock(), time.time())
            now.below_since = self._below[1]
        waited = self.clock() - self._below[0]
        if self.elastic and not self._raised and waited >= self.alert_after_s:
            self._raised = True
            waiting = [f"{link.host.name}: {link.job.words()}" for link in self.links
                       if link.job is not None and link.job.active and link.job.state not in GRANTED]
            self.emit(AlertEvent(
                severity=Severity.WARNING, kind=AlertKind.RAISED, key=job_alerts.BELOW_MIN,
                text=f"slurm: {now.granted} of the {self.counted} server group(s) the plan counts on (min_groups) "
                     f"granted for {duration_text(waited)}: the run goes on slower than planned",
                evidence=("; ".join(waiting) or "no job of the run waits in the queue (being submitted again)")
                + f"; the alert's threshold: [slurm] pending_alert_s = {self.alert_after_s:g}"))
        return now

    async def run(self) -> None:
        while True:
            try:
                self.judge()
            except Exception:  # a bug here must not end the watch for the rest of the run: logged, judged again
                log.exception("judging the slurm groups failed")
            await asyncio.sleep(POLL_S)
