"""The TUI's view of a [slurm] run's allocations: the Workers tab's hosts table shows each group's job as squeue says
it (job id, state, pending reason and how long it has waited, nodes, time left, the job queued at a hand-over),
from the status reply, updated in place; a run on one host shows no such table. Frozen status and clock, an SVG
snapshot (regenerate with `--snapshot-update`) and the same facts as text."""
from __future__ import annotations

import asyncio
import dataclasses

from console.tui.app import RegenApp
from console.view.host_table import SLURM_COLUMNS
from console.tui.messages import StatusReceived
from console.view.model import RunModel
from console.host.source import ReplaySource
from engine.api.status import HostStatus, RouterStatus, RunStatus, SlurmGroups, SlurmJobStatus
from engine.api.events import DispatchEvent, GpuEvent, WorkerEvent
from tests.test_tui_charts import screen_text, settled
from tests.waiting import await_until

T0 = 1796200000.0
SIZE = (120, 40)


def hosts(pending: SlurmJobStatus | None = None) -> list[HostStatus]:
    """Three groups: one running, one pending for Resources for 12m34s, one handing over to its next job."""
    return [
        HostStatus(name="regen-0", address="slurm partition gpu", state="up", workers=["regen-0.gpu0", "regen-0.gpu1"],
                   joins=1, lost=0, job=SlurmJobStatus("4127", "RUNNING", "None", "n1", "9:41:07")),
        HostStatus(name="regen-1", address="slurm partition gpu", state="connecting",
                   error="slurm job 4128 PENDING (Resources)", workers=["regen-1.gpu0", "regen-1.gpu1"], joins=0,
                   lost=0, job=pending or SlurmJobStatus("4128", "PENDING", "Resources", "", "10:00:00",
                                                         waiting_since=T0 - 754)),
        HostStatus(name="regen-2", address="slurm partition gpu", state="drained", workers=["regen-2.gpu0"], joins=2,
                   lost=1, job=SlurmJobStatus("4126", "RUNNING", "None", "n3", "4:12", next_job="4131")),
    ]


def slurm_status(host_list: list[HostStatus], checked_at: float = T0) -> RunStatus:
    granted = sum(h.job is not None and h.job.state == "RUNNING" for h in host_list)
    return RunStatus(run_dir="/scratch/regen/run", state="running", pid=4242, started_at=T0 - 3600,
                     checked_at=checked_at, hosts=host_list,
                     slurm_groups=SlurmGroups(wanted=3, counted=2, granted=granted, serving=1,
                                              pending=len(host_list) - granted),
                     router=RouterStatus(url="http://127.0.0.1:30100", up=True, policy="round_robin",
                                         members=["http://10.78.0.2:30000", "http://10.78.0.2:30001"]))


class LiveReplay(ReplaySource):
    """A supervisor that answers the frozen status and has sent every event: its stream stays open (a ReplaySource
    ends its stream, and the follower would ask again at once)."""

    async def follow(self, since):
        async for ev in super().follow(since):
            yield ev
        await asyncio.Event().wait()


def slurm_app(tmp_path) -> RegenApp:
    events = []
    for i in range(6):
        ts = T0 - 60 + 10 * i
        for name, host, g in (("regen-0.gpu0", "regen-0", 0), ("regen-0.gpu1", "regen-0", 1), ("regen-2.gpu0", "regen-2", 0)):
            events.append(WorkerEvent(ts=ts, name=name, state="ready", gpus=[g], gen_throughput=700.0 + 10 * i,
                                      running_reqs=24, queued_reqs=0, in_flight=24, capacity=40, host=host, remote=True))
            events.append(GpuEvent(ts=ts, index=g, host=host, name="simulated H100", mem_used_mb=60_000.0,
                                   mem_total_mb=81_559.0, util_pct=90.0))
        for name, g in (("regen-1.gpu0", 0), ("regen-1.gpu1", 1)):
            events.append(WorkerEvent(ts=ts, name=name, state="unreachable", gpus=[g], host="regen-1", remote=True,
                                      error="slurm job 4128 PENDING (Resources)"))
        events.append(DispatchEvent(ts=ts, state="running", done=400 + 60 * i, total=4000, in_flight=72,
                                    tokens_per_s=2100.0, eta_s=5400.0))
    telemetry = tmp_path / "telemetry.jsonl"
    telemetry.write_bytes(b"\n".join(e.to_json() for e in events) + b"\n")
    source = LiveReplay(telemetry, status=slurm_status(hosts()), host="login", run_dir="/scratch/regen/run",
                          logs={"regen-0.gpu0": "The server is fired up and ready to roll!\n"})
    return RegenApp(source, clock=lambda: T0 + 5, monotonic=lambda: 1000.0, live=False, export_dir=tmp_path,
                    run_probes_on_start=False)


async def shown(pilot) -> None:
    """The status folded, the telemetry drawn and the workers' log asked (deadline-bound on a loaded machine)."""
    app = pilot.app
    await await_until(lambda: app.model.hosts and app.events_applied >= 54 and app.query_one("#hosts-table").row_count,
                      30, "the allocations shown", interval=0.05)
    await pilot.pause(0.5)


def rows(app: RegenApp) -> dict[str, list[str]]:
    table = app.query_one("#hosts-table")
    return {key.value: [str(c) for c in table.get_row(key)] for key in table.rows}


async def test_the_workers_tab_shows_each_allocation_as_squeue_says_it(tmp_path):
    app = slurm_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await shown(pilot)
        table = app.query_one("#hosts-table")
        assert table.display and [str(c.label) for c in table.columns.values()] == SLURM_COLUMNS
        assert rows(app) == {
            "regen-0": ["regen-0", "4127", "RUNNING", "", "n1", "9:41:07", "", "up", "2", ""],
            # its link's error is the job's state in words: said once, in the job's cells
            "regen-1": ["regen-1", "4128", "PENDING 12m34s", "Resources", "", "", "", "connecting", "2", ""],
            "regen-2": ["regen-2", "4126", "RUNNING", "", "n3", "4:12", "4131", "drained", "1", ""],
        }
        text = screen_text(app)
        assert "PENDING 12m34s" in text and "Resources" in text
        # above the allocations: the groups granted / pending of those wanted, against the plan's min_groups
        assert "slurm groups: 2 granted (1 serving), 1 pending, 3 wanted; the plan counts on 2" in text
        assert app.focused is app.query_one("#workers-table")  # the cursor stays the workers'

        # the pending job started: its row changes in place, the others are left as they are
        started = SlurmJobStatus("4128", "RUNNING", "None", "n2", "9:59:50")
        later = slurm_status([dataclasses.replace(h, state="up", error=None) if h.name == "regen-1" else h
                              for h in hosts(started)], checked_at=T0 + 10)
        app.post_message(StatusReceived(later))
        await await_until(lambda: rows(app)["regen-1"][2] == "RUNNING", 10, "the started job's row", interval=0.05)
        await await_until(lambda: "slurm groups: 3 granted" in screen_text(app), 10, "the groups line", interval=0.05)
        assert rows(app)["regen-1"] == ["regen-1", "4128", "RUNNING", "", "n2", "9:59:50", "", "up", "2", ""]
        assert list(rows(app)) == ["regen-0", "regen-1", "regen-2"]


def test_a_status_repeating_the_allocations_redraws_nothing_but_a_wait_grows():
    m = RunModel()
    running = [h for h in hosts() if h.name != "regen-1"]
    assert "workers" in m.apply_status(slurm_status(running))
    assert "workers" not in m.apply_status(slurm_status(running, checked_at=T0 + 10))  # coalesced: nothing new
    assert "workers" in m.apply_status(slurm_status(hosts(), checked_at=T0 + 20))
    # a job still waiting: the same reply ten seconds on shows a longer wait
    assert "workers" in m.apply_status(slurm_status(hosts(), checked_at=T0 + 30)) and m.hosts_as_of == T0 + 30


async def test_a_run_on_one_host_shows_no_hosts_table(tmp_path):
    from tests.test_tui_charts import synthetic_app

    app = synthetic_app(tmp_path, minutes=2)
    async with app.run_test(size=SIZE) as pilot:
        await settled(pilot)
        assert not app.query_one("#hosts-table").display and app.focused is app.query_one("#workers-table")


def test_snapshot_workers_tab_of_a_slurm_run(tmp_path, snap_compare):
    assert snap_compare(slurm_app(tmp_path), terminal_size=SIZE, run_before=shown)
