"""The multi-host pieces that need no hosts: config, ssh destinations, router command line and
membership-derived capacity, and how status and the TUI show hosts."""
from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import aiohttp
import pytest
from rich.console import Console

from console.commands.status import render_status
from console.view.model import RunModel
from engine.config.load import ConfigError, Host, config_from_dict, dump_toml, host_workers
from engine.placement.hosts.admission import admit_remote, live_records, parse_identity_records
from engine.placement.hosts.deploy import host_specs
from engine.placement.hosts.link import HostLink
from engine.placement.hosts.remote_worker import RemoteWorker
from engine.servers.capacity import ServerCapacity
from engine.servers.metrics_client import ServerMetrics
from engine.placement.router import RouterEndpoint, router_argv
from engine.api.status import RunStatus
from engine.servers.identity import ServedNames, Verdict
from engine.api.events import AlertEvent, GpuEvent, WorkerEvent
from engine.api.wire import WorkerState
from engine.servers.identity_record import IdentityRecord
from engine.servers.launch import WorkerSpec
from tests.sim_fixtures import start_sim  # noqa: F401  (fixture)

BASE = {"run_dir": "/r", "model": "/m", "prompts": ["p.jsonl"]}


def cfg_with(hosts: list[dict], **router) -> object:
    return config_from_dict({**BASE, "hosts": hosts, **({"router": router} if router else {})})


def test_hosts_round_trip_through_toml_and_take_their_own_gpus_and_ports():
    cfg = cfg_with([{"name": "a", "address": "root@gpu-a:2222", "gpus": [0, 1, 2, 3], "tp_size": 2},
                    {"name": "b", "address": "gpu-b", "gpus": [0], "base_port": 31000}], policy="round_robin")
    again = config_from_dict(tomllib.loads(dump_toml(cfg)))
    assert again.hosts == cfg.hosts and again.router == cfg.router
    assert [(s.name, s.gpus, s.port) for s in host_specs(cfg, cfg.hosts[0])] == [("a.gpu0-1", (0, 1), 30000),
                                                                                ("a.gpu2-3", (2, 3), 30001)]
    assert [(s.name, s.port) for s in host_specs(cfg, cfg.hosts[1])] == [("b.gpu0", 31000)]
    assert host_workers(cfg, cfg.hosts[0]).host == "127.0.0.1"  # SGLang stays on loopback: SSH forwards


def test_ssh_destination_splits_a_port():
    assert Host(name="a", address="root@h:2222").ssh_destination() == ["-p", "2222", "root@h"]
    assert Host(name="a", address="alias").ssh_destination() == ["alias"]


@pytest.mark.parametrize("hosts, router, message", [
    ([{"name": "a", "address": "x"}, {"name": "a", "address": "y"}], {}, "[[hosts]] name: 'a' is used twice"),
    ([{"name": "a", "address": "local"}, {"name": "b", "address": "local"}], {}, "only one host can be"),
    ([{"name": "a", "address": "x"}], {"policy": "fastest"}, '[router] policy: "fastest": must be one of'),
    ([{"name": "a", "address": "x"}], {"link": "lan"}, '[[hosts]] #1 lan_address: router.link = "lan" needs it'),
    ([{"name": "a b", "address": "x"}], {}, "letters, digits"),
    ([{"name": "a", "address": "x", "gpus": [0, 1, 2], "tp_size": 2}], {},
     "[[hosts]] #1 gpus: has 3 GPUs, not a multiple of tp_size = 2"),
    ([{"name": "a", "adress": "x"}], {}, "[[hosts]] #1 adress: unknown key; fix: did you mean `address`?"),
])
def test_bad_host_configs_are_refused_naming_the_field(hosts, router, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg_with(hosts, **router)


def test_lan_link_binds_the_lan_address():
    cfg = cfg_with([{"name": "a", "address": "x", "lan_address": "10.0.0.5"}], link="lan")
    assert host_workers(cfg, cfg.hosts[0]).host == "10.0.0.5"


def test_router_argv_binds_loopback_with_the_policy():
    cfg = cfg_with([{"name": "a", "address": "x"}], policy="cache_aware", port=30500, python="/venv/bin/python",
                   extra_args=["--cache-threshold", "0.5"])
    argv = router_argv(cfg)
    assert argv[:3] == ["/venv/bin/python", "-m", "sglang_router.launch_router"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--policy") + 1] == "cache_aware"
    assert argv[argv.index("--prometheus-port") + 1] == "30501" and argv[-2:] == ["--cache-threshold", "0.5"]


class _Router:
    url = "http://127.0.0.1:30500"
    headers: dict = {}
    restarts = 0
    error = None

    counts_load = False

    def __init__(self):
        self.up = True
        self.members: set[str] = set()

    def routes_to(self, url: str) -> bool:  # as if the router listed every server given to it (tests/test_router_listing.py)
        return self.up and url in self.members

    def load_of(self, url: str) -> None:
        return None


def _member(name: str, port: int, running: int) -> RemoteWorker:
    m = RemoteWorker(spec=WorkerSpec(name=name, gpus=(0,), host="127.0.0.1", port=port), host=name.split(".")[0],
                     url=f"http://127.0.0.1:{port}", headers={})
    m.capacity_info = ServerCapacity(max_running_requests=running, context_length=4096)
    m.metrics = ServerMetrics(running_reqs=running, queued_reqs=1)
    return m


def test_endpoint_is_ready_with_one_routed_member_and_sums_their_capacity():
    router = _Router()
    a, b = _member("h1.gpu0", 40000, 16), _member("h2.gpu0", 40001, 8)
    ep = RouterEndpoint(router, members=[a, b])
    seen = []
    ep.listeners.append(lambda _, state: seen.append(state))
    ep.refresh()
    assert ep.state == WorkerState.STARTING  # nothing routed yet
    a.state = b.state = WorkerState.READY
    router.members = {a.url, b.url}
    ep.refresh()
    assert ep.state == WorkerState.READY and ep.capacity_info.max_running_requests == 24
    assert (ep.metrics.running_reqs, ep.metrics.queued_reqs) == (24, 2)
    b.state = "unreachable"
    ep.refresh()
    assert ep.capacity_info.max_running_requests == 16
    router.up = False
    ep.refresh()
    assert seen == [WorkerState.READY, WorkerState.STARTING]


def test_tui_groups_workers_by_host_and_shows_each_hosts_own_gpus():
    m = RunModel("h", "/r")
    m.apply(GpuEvent(ts=1, index=0, mem_used_mb=1000, mem_total_mb=80000, util_pct=90, temp_c=70))
    m.apply(WorkerEvent(ts=1, name="h2.gpu0", host="h2", remote=True, state="ready", gpus=[0]))
    m.apply(WorkerEvent(ts=1, name="h1.gpu0", host="h1", state="ready", gpus=[0]))
    assert m.worker_gpu(m.workers["h2.gpu0"])["mem_used_mb"] is None  # not the dispatch host's GPU 0: N/A until h2's
    assert m.worker_gpu(m.workers["h1.gpu0"])["mem_used_mb"] == 1000  # on the dispatch host (not remote)
    m.apply(GpuEvent(ts=2, host="h2", index=0, mem_used_mb=2000, mem_total_mb=80000))  # h2's agent's reading
    assert m.worker_gpu(m.workers["h2.gpu0"])["mem_used_mb"] == 2000
    assert m.worker_gpu(m.workers["h1.gpu0"])["mem_used_mb"] == 1000
    assert [w.name for w in sorted(m.workers.values(), key=lambda w: (w.host, w.name))] == ["h1.gpu0", "h2.gpu0"]


def test_status_shows_hosts_router_and_workers_by_host():
    status = {
        "host": "dispatch", "run_dir": "/r", "state": "running", "pid": 1, "started_at": 0,
        "dispatch": {"state": "running", "done": 5, "total": 10},
        "workers": [WorkerEvent(name="h2.gpu0", host="h2", state="unreachable", error="link down").to_dict(),
                    WorkerEvent(name="h1.gpu0", host="h1", state="ready").to_dict()],
        "hosts": [{"name": "h1", "address": "gpu-a", "state": "up", "joins": 1, "lost": 0, "workers": ["h1.gpu0"]},
                  {"name": "h2", "address": "gpu-b", "state": "lost", "joins": 1, "lost": 1,
                   "error": "the SSH port forwards exited (255)", "workers": ["h2.gpu0"]}],
        "router": {"url": "http://127.0.0.1:30500", "up": True, "policy": "cache_aware", "members": ["x"]},
    }
    console = Console(width=200, record=True)
    console.print(render_status(RunStatus.from_dict(status)))
    text = console.export_text()
    assert "router http://127.0.0.1:30500 cache_aware, up, 1 servers in it" in text
    h2 = next(line for line in text.splitlines() if line.strip("│┃ ").startswith("h2 ") and "gpu-b" in line)
    assert "lost" in h2 and "the SSH port forwards exited (255)" in h2
    assert text.index("h1.gpu0") < text.index("h2.gpu0") and "workers (by host)" in text


# -- identity: a remote server joins the router only as the host agent's proven launch ----------------------
def _record(state: str, name: str | None = "regen-run-h1.gpu0-aa", error: str | None = None) -> IdentityRecord:
    return IdentityRecord(name="h1.gpu0", state=state, served_model_name=name, pid=77, port=30000, error=error)


@pytest.mark.parametrize("record, names, verdict, words", [
    (None, ("regen-run-h1.gpu0-aa",), Verdict.PENDING, "has not recorded"),
    (_record("loading"), ("regen-run-h1.gpu0-aa",), Verdict.PENDING, "has not proven it yet (its state: loading)"),
    (_record("refused", None, "port 30000 on 127.0.0.1 is already in use by pid 9 (sglang)"), ("Qwen3",),
     Verdict.FOREIGN, "the host agent refused it: port 30000 on 127.0.0.1 is already in use by pid 9 (sglang)"),
    (_record("ready"), ("regen-run-h1.gpu0-aa",), Verdict.PROVEN, "the host agent's proven launch (pid 77)"),
    (_record("ready"), ("Qwen3",), Verdict.FOREIGN, "answers as 'Qwen3', but the host agent's launch on port 30000"),
    (_record("ready"), (), Verdict.PENDING, "does not say its name yet"),
])
def test_admit_remote(record, names, verdict, words):
    check = admit_remote(record, ServedNames(names=names, error="GET /v1/models -> HTTP 503"), "h1.gpu0 (url)")
    assert check.verdict == verdict and words in check.reason, check.reason


def test_identity_records_parse_and_name_bad_lines():
    text = _record("ready").to_json() + "\n\n{not json\n"
    records, bad = parse_identity_records(text)
    assert records == {"h1.gpu0": _record("ready")} and len(bad) == 1 and "{not json" in bad[0]


async def test_a_remote_server_joins_only_as_the_agents_proven_launch(start_sim):
    cfg = cfg_with([{"name": "h1", "address": "x"}])
    sim = await start_sim(served_model_name="regen-run-h1.gpu0-aa")
    emitted: list = []
    agent = {"record": _record("refused", None, "port 30000 on 127.0.0.1 is already in use by pid 9 (sglang)")}

    async def fake_ssh(command, stdin=None, timeout=60.0):
        assert "identity.json" in command
        return 0, "agent 4242\n" + agent["record"].to_json() + "\n", ""

    async with aiohttp.ClientSession() as session:
        link = HostLink(cfg, cfg.hosts[0], engine_root=Path("."), session=session, emit=emitted.append,
                        forward_base=45000)
        link.ssh = fake_ssh
        [m] = link.members
        m.url = sim.url
        assert not await link.records.admit(m)  # the agent refused its port's holder: so does the dispatch host
        assert m.state == WorkerState.REFUSED and "is already in use by pid 9" in m.error
        [alert] = [e for e in emitted if isinstance(e, AlertEvent)]
        assert alert.severity == "critical" and alert.key == "worker:h1.gpu0:refused"
        assert alert.text.startswith("worker h1.gpu0 refused on host h1: the host agent refused it")

        agent["record"] = _record("ready", "regen-run-h1.gpu0-other")  # proven there, but another server answers here
        link.records.read_at = float("-inf")
        assert not await link.records.admit(m) and m.state == WorkerState.REFUSED
        assert "answers as 'regen-run-h1.gpu0-aa', but the host agent's launch" in m.error

        agent["record"] = _record("ready")
        link.records.read_at = float("-inf")
        assert await link.records.admit(m) and m.served_model_name == "regen-run-h1.gpu0-aa"
        assert emitted[-1].severity == "info" and emitted[-1].key == "worker:h1.gpu0:refused"
        m.set_state(WorkerState.READY)
        m.served_model_name = "regen-run-h1.gpu0-old"  # the agent restarted it since: a new launch
        await link.records.still_admitted(m)
        assert m.state == WorkerState.LOADING and "its identity is checked again" in m.error


@pytest.mark.parametrize("version,source", [("0.5.5", "log"), ("0.5.23", "internal_states")])
async def test_a_remote_server_s_batch_comes_from_its_agent_s_record_of_the_start_up_line(start_sim, version, source):
    # the start-up line is in the server.log on the host: its agent records it in identity.json
    cfg = cfg_with([{"name": "h1", "address": "x"}])
    sim = await start_sim(served_model_name="regen-run-h1.gpu0-aa", sim_sglang_version=version, sim_max_num_reqs=40)
    record = IdentityRecord(name="h1.gpu0", state="ready", served_model_name="regen-run-h1.gpu0-aa", pid=7,
                            port=30000, startup_batch=40)

    async def fake_ssh(command, stdin=None, timeout=60.0):
        return 0, "agent 4242\n" + record.to_json() + "\n", ""

    async with aiohttp.ClientSession() as session:
        link = HostLink(cfg, cfg.hosts[0], engine_root=Path("."), session=session, emit=lambda _: None,
                        forward_base=45000)
        link.ssh = fake_ssh
        [m] = link.members
        m.url = sim.url
        assert await link.records.admit(m)
        await link._read_capacity(m)
    assert (m.capacity_info.max_running_requests, m.capacity_info.batch_source) == (40, source)
    ev = m.snapshot()
    assert (ev.batch_size, ev.batch_source, ev.host) == (40, source, "h1")


# -- a remote server that crashes: the agent's record says so, and the dispatch host tells the operator ---------
def test_only_the_live_agents_records_count():
    mine = dataclasses.replace(_record("failed"), agent_pid=11)
    gone = dataclasses.replace(_record("failed"), name="h1.gpu1", agent_pid=10)  # a previous agent's: stale
    older = dataclasses.replace(_record("ready"), name="h1.gpu2")  # an agent from before the field
    text = "\n".join(r.to_json() for r in (mine, gone, older))
    assert live_records("agent 11\n" + text) == ({"h1.gpu0": mine, "h1.gpu2": older}, [])
    assert live_records("agent none\n" + text) == ({}, [])
    assert live_records(text)[1] == [f"no agent line: {mine.to_json()[:120]!r}"]


async def test_a_crashed_then_failed_remote_server_is_shown_and_alerted_once_each():
    cfg = cfg_with([{"name": "h1", "address": "x", "work_dir": "/w"}])
    emitted: list = []
    words = ("[ts] Scheduler hit an exception: Traceback (most recent call last):", "RuntimeError: Not enough memory.")
    async with aiohttp.ClientSession() as session:
        link = HostLink(cfg, cfg.hosts[0], engine_root=Path("."), session=session, emit=emitted.append,
                        forward_base=45000)
        link.state = "up"
        [m] = link.members
        crashed = dataclasses.replace(_record("crashed", error="exit code 1: RuntimeError: Not enough memory."),
                                      last_words=words, restarts=0, crashes=1,
                                      last_crash="exit code 1: RuntimeError: Not enough memory.")
        assert link.records.mirror(m, crashed) and link.records.mirror(m, crashed)
        assert (m.state, m.error, m.last_error_lines) == ("crashed", crashed.error, list(words))
        [alert] = [e for e in emitted if isinstance(e, AlertEvent)]  # told once
        assert alert.severity == "error" and alert.key == "worker:h1.gpu0:crash"
        assert alert.text == "worker h1.gpu0 crashed on host h1: exit code 1: RuntimeError: Not enough memory."
        assert alert.evidence.splitlines() == [*words, "log: h1:/w/workers/h1.gpu0/server.log"]
        assert link.records.mirror(m, dataclasses.replace(_record("loading"), restarts=1))
        assert (m.state, m.restarts) == ("loading", 1)
        assert not link.records.mirror(m, dataclasses.replace(_record("loading"), restarts=1))  # nothing new to say
        assert link.status().state == "up"
        link.records.mirror(m, dataclasses.replace(crashed, state="failed", restarts=1, crashes=2))
        assert [e.key for e in emitted[-2:]] == ["worker:h1.gpu0:crash", "worker:h1.gpu0:failed"]  # its last crash
        assert m.state == "failed" and emitted[-1].severity == "critical"
        st = link.status()
        assert st.state == "failed" and st.error == f"every server failed: h1.gpu0: {crashed.error}"


async def test_a_crash_the_agent_relaunched_before_the_link_read_its_record_is_told_once():
    """The agent relaunches a crashed server in about a second; the link reads its records every 2 s, so it may
    never see the record saying `crashed`: the agent's crash count says it, each crash once, whatever state the
    record is read in; a new agent (a rejoin) counts from zero."""
    cfg = cfg_with([{"name": "h1", "address": "x", "work_dir": "/w"}])
    emitted: list = []
    async with aiohttp.ClientSession() as session:
        link = HostLink(cfg, cfg.hosts[0], engine_root=Path("."), session=session, emit=emitted.append,
                        forward_base=45000)
        [m] = link.members
        crash = dict(agent_pid=11, crashes=1, last_crash="signal 9", last_words=("Killed",))
        relaunched = dataclasses.replace(_record("loading"), restarts=1, **crash)
        assert not link.records.mirror(m, relaunched)  # nothing to mirror (it is loading), but the crash is told
        link.records.mirror(m, relaunched)
        link.records.mirror(m, dataclasses.replace(relaunched, state="ready"))
        [alert] = [e for e in emitted if isinstance(e, AlertEvent)]
        assert (alert.key, alert.severity) == ("worker:h1.gpu0:crash", "error")
        assert alert.text == "worker h1.gpu0 crashed on host h1: signal 9"
        assert alert.evidence.splitlines() == ["Killed", "log: h1:/w/workers/h1.gpu0/server.log"]
        # two more crashes between two reads: one alert that says so
        link.records.mirror(m, dataclasses.replace(relaunched, restarts=3, crashes=3, last_crash="exit code 1"))
        assert emitted[-1].text == "worker h1.gpu0 crashed on host h1: exit code 1 (2 crashes since the last one told)"
        # the host rejoined: its new agent's first crash is a new one
        link.records.mirror(m, dataclasses.replace(relaunched, agent_pid=12))
        assert len([e for e in emitted if isinstance(e, AlertEvent)]) == 3


async def test_an_agents_worker_counts_each_crash_in_its_identity_record(tmp_path, tiny_model_dir):
    """A real Worker (the agent's) on the simulator, its server killed: once relaunched and ready again, the record
    the dispatch host reads says ready and still counts the crash with its error."""
    import os
    import signal

    from tests.test_engine_run import make_config
    from tests.test_faults_foreign_server import WorkerRun
    from tests.waiting import await_until

    cfg = make_config(tmp_path / "run", tiny_model_dir, prompts=1)
    async with WorkerRun(cfg) as run:
        await run.wait(lambda: run.worker.state == WorkerState.READY, 60, "ready")
        path = Path(cfg.run_dir) / "workers" / run.worker.name / "identity.json"
        assert IdentityRecord.from_json(path.read_text()).crashes == 0
        os.killpg(run.worker.pid, signal.SIGKILL)
        await await_until(lambda: run.worker.state == WorkerState.READY and run.worker.restarts == 1, 60,
                          "relaunched and ready", interval=0.1)
        record = IdentityRecord.from_json(path.read_text())
        assert (record.state, record.crashes, record.restarts) == ("ready", 1, 1)
        assert record.last_crash.startswith("signal 9") and record.last_words
