"""The multi-host pieces that need no hosts: config, ssh destinations, router command line and
membership-derived capacity, and how status and the TUI show hosts."""
from __future__ import annotations

import tomllib

import pytest
from rich.console import Console

from console.commands.status import render_status
from console.tui.model import RunModel
from engine.config import ConfigError, Host, config_from_dict, dump_toml, host_workers
from engine.host_link import RemoteWorker, host_specs
from engine.metrics_client import ServerCapacity, ServerMetrics
from engine.router import RouterEndpoint, router_argv
from engine.telemetry_events import GpuEvent, WorkerEvent
from engine.workers import WorkerSpec, WorkerState

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
    ([{"name": "a", "address": "x"}, {"name": "a", "address": "y"}], {}, "name(s) used twice: a"),
    ([{"name": "a", "address": "local"}, {"name": "b", "address": "local"}], {}, "only one host can be"),
    ([{"name": "a", "address": "x"}], {"policy": "fastest"}, "router.policy = 'fastest'"),
    ([{"name": "a", "address": "x"}], {"link": "lan"}, "needs lan_address"),
    ([{"name": "a b", "address": "x"}], {}, "letters, digits"),
    ([{"name": "a", "address": "x", "gpus": [0, 1, 2], "tp_size": 2}], {}, "not a multiple of workers.tp_size=2"),
    ([{"name": "a", "adress": "x"}], {}, "unknown key(s) adress"),
])
def test_bad_host_configs_are_refused_naming_the_field(hosts, router, message):
    with pytest.raises(ConfigError, match=".*" + message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace(".", r"\.")):
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

    def __init__(self):
        self.up = True
        self.members: set[str] = set()


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


def test_tui_groups_workers_by_host_and_shows_remote_gpus_as_na():
    m = RunModel("h", "/r")
    m.apply(GpuEvent(ts=1, index=0, mem_used_mb=1000, mem_total_mb=80000, util_pct=90, temp_c=70))
    m.apply(WorkerEvent(ts=1, name="h2.gpu0", host="h2", remote=True, state="ready", gpus=[0]))
    m.apply(WorkerEvent(ts=1, name="h1.gpu0", host="h1", state="ready", gpus=[0]))
    assert m.worker_gpu(m.workers["h2.gpu0"])["mem_used_mb"] is None  # not the dispatch host's GPU 0
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
    console.print(render_status(status))
    text = console.export_text()
    assert "router http://127.0.0.1:30500 cache_aware, up, 1 servers in it" in text
    h2 = next(line for line in text.splitlines() if line.strip("│┃ ").startswith("h2 ") and "gpu-b" in line)
    assert "lost" in h2 and "the SSH port forwards exited (255)" in h2
    assert text.index("h1.gpu0") < text.index("h2.gpu0") and "workers (by host)" in text
