"""Records the wire fixtures (tests/data/wire/): every reply engine.ctl gives for a short simulated run (hello, status
with and without its shard list, pause, resume, restart-worker, drain, the run dir's last status once drained, once
killed and once failed) and the first events of each telemetry type. tests/test_wire_fixtures.py decodes them through the wire types.

    PYTHONPATH=. python -m tests.record_wire_fixtures     # ~1 minute; rerun when the engine's replies change
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

from engine.text.tiny_model import build_tiny_model
from tests.test_engine_run import REPO, SupervisorProc, ctl, make_config, status, wait_for

OUT = REPO / "tests" / "data" / "wire"
EVENTS_PER_TYPE = 3
# slow enough to be running while the ops are recorded; empty answers, so that the engine alerts
SLOW_SIM = ("--sim-step-ms", "40", "--sim-tokens-per-step", "2", "--sim-output-mean", "120", "--sim-empty-share", "0.3")


def reply(run_dir: Path, *args: str) -> dict:
    r = ctl(run_dir, *args, timeout=60)
    if r.returncode != 0:
        raise SystemExit(f"engine.ctl {' '.join(args)} exited {r.returncode}: {r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])["result"]


def record(tmp: Path) -> tuple[list[dict], list[str]]:
    model = build_tiny_model(tmp / "model" / "Qwen3-tiny")
    run_dir = tmp / "run"
    sup = SupervisorProc(run_dir).start(make_config(run_dir, model, prompts=400, sim=SLOW_SIM, shard_size=50))
    replies: list[dict] = []

    def keep(name: str, *args: str) -> None:
        replies.append({"name": name, "argv": list(args), "result": reply(run_dir, *args)})

    try:
        wait_for(lambda: (status(run_dir) or {}).get("state") == "running"
                 and (status(run_dir) or {}).get("alerts"), 120, "a running run with an alert", sup)
        keep("hello", "hello")
        keep("status", "status")
        keep("status_no_shards", "status", "--no-shards")
        keep("pause", "pause", "s00007", "s00008")
        keep("resume_all", "resume", "--all")
        keep("restart_worker", "restart-worker", "gpu1")
        keep("log_tail", "log-tail", "gpu0", "--lines", "3")
        keep("drain", "drain")
        if sup.wait(120) != 0:
            raise SystemExit(f"the supervisor failed:\n{sup.log_text()[-3000:]}")
        keep("last_status_drained", "last-status")
        sup = SupervisorProc(run_dir).start()  # started again, then killed: a dead run's last status
        wait_for(lambda: (status(run_dir) or {}).get("state") == "running", 120, "the run started again", sup)
        os.killpg(sup.proc.pid, signal.SIGKILL)
        sup.proc.wait(timeout=10)
        keep("last_status_dead", "last-status")
        prompts = run_dir.parent / f"{run_dir.name}-prompts"
        prompts.rename(prompts.with_name("moved-away"))  # started again without its prompts: a failed run
        sup = SupervisorProc(run_dir).start()
        if sup.wait(120) == 0:
            raise SystemExit(f"the supervisor did not fail without its prompts:\n{sup.log_text()[-3000:]}")
        keep("last_status_failed", "last-status")
    finally:
        sup.cleanup()
    return replies, (run_dir / "telemetry.jsonl").read_text().splitlines()


def first_of_each_type(lines: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for line in lines:
        kind = json.loads(line)["type"]
        if seen.get(kind, 0) < EVENTS_PER_TYPE:
            seen[kind] = seen.get(kind, 0) + 1
            out.append(line)
    return out


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="regen-wire-") as tmp:
        replies, lines = record(Path(tmp))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "replies.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in replies))
    (OUT / "telemetry.jsonl").write_text("".join(line + "\n" for line in first_of_each_type(lines)))
    print(f"wrote {len(replies)} replies and {len(first_of_each_type(lines))} events to {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
