"""Tally the fault-injection suite's figures: `python -m tests.bench.fault_report [--run]`.

Each case in tests/test_faults_*.py records its figures in tests/bench/results/faults.json
(tests/run_helpers.record_figures). This script (optionally running the suite first) adds the
totals (faults injected, survived, samples lost / duplicated, part files corrupted, bad rows tried
and rejected with a reason) under "summary" and prints the table docs/reliability.md shows.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIGURES = REPO / "tests" / "bench" / "results" / "faults.json"

# case key -> (what was injected, how the outcome is described)
CASES = {
    "supervisor_sigkill": "SIGKILL of the supervisor at seeded random moments, restarted each time",
    "worker_sigkill": "SIGKILL of a worker (simulator) process",
    "worker_hang": "worker hangs (port open, nothing answers; --sim-hang-after)",
    "worker_oom": "worker logs a CUDA OOM and exits (--sim-oom-after)",
    "ssh_cut": "SSH connection cut while a console follows (sshd session killed)",
    "disk_full": "run dir disk below the threshold, then full (ENOSPC), then freed",
    "disk_enospc": "run dir disk full at once, before the free-space guard's tick (commits hit ENOSPC)",
    "server_5xx_and_abort": "HTTP 503 bursts and aborted finish reasons",
    "request_timeout": "requests past dispatch.request_timeout_s",
    "context_overflow": "prompt longer than the context",
    "bad_input": "malformed / wrong-shape / empty / huge / invalid UTF-8 / duplicate-id rows",
    "security_local": "run dir and prompt paths with spaces, quotes, ;, $(), backticks (local)",
    "security_ssh_injection": "the same paths through regen start over SSH",
    "security_host_keys": "unknown and changed host keys",
}


def outcome(name: str, c: dict) -> str:
    if name in ("supervisor_sigkill",):
        return (f"{c['faults_injected']} kills: lost {c['samples_lost']}, duplicated {c['samples_duplicated']},"
                f" unreadable parts {c['parts_unreadable']} ({c['samples_committed']} samples)")
    if name.startswith("worker_"):
        return (f"detected in {c['detection_s']} s, ready again after {c['ready_again_s']} s,"
                f" {c['in_flight_requeued']} in-flight re-dispatched, lost {c['samples_lost']},"
                f" duplicated {c['samples_duplicated']}" + (", alert quotes the OOM line"
                                                            if c.get("alert_quotes_oom_line") else ""))
    if name == "ssh_cut":
        return (f"reconnected after {c['reconnect_s']} s, {c['events_missing']} events missing,"
                f" {c['events_repeated']} repeated, supervisor started {c['supervisor_starts']}x")
    if name == "disk_full":
        return (f"dispatch paused {c['pause_detected_s']} s after the fill, {c['parts_unreadable']} unreadable"
                f" parts, resumed and completed; lost {c['samples_lost']}, duplicated {c['samples_duplicated']}")
    if name == "disk_enospc":
        return (f"{c['commit_failures_alerted']} failed commits alerted, rows kept in memory,"
                f" {c['tmp_files_left_while_full']} partial files left, {c['parts_unreadable']} unreadable parts,"
                f" lost {c['samples_lost']}, duplicated {c['samples_duplicated']}")
    if name == "server_5xx_and_abort":
        return (f"{c['http_503_retried']} 503 and {c['aborts_retried']} aborts retried, run done,"
                f" lost {c['samples_lost']}")
    if name == "request_timeout":
        return (f"{c['faults_injected']} timeouts, {c['retried']} retried, {c['recorded_in_rejects']} recorded,"
                f" lost {c['samples_lost']}")
    if name == "context_overflow":
        return f"{c['recorded_in_rejects']} row in rejects.jsonl with the reason"
    if name == "bad_input":
        return (f"{c['bad_rows_tried']} bad rows, {c['rejected_with_reason']} rejected with a reason,"
                f" {c['good_rows_produced']}/{c['good_rows']} good rows produced, status shows"
                f" {c['status_json_rejects']}")
    if name == "security_local":
        return (f"no injected file, control.sock {c['control_sock_mode']}, run dir {c['run_dir_mode']},"
                f" SGLang on {', '.join(c['sglang_listen']) or 'loopback'}, API key leaks {c['api_key_leaks']}")
    if name == "security_ssh_injection":
        return f"{c['injected_files']} injected files, run produced {c['rows']} rows"
    if name == "security_host_keys":
        return f"unknown refused: {bool(c['unknown_refused'])}, changed refused: {bool(c['changed_refused'])}"
    return json.dumps(c)


def summarize(cases: dict) -> dict:
    def total(key: str) -> int:
        return sum(int(c.get(key) or 0) for c in cases.values())

    injected = total("faults_injected") + sum(
        1 for k in ("security_local", "security_ssh_injection") if k in cases) + 2 * ("security_host_keys" in cases)
    failed_cases = [k for k, c in cases.items() if "survived" in c and not c["survived"]]
    bad = cases.get("bad_input", {})
    return {
        "cases": len(cases),
        "faults_injected": injected,
        "cases_survived": len(cases) - len(failed_cases),
        "cases_not_survived": failed_cases,
        "samples_lost": total("samples_lost"),
        "samples_duplicated": total("samples_duplicated"),
        "parts_corrupted": total("parts_unreadable"),
        "bad_rows_tried": int(bad.get("bad_rows_tried", 0)),
        "bad_rows_rejected_with_reason": int(bad.get("rejected_with_reason", 0)),
        "injected_shell_commands_run": total("injected_files"),
        "api_key_leaks": total("api_key_leaks"),
    }


def table(cases: dict) -> str:
    lines = ["| fault | injected | outcome |", "|---|---|---|"]
    for name, what in CASES.items():
        if name in cases:
            lines.append(f"| {name} | {what} | {outcome(name, cases[name])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="run tests/test_faults_*.py first (minutes)")
    args = parser.parse_args(argv)
    if args.run:
        started = time.monotonic()
        tests = sorted(str(p) for p in (REPO / "tests").glob("test_faults_*.py"))
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", *tests], cwd=str(REPO),
                           env={**os.environ, "REGEN_FAULT_FIGURES": str(FIGURES)})  # recorded: tests write here
        print(f"fault suite exited {r.returncode} after {time.monotonic() - started:.0f} s", file=sys.stderr)
        if r.returncode != 0:
            return r.returncode
    try:
        data = json.loads(FIGURES.read_text())
    except FileNotFoundError:
        print(f"{FIGURES} does not exist: run the fault suite first (--run)", file=sys.stderr)
        return 2
    cases = data.get("cases", {})
    data["summary"] = summarize(cases)
    FIGURES.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(table(cases))
    print()
    print(json.dumps(data["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
