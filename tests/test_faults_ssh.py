"""SSH connection cut while a console follows a run (real sshd, its session process SIGKILLed):
the detached supervisor goes on, the one follow loop the TUI and `regen status --follow` run
(console/host/follow.py) says the stream closed, reconnects with backoff, backfills the telemetry from the
last ts with no gap and no repeat, and never re-sends `start`."""
from __future__ import annotations

import asyncio
import sys
import time

import psutil
import pytest

from console.host.deploy import start_run
from console.host.follow import Backoff, RunFollower
from console.host.ssh_options import SshOptions
from console.host.connect import open_transport
from console.host.source import HostSource
from engine.api.events import parse_event
from tests.run_helpers import make_config, record_figures, sample_accounting
from tests.run_helpers import renderer_for  # noqa: F401  (fixture)
from tests.sshd_fixtures import kill_sshd_connection
from tests.test_cli_run import cleanup_runs  # noqa: F401  (fixture)


@pytest.mark.sshd
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_cut_ssh_connection_reconnects_and_backfills_without_gap(sshd, tmp_path, tiny_model_dir, cleanup_runs,
                                                                 renderer_for):
    run_dir = tmp_path / "ssh run"
    cleanup_runs.append(run_dir)
    cfg = make_config(run_dir, tiny_model_dir, prompts=60, gpus=1,
                      sim=("--sim-output-mean", "120", "--sim-step-ms", "8", "--max-running-requests", "8"))

    async def go():
        transport = await open_transport(sshd.alias, ssh_config=str(sshd.ssh_config_path))
        try:
            started = await start_run(transport, cfg, host_python=sys.executable)
        finally:
            await transport.close()
        # the console's own connection, as `regen tui` and `regen status --follow` open it
        source = HostSource(sshd.alias, str(run_dir), ssh=SshOptions(ssh_config=str(sshd.ssh_config_path)))
        states: list[tuple[float, str, str]] = []
        follower = RunFollower(source, since=0, backoff=Backoff(first_s=0.3), watch_ended=False,
                               on_state=lambda st: states.append((time.time(), st.state, st.error)))
        delivered = []
        cut = {}
        try:
            async for ev in follower.events():
                delivered.append(ev)
                if not cut and ev.type == "dispatch" and ev.state == "running" and ev.done > 0:
                    port = source.transport.connection.get_extra_info("sockname")[1]
                    cut["at"] = time.time()
                    cut["killed"] = kill_sshd_connection(sshd, port)
                    cut["supervisor_alive"] = psutil.pid_exists(started.pid)
        finally:
            await source.close()
        assert follower.stopped_by is None, follower.stopped_by
        return started, states, delivered, cut

    started, states, delivered, cut = asyncio.run(go())
    assert cut, "the run ended before the connection could be cut"
    kinds = [s for _, s, _ in states]
    disconnected = [(t, d) for t, s, d in states if s == "reconnecting"]
    # back in: the run still going ("connected", regained), or already finished, which only a reconnected
    # control call can tell ("ended": no supervisor at the run dir)
    reconnected = [t for t, s, d in states if t >= cut["at"] and ((s == "connected" and d == "regained") or s == "ended")]
    assert disconnected and "(closed)" in disconnected[0][1], states
    assert reconnected, states
    assert cut["supervisor_alive"]
    # no gap, no repeat: exactly the lines of telemetry.jsonl, in order
    on_disk = [parse_event(line).to_json() for line in (run_dir / "telemetry.jsonl").read_text().splitlines()
               if line.strip()]
    got = [ev.to_json() for ev in delivered]
    missing = len(set(on_disk) - set(got))
    repeated = len(got) - len(set(got))
    assert [e.state for e in delivered if e.type == "dispatch"][-1] == "done"
    log_text = (run_dir / "supervisor.log").read_text()
    starts = log_text.count("starting on ")
    acc = sample_accounting(run_dir, cfg, renderer_for(cfg))
    record_figures("ssh_cut", faults_injected=1, survived=int(missing == 0 and starts == 1),
                   reconnect_s=round(reconnected[0] - cut["at"], 2), events_missing=missing,
                   events_repeated=repeated, events_delivered=len(got), supervisor_starts=starts,
                   client_states=kinds, samples_lost=acc["lost"], samples_duplicated=acc["duplicated"])
    assert missing == 0 and repeated == 0
    assert got == on_disk
    assert starts == 1, "the supervisor was started again (start re-sent?)"
    assert acc["lost"] == acc["duplicated"] == 0
