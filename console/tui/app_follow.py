"""The console app's follow: one RunFollower (console/host/follow.py) feeding the model in batches, the status polls,
the connection's states as alerts and toasts, and the run dir's last state once the supervisor is gone."""
from __future__ import annotations

import asyncio
import time

from textual import work

from console.host.follow import Backoff, FollowState, RunFollower
from console.host.follow import SourceError, SourceErrorKind
from console.tui.app_base import NOT_PROBED, AppBase
from console.tui.messages import ConnectionChanged, ControlDone, StatusReceived, TelemetryBatch
from console.view.model_parts import AlertView, ConnectionState
from engine.api.status import RunStatus

BATCH_INTERVAL_S = 0.25  # telemetry is posted at most 4 times a second
# the periodic status leaves out the shard list (the shard events keep it; 10,000 shards are ~2 MB a reply): the
# follower asks a full one at each (re)connect, and a poll does when none came for this long, in case an event was
# lost (telemetry not writable)
FULL_STATUS_EVERY_S = 300.0
BACKFILL_S = 3600.0  # on first attach: the last hour of telemetry
BACKOFF_MAX_S = 60.0
DISCONNECTED = (ConnectionState.RECONNECTING, ConnectionState.LOST)
LOST_AFTER = 5  # failed attempts before "reconnecting" becomes "lost"
REFUSED_TOAST_S = 600.0  # the host refused us (host key, auth): the remedy stays on screen
ENDED_CHECK_S = 15.0


class FollowingApp(AppBase):
    """The follow loop, the status polls and the connection's states."""

    @work(exclusive=True, group="follow", exit_on_error=False)
    async def follow_telemetry(self, again: bool = False) -> None:
        """The one follow loop (console/host/follow.py) feeding the model. again: after a refusal, start over through
        source.reconnect() (which forgets the refusal)."""
        if self._follower is None:
            def on_state(st: FollowState) -> None:
                self.post_message(ConnectionChanged(st.state, st.retry_in_s, st.error))

            def on_status(status: RunStatus) -> None:
                self.post_message(StatusReceived(status))

            def on_warning(text: str) -> None:
                self.post_message(ControlDone("last_status", False, text))

            self._follower = RunFollower(
                self.source, since=self.model.last_ts if self.model.last_ts is not None else self.clock() - BACKFILL_S,
                on_state=on_state, on_status=on_status, on_warning=on_warning,
                backoff=Backoff(first_s=1.0, max_s=BACKOFF_MAX_S, lost_after=LOST_AFTER),
                ended_check_s=ENDED_CHECK_S, watch_ended=self.live, wake=self._wake_follow)
        await self._pump(self._follower.events(again))

    async def _fetch_last_status(self) -> None:
        """The supervisor is gone: what its run dir recorded (how it ended, its fatal cause) is the state to show."""
        try:
            status = await self.source.last_status()
        except SourceError as exc:
            # a recording without a status has nothing more to say; else: say it
            if exc.kind != SourceErrorKind.NO_SUPERVISOR:
                self.post_message(ControlDone("last_status", False, f"the run dir's last state could not be read: {exc}"))
            return
        self.post_message(StatusReceived(status))

    async def _pump(self, events) -> None:
        """Read events as they come; post them in batches, at most one batch per BATCH_INTERVAL_S."""
        buf: list = []
        arrived = asyncio.Event()

        async def read() -> None:
            async for ev in events:
                buf.append(ev)
                arrived.set()

        reader = asyncio.ensure_future(read())
        try:
            while True:
                waiter = asyncio.ensure_future(arrived.wait())
                await asyncio.wait({reader, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if buf:
                    batch = buf[:]
                    buf.clear()
                    arrived.clear()
                    self.post_message(TelemetryBatch(batch))
                    if not reader.done():
                        await asyncio.sleep(BATCH_INTERVAL_S)
                    continue
                if reader.done():
                    reader.result()  # raises the stream's error (SourceError) if it had one
                    return
        finally:
            if not reader.done():
                reader.cancel()

    def on_telemetry_batch(self, msg: TelemetryBatch) -> None:
        changed = self.model.apply_all(msg.events)
        if self._take_source_notes():  # e.g. a telemetry line skipped as malformed
            changed |= {"alerts", "header"}
        self.events_applied += len(msg.events)
        self._mark(changed)
        self._notify_alerts()
        if msg.events:
            self.last_event_on_screen = (msg.events[-1].ts, time.time())

    def on_status_received(self, msg: StatusReceived) -> None:
        if not msg.status.shards_omitted:
            self._full_status_at = self.monotonic()
        self._take_source_notes()
        self._mark(self.model.apply_status(msg.status))
        self._notify_alerts()
        self._rejudge_resume()

    def _rejudge_resume(self) -> None:
        """run_dir.resume judges who runs the run dir: judged again when the supervisor changes (a new pid, or none)."""
        supervisor = self.model.pid if self.model.running else None
        if not self.run_probes_on_start or supervisor == self._probed_supervisor:
            return
        first = self._probed_supervisor is NOT_PROBED
        self._probed_supervisor = supervisor
        if not first:  # the first status comes with the start's full probe run
            self.run_probes({"run_dir.resume"})

    def on_connection_changed(self, msg: ConnectionChanged) -> None:
        conn = self.model.connection
        before = conn.state
        conn.state, conn.error = ConnectionState(msg.state), msg.error
        conn.retry_at = None if msg.retry_in_s is None else self.monotonic() + msg.retry_in_s
        conn.since = self.monotonic()
        now = self.clock()
        if msg.state in DISCONNECTED and before not in DISCONNECTED:
            self.model.add_alert(AlertView(now, "error", f"connection lost: {msg.error}", key=f"console.conn.lost.{now}",
                                           origin="console"))
        elif msg.state == ConnectionState.CONNECTED and before in DISCONNECTED:
            self.model.add_alert(AlertView(now, "info", "connection regained; history backfilled",
                                           key=f"console.conn.ok.{now}", origin="console"))
            self.notify("connection regained; history backfilled", title="connection")
        elif msg.state == ConnectionState.REFUSED and before != ConnectionState.REFUSED:
            self.model.add_alert(AlertView(now, "critical", msg.error, key=f"console.refused.{now}", origin="console"))
            self.notify(msg.error, title="connection refused", severity="error", timeout=REFUSED_TOAST_S)
        elif msg.state == ConnectionState.ENDED and before != ConnectionState.ENDED and msg.error:
            # the stream's end and the control socket's refusal: the supervisor is gone; dead unless it said otherwise
            dead = getattr(self.source, "supervised", False) and self.model.mark_dead(now, msg.error)
            if not dead:
                self.model.add_alert(AlertView(now, "info", msg.error, key=f"console.ended.{msg.error}",
                                               origin="console"))
        self._take_source_notes()
        # every figure's liveness follows the connection and the supervisor (console/view/liveness.py); "shards": its
        # control hints follow the run being gone
        self._mark({"alerts", "header", "shards", "workers", "disk"})
        self._notify_alerts()

    @work(exclusive=True, group="status", exit_on_error=False)
    async def poll_status(self) -> None:
        if self.model.connection.state != ConnectionState.CONNECTED:
            return
        full = self._full_status_at is None or self.monotonic() - self._full_status_at >= FULL_STATUS_EVERY_S
        try:
            status = await self.source.status(shards=full)
        except SourceError as exc:
            if exc.kind == SourceErrorKind.NO_SUPERVISOR:
                self.post_message(ConnectionChanged(ConnectionState.ENDED, error=str(exc)))
                await self._fetch_last_status()
            return  # a connection failure shows through the telemetry stream's reconnect
        self.post_message(StatusReceived(status))

    def action_reconnect(self) -> None:
        if self.model.connection.state == ConnectionState.REFUSED:  # the follow worker stopped: start it again
            self.follow_telemetry(again=True)
        self._wake_follow.set()
        self.poll_status()
