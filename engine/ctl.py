"""Host-side control CLI: `python -m engine.ctl --run-dir D status|pause S..|--all|resume ..|
restart-worker W|drain-host H|undrain-host H|drain|stop` prints the supervisor's JSON reply (exit 0 ok, 1 error reply,
2 no supervisor at that run dir); `... follow [--since TS]` prints telemetry.jsonl lines with
ts >= since, then follows the file until the supervisor has exited and every line is printed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import orjson
import psutil

from engine.control import request
from engine.run.control_ops import (Drain, DrainHost, Op, Pause, RestartWorker, Resume, Status, Stop, UndrainHost,
                                    to_request)

EXIT_OK, EXIT_ERROR_REPLY, EXIT_UNREACHABLE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.ctl", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--timeout", type=float, default=30.0)
    sub = parser.add_subparsers(dest="op", required=True)
    p = sub.add_parser("status")
    p.add_argument("--no-shards", action="store_true", help="without the shard list (the console follows shard events)")
    sub.add_parser("last-status")  # no supervisor needed: the last state the run dir recorded
    for name in ("pause", "resume"):
        p = sub.add_parser(name)
        p.add_argument("shards", nargs="*")
        p.add_argument("--all", action="store_true")
    p = sub.add_parser("restart-worker")
    p.add_argument("worker")
    for name in ("drain-host", "undrain-host"):  # multi-host: stop / restart sending a host new work
        p = sub.add_parser(name)
        p.add_argument("host")
    sub.add_parser("drain")
    sub.add_parser("stop")
    p = sub.add_parser("follow")
    p.add_argument("--since", type=float, default=None)
    p.add_argument("--poll", type=float, default=0.2)
    return parser


def op_of(args: argparse.Namespace) -> Op:
    """The control op a parsed command line asks for."""
    if args.op in ("pause", "resume"):
        return (Pause if args.op == "pause" else Resume)(shards=None if args.all else tuple(args.shards))
    if args.op == "restart-worker":
        return RestartWorker(worker=args.worker)
    if args.op in ("drain-host", "undrain-host"):
        return (DrainHost if args.op == "drain-host" else UndrainHost)(host=args.host)
    if args.op == "status":
        return Status(shards=not args.no_shards)
    return {"drain": Drain, "stop": Stop}[args.op]()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run_dir = Path(args.run_dir).expanduser()
    if args.op == "follow":
        return follow(run_dir, args.since, args.poll)
    if args.op == "last-status":
        return last_status(run_dir)
    if args.op in ("pause", "resume"):
        if args.all == bool(args.shards):
            print(f"{args.op}: give shard ids or --all (not both)", file=sys.stderr)
            return EXIT_ERROR_REPLY
    sock = run_dir / "control.sock"
    try:
        reply = request(sock, to_request(op_of(args)), timeout=args.timeout)
    except FileNotFoundError:
        print(f"{sock} does not exist (no supervisor has this run dir open)", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (ConnectionRefusedError, ConnectionError, TimeoutError, OSError) as exc:
        print(f"nothing answers at {sock}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    sys.stdout.write(orjson.dumps(reply).decode() + "\n")
    if not reply.get("ok"):
        print(reply.get("error", "error reply without text"), file=sys.stderr)
        return EXIT_ERROR_REPLY
    return EXIT_OK


def last_status(run_dir: Path) -> int:
    """Print the status the run dir recorded (engine.run.offline_status), for a run whose supervisor has exited."""
    from engine.run.offline_status import NotARunDir, offline_status

    try:
        status = offline_status(run_dir)
    except NotARunDir as exc:
        print(exc, file=sys.stderr)
        return EXIT_UNREACHABLE
    sys.stdout.write(orjson.dumps({"ok": True, "result": status.to_dict()}).decode() + "\n")
    return EXIT_OK


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


def follow(run_dir: Path, since: float | None, poll: float) -> int:
    path = run_dir / "telemetry.jsonl"
    if not run_dir.is_dir():
        print(f"no run dir {run_dir} (FileNotFoundError)", file=sys.stderr)
        return EXIT_UNREACHABLE
    out = sys.stdout.buffer
    deadline = time.monotonic() + 30.0
    while not path.exists():
        if not supervisor_alive(run_dir) and time.monotonic() > deadline:
            print(f"{path} does not exist and no supervisor runs on {run_dir}", file=sys.stderr)
            return EXIT_UNREACHABLE
        time.sleep(poll)
    with open(path, "rb") as f:
        partial = b""
        idle_since = None
        while True:
            chunk = f.read(1 << 20)
            if chunk:
                idle_since = None
                data = partial + chunk
                lines = data.split(b"\n")
                partial = lines.pop()
                for line in lines:
                    if not line.strip():
                        continue
                    if since is not None and _ts(line) < since:
                        continue
                    out.write(line + b"\n")
                out.flush()
                continue
            if not supervisor_alive(run_dir):
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > 1.0:  # writer gone and the file drained
                    return EXIT_OK
            time.sleep(poll)
            if os.fstat(f.fileno()).st_size < f.tell():
                f.seek(0)  # truncated or replaced: start over


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
