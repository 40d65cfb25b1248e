"""`regen status HOST --run-dir DIR --follow`: a progress line per update until the run ends (or Ctrl-C), through
the one follow loop (console/host/follow.py) that the TUI uses: it reconnects with backoff and backfills, and stops on a
refusal (host key, authentication) or an error reply."""
from __future__ import annotations

import asyncio
import sys
import time

from console.host import start_record
from console.commands.status_text import cause_block, exit_code_of, progress_line
from console.host.deploy import EXIT_ERROR, EXIT_UNREACHABLE
from console.host.follow import FollowState, RunFollower, SourceError, SourceErrorKind
from console.host.hints import hint_from_args
from console.host.run_client import ClientErrorKind, RunClientError
from console.host.ssh_options import SshOptions
from console.view.model_parts import ConnectionState
from engine.api.status import RunStatus
from engine.api.events import DispatchEvent

EXIT_INTERRUPTED = 130  # Ctrl-C: the run goes on, only the following stopped


class Progress:
    """The figures on screen move forward only: the status snapshot first, then only events newer than what was
    shown (a backfill replays events from before the snapshot: 200/2750, then 182/2750 was one of them)."""

    def __init__(self) -> None:
        self.ts: float | None = None
        self.done = -1
        self.total = -1

    def take(self, ev: DispatchEvent) -> bool:
        if self.ts is not None and ev.ts <= self.ts:
            return False
        if ev.total == self.total and ev.done < self.done:
            return False  # an older supervisor's last word arriving late: committed counts never go back
        self.ts, self.done, self.total = ev.ts, ev.done, ev.total
        return True


def _stamp(line: str) -> str:
    return f"{time.strftime('%H:%M:%S')} {line}"


def _exit_of_error(exc: SourceError) -> int:
    if exc.kind == SourceErrorKind.REFUSED:
        return EXIT_UNREACHABLE
    cause = exc.__cause__
    if isinstance(cause, RunClientError) and cause.kind == ClientErrorKind.UNREACHABLE:  # e.g. no run at that run dir
        return EXIT_UNREACHABLE
    return EXIT_ERROR


async def follow_status(args) -> int:
    from console.host.source import HostSource

    source = HostSource(args.host, args.run_dir, ssh=SshOptions.from_args(args),
                        accept_new_command=hint_from_args(args, "status", "--run-dir", args.run_dir, "--follow",
                                                          accept_new=True))
    last: RunStatus | None = None  # the latest status reply
    printed = [""]
    shown = Progress()

    def show(line: str) -> None:
        if line != printed[0]:  # one line per change, not per event
            printed[0] = line
            print(_stamp(line), flush=True)

    def say_notes() -> None:
        """What the source saw on its way (an engine without the control channel, a channel reopened)."""
        for note in source.take_notes():
            print(_stamp(f"{note.severity}: {note.text}"), file=sys.stderr, flush=True)

    async def on_status(status: RunStatus) -> None:
        nonlocal last
        say_notes()
        last = status
        if not status.running:
            # the resume line from the run's start record, as plain `regen status` prints it (one builder: cause_block)
            record = await start_record.read(source.client.transport, source.client.run_dir) if source.client else None
            cause = cause_block(status, args, record).plain.rstrip()
            if cause:
                print(cause, flush=True)
        figures = status.dispatch or DispatchEvent()
        if status.dispatch is None or shown.take(figures) or not status.running:
            show(progress_line(figures, status.state, status.running))

    def on_state(st: FollowState) -> None:
        say_notes()
        if st.state in (ConnectionState.RECONNECTING, ConnectionState.LOST):
            print(_stamp(f"connection {st.state}: {st.error}; next try in {st.retry_in_s:.0f} s"), file=sys.stderr,
                  flush=True)
        elif st.state == ConnectionState.CONNECTED and st.error == "regained":
            print(_stamp("connection regained; telemetry backfilled"), file=sys.stderr, flush=True)

    follower = RunFollower(source, since=time.time(), on_state=on_state, on_status=on_status,
                           on_warning=lambda text: print(text, file=sys.stderr, flush=True), watch_ended=False)
    try:
        async for ev in follower.events():
            if isinstance(ev, DispatchEvent) and shown.take(ev):
                show(progress_line(ev, ev.state, running=True))
    finally:
        await source.close()
    if follower.stopped_by is not None:
        print(f"regen status --follow: {follower.stopped_by}", file=sys.stderr)
        return _exit_of_error(follower.stopped_by)
    return exit_code_of(last) if last is not None else EXIT_UNREACHABLE


def run_follow(args) -> int:
    if args.json:
        print("regen status: --follow prints one progress line per update and has no JSON form; for the status as"
              " JSON, run it without --follow", file=sys.stderr)
        return EXIT_ERROR
    try:
        return asyncio.run(follow_status(args))
    except KeyboardInterrupt:
        print("regen status --follow: interrupted; the run goes on", file=sys.stderr)
        return EXIT_INTERRUPTED
