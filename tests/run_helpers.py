"""Helpers shared by the fault-injection suite (tests/test_faults_*.py).

The simulated-run harness itself (make_config, SupervisorProc, supervisors, ctl, status, wait_for,
read_rows, expected_samples, check_rows, assert_one_file_per_shard) lives in tests/test_engine_run.py and is re-exported here.
Each fault case records its figures with `record_figures`; tests/bench/fault_report.py tallies them.
"""
from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq

from engine.config.load import RunConfig
from engine.text.render import Renderer
from tests.test_engine_run import (  # noqa: F401  (re-exported for the fault tests)
    REPO, SupervisorProc, assert_one_file_per_shard, check_rows, ctl, expected_samples, make_config, read_rows, renderer_for, status,
    supervisors, wait_for,
)

RECORDED_FIGURES = REPO / "tests" / "bench" / "results" / "faults.json"
# a plain test run keeps the tree clean: figures go to a temp file unless `python -m tests.bench.fault_report --run`
# (make bench) asks for the recorded one
FIGURES_PATH = Path(os.environ.get("REGEN_FAULT_FIGURES") or Path(tempfile.gettempdir()) / "regen-fault-figures.json")


def events(run_dir: Path) -> list[dict]:
    """Every telemetry event written so far (a partial last line is skipped)."""
    out = []
    for line in (run_dir / "telemetry.jsonl").read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the writer's current line
    return out


def rejects(run_dir: Path) -> list[dict]:
    path = run_dir / "rejects.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def sample_accounting(run_dir: Path, cfg: RunConfig, renderer: Renderer) -> dict:
    """Lost / duplicated / unreadable figures of a finished run, re-derived from the inputs.

    A sample is accounted for when it is in a committed part or in rejects.jsonl (a turn rejected
    for context overflow, or failed after its retries, with the reason)."""
    unreadable = 0
    for f in (run_dir / "shards").rglob("*.parquet"):
        try:
            pq.read_table(f)
        except Exception as exc:  # noqa: BLE001 - any read failure counts, and is printed
            print(f"unreadable part file {f}: {exc!r}")
            unreadable += 1
    rows = read_rows(run_dir)
    ids = [r["sample_id"] for r in rows]
    expected, _ = expected_samples(cfg, renderer)
    settled = {f"{r['conversation_id']}#{r['reason'].split(':')[0].replace(' ', '')}" for r in rejects(run_dir)
               if r.get("conversation_id") and r["reason"].startswith("turn ")}
    failed = sum(1 for r in rejects(run_dir) if r.get("kind") == "generation_failed")
    present = set(ids)
    lost = expected - present - settled
    return {"expected": len(expected), "committed": len(ids), "duplicated": len(ids) - len(present),
            "lost": len(lost), "unreadable_parts": unreadable, "rejected_turns": len(settled & expected),
            "failed_after_retries": failed,
            "lost_ids": sorted(lost)[:10]}


def record_figures(case: str, **figures) -> None:
    """Merge one case's figures into FIGURES_PATH (several test processes may write)."""
    FIGURES_PATH.parent.mkdir(parents=True, exist_ok=True)
    with open(Path(tempfile.gettempdir()) / "regen-faults-figures.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            data = json.loads(FIGURES_PATH.read_text()) if FIGURES_PATH.exists() else {}
        except json.JSONDecodeError:
            data = {}
        cases = data.setdefault("cases", {})
        cases[case] = {"recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **figures}
        FIGURES_PATH.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _status_reply(run_dir: Path) -> dict:
    """The control socket's reply to a status request, in-process (no engine.ctl subprocess per poll); raises
    OSError / ValueError while nothing listens (not yet, or gone)."""
    from engine.api.control_socket import request

    return request(run_dir / "control.sock", {"op": "status"}, timeout=5)


def quick_state(run_dir: Path) -> str:
    """The supervisor's state, or why there is none (`no-socket (<error>)`, `error-reply`)."""
    try:
        reply = _status_reply(run_dir)
    except (OSError, ValueError) as exc:
        return f"no-socket ({type(exc).__name__})"
    return (reply.get("result") or {}).get("state", "unknown") if reply.get("ok") else "error-reply"


def live_status(run_dir: Path) -> dict | None:
    """The supervisor's status reply (the ctl `status` op); None while nothing listens (not yet, or gone)."""
    try:
        reply = _status_reply(run_dir)
    except (OSError, ValueError):
        return None
    return reply.get("result") if reply.get("ok") else None


def process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed child not yet reaped is gone for every purpose here)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def children_with_cmdlines(pid: int | None = None) -> list[tuple[psutil.Process, list[str]]]:
    """The live descendants of `pid` (this process) with their command lines; one that exits while being read is
    left out (listed, then gone before its cmdline is read: a race a loaded box makes common)."""
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            found.append((p, p.cmdline()))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found
