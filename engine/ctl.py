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

EXIT_OK, EXIT_ERROR_REPLY, EXIT_UNREACHABLE = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.ctl", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--timeout", type=float, default=30.0)
    sub = parser.add_subparsers(dest="op", required=True)
    sub.add_parser("status")
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
        payload = {"op": args.op, "shards": "all" if args.all else list(args.shards)}
    elif args.op == "restart-worker":
        payload = {"op": "restart_worker", "worker": args.worker}
    elif args.op in ("drain-host", "undrain-host"):
        payload = {"op": args.op.replace("-", "_"), "host": args.host}
    else:
        payload = {"op": args.op}
    sock = run_dir / "control.sock"
    try:
        reply = request(sock, payload, timeout=args.timeout)
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


LOG_TAIL_LINES = 3
ENDED_STATES = ("done", "stopped", "failed")  # a last dispatch state that was final (before run_end events)


def last_status(run_dir: Path) -> int:
    """A status reply built from the run dir alone (fatal.json, state.sqlite, telemetry.jsonl, rejects.jsonl) for
    a run whose supervisor has exited, marked `running: false`. `state` is how it ended: failed (with `fatal`:
    what, where, the remedy), done / drained / stopped (its `run_end` event), or dead (no cause recorded: killed;
    `log_tail` has the last lines of supervisor.log)."""
    from engine.fatal import read_fatal
    from engine.run.counts import counts_from_store
    from engine.run.status import dispatch_figures, shard_statuses
    from engine.rejects import RejectLog, RejectLogError
    from engine.shard_store import ShardStore

    fatal = read_fatal(run_dir)
    has_store = (run_dir / "state.sqlite").exists()
    log_path = run_dir / "supervisor.log"
    if not has_store and fatal is None and not log_path.exists():
        print(f"{run_dir} holds no state.sqlite: not a run dir, or the run never started", file=sys.stderr)
        return EXIT_UNREACHABLE
    progress, read_errors = [], []
    if has_store:
        try:  # a full disk (the reason the run died, perhaps) must not hide its recorded cause
            store = ShardStore(run_dir)
            try:
                progress = store.progress()
            finally:
                store.close()
        except OSError as exc:
            read_errors.append(f"shard store: {exc}")
    dispatch, alerts, started, run_end, after_end = None, [], None, None, False
    try:
        with open(run_dir / "telemetry.jsonl", "rb") as f:
            for line in f:
                try:
                    ev = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # a line cut by a kill or a full disk
                if not isinstance(ev, dict):
                    continue
                started = started or ev.get("ts")
                kind = ev.get("type")
                if kind == "run_end":
                    run_end, after_end = ev, False
                    continue
                after_end = after_end or run_end is not None  # a later supervisor wrote after that end
                if kind == "dispatch":
                    dispatch = ev
                elif kind == "alert":
                    alerts.append(ev)
    except FileNotFoundError:
        pass  # stopped before its first event
    reject_info = {"total": 0, "by_reason": {}}
    if has_store:
        try:
            with RejectLog(run_dir) as rejects:
                reject_info = {"total": rejects.count, "by_reason": rejects.counts_by_reason()}
        except (OSError, RejectLogError) as exc:
            read_errors.append(f"reject log: {exc}")
    last_dispatch_state = (dispatch or {}).get("state")
    ended = run_end if run_end is not None and not after_end else None
    if fatal is not None:
        state = "failed"
    elif ended is not None:
        state = ended.get("state") or "stopped"
    elif last_dispatch_state in ENDED_STATES and fatal is None:
        state = last_dispatch_state  # a run from before run_end events
    else:
        state = "dead"
    counts = counts_from_store(progress)
    shards = [sh.to_dict() for sh in shard_statuses(counts, (p.shard_id for p in progress if p.paused), state)]
    if dispatch is not None or shards:
        # the figures are the committed state's (the last dispatch event may be older: a full disk drops telemetry
        # lines, a kill cuts the last ones); nothing is in flight without a supervisor, so no rate and no ETA
        figures = dispatch_figures(counts, state).to_dict()
        dispatch = dict(figures, retried=int((dispatch or {}).get("retried") or 0),
                        ts=(dispatch or {}).get("ts", figures["ts"]))
    result = {"run_dir": str(run_dir.resolve()), "state": state, "running": False, "offline": True, "checked_at": time.time(),
              "fatal": fatal.to_dict() if fatal is not None else None, "run_end": ended,
              "last_state": last_dispatch_state, "log": str(log_path), "pid": None,
              "log_tail": _log_tail(log_path) if state == "dead" else [],
              "started_at": started, "host": os.uname().nodename, "dispatch": dispatch, "workers": [],
              "shards": shards, "gpus": [], "disk": [], "alerts": alerts[-20:], "rejects": reject_info,
              "read_errors": read_errors}
    sys.stdout.write(orjson.dumps({"ok": True, "result": result}).decode() + "\n")
    return EXIT_OK


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
            text = f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return [f"(cannot read {path}: {exc})"]
    return [line for line in text.splitlines() if line.strip()][-lines:]


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
