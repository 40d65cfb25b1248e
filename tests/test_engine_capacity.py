"""A run fills servers whose batch size they do not report: the real supervisor against simulated SGLang 0.5.5.

0.5.5 says `max_running_requests: null` in /get_server_info and logs its working batch only in its start-up
line (shared/reference/sglang_contract.md 7.1). Regen must still keep that batch full: from the log line,
or, when no line says it, from the server's own queue. What the operator sees (`regen status`) names the
size and where it came from.
"""
from __future__ import annotations

import io
import json
import re
import urllib.request
from pathlib import Path

import pytest
from rich.console import Console

from console.commands.status import render_status
from engine.servers.capacity import batch_from_log
from engine.config.load import RunConfig
from engine.run.batch_feedback import margin_for
from engine.api.status import RunStatus
from tests.run_helpers import events, make_config, status, supervisors, wait_for  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(300)
FLAG = "--max-running-requests"
PREFILL = re.compile(r"Prefill batch, #new-seq: (\d+), .*#running-req: (\d+),")


def unflagged(cfg: RunConfig, launch: str | None = None) -> RunConfig:
    """The config without --max-running-requests (the demo sets one): the server derives its own batch."""
    args = list(cfg.workers.extra_args)
    while FLAG in args:
        i = args.index(FLAG)
        del args[i:i + 2]
    workers = cfg.workers.model_copy(update=dict(extra_args=tuple(args), launch=launch or cfg.workers.launch))
    return cfg.model_copy(update=dict(workers=workers))


def worker_events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in events(run_dir) if e["type"] == "worker" and e["name"] == name and e["state"] == "ready"]


def batches(log: str) -> list[int]:
    """The running batch after each admission, from the server's own Prefill lines."""
    return [int(new) + int(running) for new, running in PREFILL.findall(log)]


def status_text(st: dict) -> str:
    console = Console(width=240, record=True, file=io.StringIO())
    console.print(render_status(RunStatus.from_dict(st)))
    return console.export_text()


def server_info(run_dir: Path, st: dict, name: str) -> dict:
    url = {w["name"]: w["url"] for w in st["workers"]}[name]
    with urllib.request.urlopen(url + "/get_server_info", timeout=10) as resp:
        return json.loads(resp.read())


def test_an_unreported_batch_is_read_from_the_start_up_line_and_filled(tmp_path, tiny_model_dir, supervisors):
    run_dir = tmp_path / "run"
    # each server runs 32 (its request slots), says null in /get_server_info, and logs 32 at start-up
    cfg = unflagged(make_config(run_dir, tiny_model_dir, prompts=300, gpus=2, sim=(
        "--sim-sglang-version", "0.5.5", "--sim-max-num-reqs", "32", "--sim-output-mean", "300",
        "--sim-step-ms", "10", "--sim-tokens-per-step", "4")))
    sup = supervisors(run_dir).start(cfg)

    def full(st: dict | None) -> dict | None:
        workers = (st or {}).get("workers") or []
        return st if workers and all(w["in_flight"] >= 32 and w["batch_size"] == 32 for w in workers) else None

    st = wait_for(lambda: full(status(run_dir)), 120, "every worker with 32 requests in flight", sup)
    for w in st["workers"]:
        assert (w["batch_size"], w["batch_source"], w["capacity"]) == (32, "log", 40)  # 32 + a margin of 8
        info = server_info(run_dir, st, w["name"])
        assert info["max_running_requests"] is None and info["version"].startswith("0.5.5")
    assert "32 (log)" in status_text(st)
    assert sup.wait(180) == 0, sup.log_text()[-3000:]
    for name in ("gpu0", "gpu1"):
        assert max(e["in_flight"] for e in worker_events(run_dir, name)) == 40
        log = (run_dir / "workers" / name / "server.log").read_text()
        assert "max_running_requests=32, context_len=4096" in log
        # what a multi-host run's dispatch host reads over ssh (it cannot read this log)
        assert json.loads((run_dir / "workers" / name / "identity.json").read_text())["startup_batch"] == 32
        assert max(batches(log)) == 32  # the server ran its whole batch, never more


def test_a_batch_nobody_says_is_found_from_the_server_s_queue(tmp_path, tiny_model_dir, supervisors):
    run_dir = tmp_path / "run"
    # the start-up line is filtered out of server.log (a log regen cannot read): only feedback can find 96
    base = make_config(run_dir, tiny_model_dir, prompts=450, gpus=1, sim=(
        "--sim-sglang-version", "0.5.5", "--sim-max-num-reqs", "96", "--sim-output-mean", "500",
        "--sim-step-ms", "10", "--sim-tokens-per-step", "4"))
    launch = ("sh -c '" + base.workers.launch + " \"$@\" 2>&1 | grep --line-buffered -v max_total_num_tokens=' "
              "regen-sim")
    cfg = unflagged(base, launch)
    sup = supervisors(run_dir).start(cfg)

    def grown(st: dict | None) -> dict | None:
        w = ((st or {}).get("workers") or [{}])[0]
        return st if w.get("batch_source") == "feedback" and w.get("in_flight", 0) >= 96 else None

    st = wait_for(lambda: grown(status(run_dir)), 150, "gpu0 grown by feedback past the 72 of the default", sup)
    w = st["workers"][0]
    assert (w["discovered_batch"], w["discovered_source"]) == (64, "default")  # where it started
    assert "(feedback; default: 64)" in status_text(st)
    assert batch_from_log((run_dir / "workers" / "gpu0" / "server.log").read_text()) is None  # no start-up line
    assert sup.wait(240) == 0, sup.log_text()[-3000:]
    seen = worker_events(run_dir, "gpu0")
    assert max(batches((run_dir / "workers" / "gpu0" / "server.log").read_text())) == 96
    final = [e for e in seen if e["batch_source"] == "feedback"][-1]
    # within a queue margin of the truth (SGLang's running gauge, read at an admission, lags by the admitted)
    assert abs(final["batch_size"] - 96) <= margin_for(96) and final["capacity"] > 96
