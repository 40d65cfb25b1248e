"""The one liveness rule (console/view/liveness.py) and the view model that applies it: a figure is current only while
its source is live; a supervisor gone, a run ended, a host lost, a worker's server exited or a reading that stopped
coming each mark it (gone / ended / stale with its age), for every panel alike."""
from __future__ import annotations

from console.view.model_parts import ConnectionState, ResumeHint
from console.view.liveness import STALE_AFTER_S, Freshness, of_host, of_run, of_worker
from console.view.model import RunModel
from engine.api.events import DispatchEvent, RunEndEvent, WorkerEvent
from engine.api.status import HostStatus, RunStatus

T0 = 1796200000.0


def test_the_supervisor_decides_first():
    live = of_run(running=True, state="running", connected=True, pid=7)
    assert live.live and live.mark() == "" and live.source == "supervisor pid 7"
    dead = of_run(running=False, state="dead", connected=True)
    assert dead.freshness is Freshness.GONE and dead.text() == "gone: supervisor dead"
    failed = of_run(running=False, state="failed", connected=True)
    assert failed.freshness is Freshness.GONE and "failed" in failed.why
    for state in ("done", "stopped", "drained"):
        ended = of_run(running=False, state=state, connected=True)
        assert ended.freshness is Freshness.ENDED and ended.text() == f"ended: run {state}"
    lost = of_run(running=True, state="running", connected=False, lost_since=T0)
    assert lost.freshness is Freshness.STALE and lost.mark(T0 + 75) == "stale 1m15s"


def test_a_worker_is_no_more_live_than_its_supervisor_nor_its_host():
    live_run = of_run(running=True, state="running", connected=True)
    assert of_worker(live_run, "gpu0", "ready", T0, T0 + 1).live
    gone = of_worker(of_run(running=False, state="dead", connected=True), "gpu0", "ready", T0, T0 + 1)
    assert gone.freshness is Freshness.GONE and gone.source == "worker gpu0"
    lost_host = of_host(live_run, "h1", "lost")
    assert of_worker(live_run, "h1.gpu0", "ready", T0, T0 + 1, lost_host).text() == "gone: host lost"
    assert of_worker(live_run, "gpu0", "crashed", T0, T0 + 1).text() == "ended: server crashed"
    stale = of_worker(live_run, "gpu0", "ready", T0, T0 + STALE_AFTER_S + 5)
    assert stale.freshness is Freshness.STALE and stale.mark(T0 + STALE_AFTER_S + 5) == "stale 0m15s"


def worker(ts: float, name: str = "gpu0", **kw) -> WorkerEvent:
    return WorkerEvent(ts=ts, name=name, state=kw.pop("state", "ready"), gpus=[0], gen_throughput=900.0,
                       running_reqs=30, **kw)


def test_the_model_marks_every_worker_once_the_run_is_over():
    m = RunModel("gpu-box", "/runs/a")
    m.apply_status(RunStatus(run_dir="/runs/a", state="running", running=True, pid=42, checked_at=T0))
    m.apply(worker(T0 + 1))
    w = m.workers["gpu0"]
    assert m.worker_liveness(w).live and m.next_step() is None
    m.resume_hint = ResumeHint("cd /home/me && regen start gpu-box --config run.toml", "as it was started on laptop")
    m.mark_dead(T0 + 2, "the follow stream ended")
    assert m.worker_liveness(w).text() == "gone: supervisor dead"
    assert m.next_step() == m.resume_hint
    # a finished run: every worker ended, nothing to resume
    done = RunModel()
    done.apply(worker(T0))
    done.apply(RunEndEvent(ts=T0 + 5, state="done"))
    assert done.worker_liveness(done.workers["gpu0"]).freshness is Freshness.ENDED and done.next_step() is None


def test_a_connection_lost_makes_live_figures_stale_with_their_age_and_a_silent_worker_goes_stale():
    m = RunModel()
    m.apply_status(RunStatus(run_dir="/r", state="running", running=True, checked_at=T0))
    m.apply(worker(T0, "gpu0"))
    m.apply(worker(T0, "gpu1"))
    m.apply(worker(T0 + 30, "gpu0"))
    m.apply(DispatchEvent(ts=T0 + 30, state="running", done=1, total=10))
    assert m.worker_liveness(m.workers["gpu0"]).live
    silent = m.worker_liveness(m.workers["gpu1"])
    assert silent.freshness is Freshness.STALE and silent.mark(m.last_ts) == "stale 0m30s"
    m.connection.state = ConnectionState.RECONNECTING
    assert m.run_liveness().freshness is Freshness.STALE
    assert m.worker_liveness(m.workers["gpu0"]).freshness is Freshness.STALE and m.next_step() is None


def test_a_lost_host_takes_its_workers_figures_with_it():
    m = RunModel()
    m.apply_status(RunStatus(run_dir="/r", state="running", running=True, checked_at=T0, hosts=[
        HostStatus(name="h1", address="gpu1", state="lost", workers=["h1.gpu0"]),
        HostStatus(name="h2", address="gpu2", state="up", workers=["h2.gpu0"])]))
    m.apply(WorkerEvent(ts=T0, name="h1.gpu0", state="ready", gpus=[0], host="h1", remote=True, running_reqs=15))
    m.apply(WorkerEvent(ts=T0, name="h2.gpu0", state="ready", gpus=[0], host="h2", remote=True, running_reqs=15))
    assert m.worker_liveness(m.workers["h1.gpu0"]).text() == "gone: host lost"
    assert m.worker_liveness(m.workers["h2.gpu0"]).live
