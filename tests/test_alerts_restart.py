"""Alerts across SIGKILLs of the supervisor, on the simulator (issue 35: an `empty answers` alert listed after its shard
finished under the level, never cleared, raised twice after a restart).

A run answering ~30% empty raises its shards' empty-answers alerts; the supervisor is SIGKILLed; `regen status` of the
dead run lists those alerts (the run's record in state.sqlite); a restarted supervisor, the alerts still holding, does
not raise them again; killed once more and restarted with a level they are under, it clears each once (a `cleared`
event), and no status lists them any more.
"""
from __future__ import annotations

import json
import time

from rich.console import Console

from console.commands.status import render_status
from engine.api.control_socket import request
from engine.observe.offline_status import offline_status
from engine.api.status import RunStatus
from engine.store.shard_store import ShardStore
from tests.run_helpers import events, live_status
from tests.test_engine_run import make_config, supervisors, wait_for  # noqa: F401  (supervisors: a fixture)


def empty_alerts(run_dir, kind: str | None = None) -> list[dict]:
    return [e for e in events(run_dir) if e["type"] == "alert" and e["key"].startswith("empty:")
            and (kind is None or e.get("kind") == kind)]


def recorded(run_dir) -> set[str]:
    store = ShardStore(run_dir)
    try:
        return {a.key for a in store.raised_alerts()}
    finally:
        store.close()


def last_status(run_dir) -> dict:
    """What engine.ctl last-status replies (the status `regen status [--json]` shows of a run whose supervisor is
    gone), built in-process: the same builder, without a Python started for it."""
    return json.loads(json.dumps(offline_status(run_dir).to_dict()))


def printed(reply: dict) -> str:
    """`regen status` as printed, of that reply."""
    console = Console(record=True, width=200)
    console.print(render_status(RunStatus.from_dict(reply), console))
    return console.export_text()


def judged_since(run_dir, t0: float) -> bool:
    """A tick of the restarted supervisor ran: it judges the shards' quality before it emits the dispatch figures."""
    return any(e["type"] == "dispatch" and e["ts"] > t0 and e["state"] == "running" for e in events(run_dir))


def test_a_killed_supervisors_alerts_are_kept_not_doubled_and_cleared_by_the_next(tmp_path, tiny_model_dir,
                                                                                   supervisors):
    run_dir = tmp_path / "run"
    # ~16 answers/s on one simulated GPU, 30% of them empty: shards of 50 conversations pass the 50 samples the
    # watch judges at within seconds, and the run lasts far longer than the first quality check (10 s in)
    cfg = make_config(run_dir, tiny_model_dir, prompts=400, gpus=1,
                      sim=("--sim-empty-share", "0.3", "--max-running-requests", "8", "--sim-step-ms", "20",
                           "--sim-tokens-per-step", "1"))
    sup = supervisors(run_dir).start(cfg)
    st = wait_for(lambda: (lambda s: s if s and any(a["key"].startswith("empty:") for a in s["alerts"]) else None)(
        live_status(run_dir)), 90, "an empty-answers alert raised", sup)
    assert all(a["kind"] == "raised" and a["severity"] == "error" for a in st["alerts"] if a["key"].startswith("empty:"))
    sup.kill()
    raised = {e["key"] for e in empty_alerts(run_dir)}
    assert raised and recorded(run_dir) >= raised and len(empty_alerts(run_dir)) == len(raised)

    # the dead run's status (what `regen status` reads of it, and prints): the alerts raised now, from the record
    data = last_status(run_dir)
    assert data["state"] == "dead" and {a["key"] for a in data["alerts"]} == recorded(run_dir)
    text = printed(data)
    assert "alerts raised now" in text and "empty answers" in text

    # restarted, the same levels: the alerts still hold, and none is raised again
    t0 = time.time()
    sup = supervisors(run_dir).start()
    wait_for(lambda: judged_since(run_dir, t0), 90, "a tick of the restarted supervisor", sup)
    again = [e for e in empty_alerts(run_dir) if e["key"] in raised]
    assert len(again) == len(raised), [(e["key"], e["kind"], e["ts"]) for e in again]
    assert raised <= {a["key"] for a in live_status(run_dir)["alerts"]}
    sup.kill()

    # restarted with a level the shards are under: each alert the first supervisor raised is cleared, once
    lenient = cfg.model_copy(update=dict(alerts=cfg.alerts.model_copy(update=dict(empty_share=0.95)),
                                         brake=cfg.brake.model_copy(update=dict(empty_share=0.99))))  # above the alert
    t0 = time.time()
    sup = supervisors(run_dir).start(lenient)
    wait_for(lambda: {e["key"] for e in empty_alerts(run_dir, "cleared")} >= raised, 90,
             "the cleared alerts of the restarted supervisor", sup)
    cleared = empty_alerts(run_dir, "cleared")
    assert sorted(e["key"] for e in cleared) == sorted({e["key"] for e in empty_alerts(run_dir, "raised")})
    assert all(e["ts"] > t0 and e["severity"] == "info" and "not above alerts.empty_share 95%" in e["text"]
               for e in cleared)
    st = live_status(run_dir)
    assert not any(a["key"].startswith("empty:") for a in st["alerts"])
    assert any(a["key"].startswith("empty:") for a in st["alert_events"])  # the history keeps them, as history
    assert request(run_dir / "control.sock", {"op": "stop"}, timeout=10)["ok"]
    assert sup.wait(60) == 0, sup.log_text()[-3000:]
    assert not any(k.startswith("empty:") for k in recorded(run_dir))
    done = last_status(run_dir)
    assert done["state"] == "stopped" and not any(a["key"].startswith("empty:") for a in done["alerts"])
    assert "empty answers" not in printed(done).split("recent alert events")[0]
