"""Host-side control CLI: `python -m engine.ctl --run-dir D OP ...` sends one control op (engine.api.ops) and prints
its reply (exit 0 ok, 1 an error reply, 2 no supervisor there); `serve` answers a console's JSON-line requests on
stdin (many ops and the telemetry follow over one process); `follow [--since TS]` prints telemetry.jsonl, then
follows it until the supervisor has exited and every line is printed.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import psutil

import engine
from engine.api.control_socket import request
from engine.api.protocol import (PROTOCOL_VERSION, ErrorKind, ProtocolError, Reply, decode_request, encode_event_line,
                                 encode_reply)
from engine.api.ops import (EXITED, ChannelOp, ControlError, Follow, FollowEnded, Hello, HelloResult, LastStatus, Op,
                            RunEnding, Stop)
from engine.api.op_cli import UsageError, add_op_commands, op_of
from engine.api.op_codec import encode_op
from engine.api.status import SlurmGroups

EXIT_OK, EXIT_ERROR_REPLY, EXIT_UNREACHABLE = 0, 1, 2
# the ops answered with one reply (answer()); follow is a stream (follow(), stream_follow())
Answered = Op | Hello | LastStatus


def build_parser() -> argparse.ArgumentParser:
    """One subcommand per op (engine.api.op_cli, from the op's fields), then follow's --poll and serve."""
    parser = argparse.ArgumentParser(prog="python -m engine.ctl", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--timeout", type=float, default=30.0)
    sub, ops = add_op_commands(parser)
    ops["follow"].add_argument("--poll", type=float, default=0.2)
    sub.add_parser("serve", help="the console's control channel: requests on stdin, replies on stdout")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run_dir = Path(args.run_dir).expanduser()
    if args.op == "serve":
        return serve(run_dir, args.timeout)
    try:
        op = op_of(args)
    except (UsageError, ControlError) as exc:
        print(exc, file=sys.stderr)
        return EXIT_ERROR_REPLY
    if isinstance(op, Follow):
        return follow(run_dir, op.since, args.poll)
    reply = answer(run_dir, op, None, args.timeout)
    if reply.ok or reply.kind is ErrorKind.REFUSED:
        sys.stdout.write(encode_reply(reply).decode())
    if not reply.ok:
        print(reply.error, file=sys.stderr)
        return EXIT_UNREACHABLE if reply.kind is ErrorKind.NO_SUPERVISOR else EXIT_ERROR_REPLY
    return EXIT_OK


def answer(run_dir: Path, op: Answered, rid: int | None, timeout: float) -> Reply:
    """The reply to one op: hello and last_status answered here, the others by the supervisor's control socket."""
    if isinstance(op, Hello):
        return Reply(rid, True, HelloResult(engine.__version__, PROTOCOL_VERSION).to_dict())
    if isinstance(op, LastStatus):
        return last_status(run_dir, rid)
    sock = run_dir / "control.sock"
    try:
        data = request(sock, encode_op(op), timeout=timeout)
    except FileNotFoundError:
        return no_supervisor(run_dir, op, rid, f"{sock} does not exist (no supervisor has this run dir open)")
    except (ConnectionRefusedError, ConnectionError, TimeoutError, OSError) as exc:
        return no_supervisor(run_dir, op, rid, f"nothing answers at {sock}: {type(exc).__name__}: {exc}")
    except orjson.JSONDecodeError as exc:
        return Reply(rid, False, error=f"the supervisor at {sock} replied with no JSON: {exc}")
    if data.get("ok"):
        return Reply(rid, True, data.get("result") or {})
    return Reply(rid, False, error=str(data.get("error") or "error reply without text"))


def no_supervisor(run_dir: Path, op: ChannelOp, rid: int | None, why: str) -> Reply:
    """No supervisor answers. A stop of a run whose supervisor has died releases what it left holding GPUs: a
    [slurm] run's jobs (by the ids it recorded, nothing else), a [[hosts]] run's agents and their servers (local
    servers die with their supervisor). The reply says what; any other op, or nothing left, is the no-supervisor
    reply."""
    if isinstance(op, Stop) and not supervisor_alive(run_dir):
        from engine.placement.leftovers import stop_left

        left = stop_left(run_dir)
        said = "; ".join(x.text() for x in left)
        if any(x.failed for x in left):
            return Reply(rid, False, error=f"no supervisor runs on {run_dir}; {said}")
        if left:
            return Reply(rid, True, RunEnding(state=f"{EXITED} {said}").to_dict())
    return Reply(rid, False, error=why, kind=ErrorKind.NO_SUPERVISOR)


def serve(run_dir: Path, timeout: float, poll: float = 0.2) -> int:
    """Answer request lines from stdin, in order, until stdin closes (engine.api.protocol). A follow streams from its own
    thread while the other requests are answered; a new follow ends the one before it."""
    out = Output(sys.stdout.buffer)
    following: tuple[threading.Thread, threading.Event] | None = None
    while line := sys.stdin.buffer.readline():
        if not line.strip():
            continue
        try:
            req = decode_request(line)
        except ProtocolError as exc:
            out.write(encode_reply(Reply(exc.id, False, error=str(exc), kind=ErrorKind.BAD_REQUEST)))
            continue
        if isinstance(req.op, Follow):
            if following is not None:
                following[1].set()
                following[0].join()
            stop = threading.Event()
            thread = threading.Thread(target=stream_follow, args=(run_dir, req.id, req.op.since, poll, stop, out),
                                      name=f"follow-{req.id}", daemon=True)
            thread.start()
            following = (thread, stop)
            continue
        out.write(encode_reply(answer(run_dir, req.op, req.id, timeout)))
    return EXIT_OK


class Output:
    """stdout shared by the request loop and a follow's thread: one whole line at a time."""

    def __init__(self, stream):
        self.stream = stream
        self.lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self.lock:
            self.stream.write(data)
            self.stream.flush()


def stream_follow(run_dir: Path, rid: int, since: float | None, poll: float, stop: threading.Event,
                  out: Output) -> None:
    """One follow over the channel: its events, then its last reply (how it ended)."""
    try:
        for lines in telemetry_lines(run_dir, since, poll, stop):
            if lines:
                out.write(b"".join(encode_event_line(rid, line) for line in lines))
    except NoTelemetry as exc:
        out.write(encode_reply(Reply(rid, False, error=str(exc), kind=ErrorKind.NO_SUPERVISOR)))
        return
    except (BrokenPipeError, ValueError):
        return  # the console went away (stdout closed): nobody to tell
    ended = "a newer follow took its place" if stop.is_set() else "the supervisor exited; every event was sent"
    try:
        out.write(encode_reply(Reply(rid, True, FollowEnded(ended).to_dict())))
    except (BrokenPipeError, ValueError):
        return


def last_status(run_dir: Path, rid: int | None) -> Reply:
    """The status the run dir recorded (engine.observe.offline_status), for a run whose supervisor has exited."""
    from engine.observe.offline_status import NotARunDir, offline_status

    try:
        status = offline_status(run_dir)
    except NotARunDir as exc:
        return Reply(rid, False, error=str(exc), kind=ErrorKind.NO_SUPERVISOR)
    status.hosts, status.slurm_groups, problem = allocations_after(run_dir)
    if problem:
        status.read_errors.append(problem)
    return Reply(rid, True, status.to_dict())


def allocations_after(run_dir: Path) -> tuple[list | None, SlurmGroups | None, str | None]:
    """A [slurm] run's allocations as Slurm says them now (engine.placement.slurm.ended): each group's last job, its
    last state, ended; and the groups granted / pending of those wanted. None for any other run (its status has no
    hosts offline), and for a run dir with no run.toml (no jobs to name); a run.toml that cannot be read is the last
    item (the status's read errors say it)."""
    from engine.config.load import ConfigError, load_config

    path = run_dir / "run.toml"
    if not path.exists():
        return None, None, None
    try:
        cfg = load_config(path)
    except (ConfigError, OSError) as exc:
        return None, None, f"{path}: {exc} (a [slurm] run's allocations cannot be named without it)"
    if cfg.slurm is None:
        return None, None, None
    from engine.placement.slurm.ended import allocations_after as slurm_allocations
    from engine.placement.slurm.groups import offline_groups

    hosts = slurm_allocations(cfg)
    return hosts, offline_groups(cfg, hosts), None


def supervisor_alive(run_dir: Path) -> bool:
    try:
        pid = int((run_dir / "supervisor.pid").read_text().strip())
    except (FileNotFoundError, ValueError):
        return False
    try:
        return "engine.supervisor" in " ".join(psutil.Process(pid).cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


class NoTelemetry(Exception):
    """Nothing to follow: no run dir there, or no telemetry file and no supervisor to write one."""


def telemetry_lines(run_dir: Path, since: float | None, poll: float,
                    stop: threading.Event | None = None) -> Iterator[list[bytes]]:
    """telemetry.jsonl's lines with ts >= since, a batch per read, then each batch appended, until the supervisor has
    exited and the file is drained (or `stop` is set); NoTelemetry when there is nothing to follow."""
    path = run_dir / "telemetry.jsonl"
    stop = stop or threading.Event()
    if not run_dir.is_dir():
        raise NoTelemetry(f"no run dir {run_dir} (FileNotFoundError)")
    deadline = time.monotonic() + 30.0
    while not path.exists():
        if not supervisor_alive(run_dir) and time.monotonic() > deadline:
            raise NoTelemetry(f"{path} does not exist and no supervisor runs on {run_dir}")
        if stop.wait(poll):
            return
    with open(path, "rb") as f:
        partial = b""
        idle_since = None
        while not stop.is_set():
            chunk = f.read(1 << 20)
            if chunk:
                idle_since = None
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop()
                yield [line for line in lines if line.strip() and (since is None or _ts(line) >= since)]
                continue
            if not supervisor_alive(run_dir):
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > 1.0:  # writer gone and the file drained
                    return
            if stop.wait(poll):
                return
            if os.fstat(f.fileno()).st_size < f.tell():
                f.seek(0)  # truncated or replaced: start over


def follow(run_dir: Path, since: float | None, poll: float) -> int:
    out = sys.stdout.buffer
    try:
        for lines in telemetry_lines(run_dir, since, poll):
            out.write(b"".join(line + b"\n" for line in lines))
            out.flush()
    except NoTelemetry as exc:
        print(exc, file=sys.stderr)
        return EXIT_UNREACHABLE
    return EXIT_OK


def _ts(line: bytes) -> float:
    try:
        return float(orjson.loads(line).get("ts", 0.0))
    except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
        return 0.0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        sys.exit(EXIT_OK)  # the reader (console, ssh channel) closed: following ends
