"""One run over three hosts through SGLang's real router (sglang-router), each host a network
namespace with its own sshd and simulator workers (tests/netns_hosts.py): every sample exactly
once, a host cut off mid-run loses nothing, and it gets work again when it comes back."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from engine.config.load import Host, Router, dump_toml
from engine.servers.server_log import READY_LINE
from tests.netns_hosts import netns_available, start_hosts
from tests.run_helpers import process_alive
from tests.sshd_fixtures import find_sshd, free_port, free_port_base
from tests.test_engine_run import (REPO, expected_samples, make_config, read_rows, renderer_for, status,  # noqa: F401
                                   supervisors, wait_for)

pytestmark = [pytest.mark.sshd, pytest.mark.timeout(420)]


@pytest.fixture(params=["netns", "loopback"])
def sim_hosts(request, tmp_path):
    """netns: a cut is the host's link going down (servers keep running, the host comes back as it
    was). loopback: a cut kills the host's sshd and agent (its servers die with it), so the rejoin
    also restarts the agent and its servers."""
    if find_sshd() is None:
        pytest.skip("sshd not installed (apt-get install openssh-server)")
    if request.param == "netns" and (why := netns_available()):
        pytest.skip(f"network namespaces unavailable here ({why}); the loopback variant runs instead")
    hosts = start_hosts(tmp_path / "hosts", 3, force_loopback=request.param == "loopback")
    yield hosts
    hosts.close()


@pytest.fixture
def any_hosts(tmp_path):
    """Three hosts of one kind, for a test that cuts none (the two kinds differ only in what a cut does):
    namespaces where they can be made, else loopback; one run, not two, in the suite's time budget."""
    if find_sshd() is None:
        pytest.skip("sshd not installed (apt-get install openssh-server)")
    hosts = start_hosts(tmp_path / "hosts", 3, force_loopback=netns_available() is not None)
    yield hosts
    hosts.close()


def multihost_config(tmp_path, tiny_model_dir, hosts, *, prompts: int, sim: tuple = (), gpus: int = 2,
                     policy: str = "round_robin", names: list[str] | None = None):
    cfg = make_config(tmp_path / "run", tiny_model_dir, prompts=prompts, gpus=gpus, sim=sim)
    chosen = [h for h in hosts.hosts if names is None or h.name in names]
    return cfg.model_copy(update=dict(
        hosts=tuple(Host(name=h.name, address=h.address, gpus=tuple(range(gpus)), work_dir=str(h.work_dir),
                         host_python=sys.executable, base_port=h.base_port,
                         ssh_options=("-F", str(hosts.ssh_config))) for h in chosen),
        # the SSH forwards' local ends from a free block, not the fixed 40000 up: runs side by side (xdist workers)
        router=Router(policy=policy, port=free_port(), prometheus_port=free_port(), python=sys.executable,
                      forward_base_port=free_port_base(len(chosen) * gpus), host_lost_after_s=4.0),
    ))


def regen_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "console.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200"))


def events(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]


def test_three_hosts_every_sample_once_and_a_cut_host_rejoins(tmp_path, tiny_model_dir, sim_hosts, supervisors,
                                                               renderer_for):
    cfg = multihost_config(tmp_path, tiny_model_dir, sim_hosts, prompts=900,
                           sim=("--sim-output-mean", "120", "--max-running-requests", "8", "--sim-step-ms", "60",
                                "--sim-tokens-per-step", "4"))
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)

    st = wait_for(lambda: (lambda s: s if s and s.get("router", {}).get("up") and len(s["router"]["members"]) == 6
                           else None)(status(run_dir)), 120, "all six servers in the router", sup)
    assert {h["name"]: h["state"] for h in st["hosts"]} == {"h1": "up", "h2": "up", "h3": "up"}
    assert {w["host"] for w in st["workers"]} == {"h1", "h2", "h3"}
    wait_for(lambda: ((status(run_dir) or {}).get("dispatch") or {}).get("done", 0) >= 40, 120, "first samples", sup)

    # the clock is read before the cut begins: the supervisor may see the host go while the cut is still
    # under way (sshd stopped, then the agent killed), so a time taken after it can be later than the alert
    assert not [e for e in events(run_dir) if e["type"] == "alert" and "host h2 lost" in e["text"]]
    cut_at = time.time()
    sim_hosts.cut("h2")
    lost = wait_for(lambda: next((e for e in events(run_dir) if e["type"] == "alert" and "host h2 lost" in e["text"]),
                                 None), 60, "the host-lost alert", sup)
    st = status(run_dir)
    assert {h["name"]: h["state"] for h in st["hosts"]}["h2"] in ("lost", "connecting")
    assert not [m for m in st["router"]["members"] if m in {w["url"] for w in st["workers"] if w["host"] == "h2"}]
    done_during_cut = st["dispatch"]["done"]
    # as `regen start` records it, so `regen status` runs this checkout's engine with this python
    (run_dir / ".regen").mkdir(exist_ok=True)
    (run_dir / ".regen" / "launch.json").write_text(json.dumps({"host_python": sys.executable,
                                                                 "engine_path": str(REPO), "run_dir": str(run_dir)}))
    shown = regen_cli("status", "local", "--run-dir", str(run_dir))
    assert shown.returncode == 0, shown.stderr
    h2_line = next(line for line in shown.stdout.splitlines() if line.strip("│┃ ").startswith("h2 "))
    assert "lost" in h2_line or "connecting" in h2_line, shown.stdout
    assert "h1.gpu0" in shown.stdout and "h3.gpu1" in shown.stdout and "(by host)" in shown.stdout
    wait_for(lambda: (status(run_dir) or {}).get("dispatch", {}).get("done", 0) > done_during_cut + 20, 120,
             "progress on the two remaining hosts", sup)

    # paused while h2 comes back: on a loaded box the two other hosts would otherwise finish the run first
    paused = regen_cli("pause", "local", "--all", "--run-dir", str(run_dir))
    assert paused.returncode == 0, paused.stderr
    left = wait_for(lambda: status(run_dir), 30, "the run's status", sup)["dispatch"]
    assert left["done"] + 100 < left["total"], left  # work left for the rejoined host
    sim_hosts.rejoin("h2")
    wait_for(lambda: next((e for e in events(run_dir) if e["type"] == "alert" and "host h2 rejoined" in e["text"]),
                          None), 90, "the rejoin alert", sup)
    wait_for(lambda: len(((status(run_dir) or {}).get("router") or {}).get("members", ())) == 6, 120,
             "h2's servers back in the router", sup)
    rejoined_at = time.time()
    resumed = regen_cli("resume", "local", "--all", "--run-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert sup.wait(300) == 0, sup.log_text()[-4000:]

    rows = read_rows(run_dir)
    expected, _ = expected_samples(cfg, renderer_for(cfg))
    rejected = sum(1 for line in (run_dir / "rejects.jsonl").read_text().splitlines()
                   if json.loads(line)["reason"].startswith("turn "))
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a sample was written twice"
    assert len(rows) + rejected == len(expected), "a sample was lost"
    assert lost["severity"] == "error" and lost["ts"] >= cut_at
    # the rejoined host served requests after it came back (its servers' own logs say so)
    served_after = 0
    for log in sim_hosts.host("h2").work_dir.glob("workers/*/server.log"):
        for line in log.read_text(errors="replace").splitlines():
            if "POST /generate" in line and line.startswith("["):
                stamp = time.mktime(time.strptime(line[1:20], "%Y-%m-%d %H:%M:%S"))
                served_after += stamp >= rejoined_at - 1
    assert served_after > 0, "the rejoined host got no work"
    final = [e for e in events(run_dir) if e["type"] == "dispatch"][-1]
    assert final["failed"] == 0


def test_probe_reports_every_host_and_names_the_one_not_reached(tmp_path, tiny_model_dir, sim_hosts):
    cfg = multihost_config(tmp_path, tiny_model_dir, sim_hosts, prompts=10)
    (tmp_path / "run").mkdir(exist_ok=True)
    run_toml = tmp_path / "multi.toml"
    run_toml.write_text(dump_toml(cfg))
    sim_hosts.cut("h3")
    r = regen_cli("probe", "local", "--config", str(run_toml), "--json", timeout=240)
    doc = json.loads(r.stdout)
    assert doc["schema"] == "regen.probe-fleet/1"
    by_name = {h["name"]: h for h in doc["hosts"]}
    assert list(by_name) == ["dispatch", "h1", "h2", "h3"]
    dispatch = {p["id"]: p for p in by_name["dispatch"]["report"]["probes"]}
    assert dispatch["router.package"]["status"] == "PASS" and "sglang-router 0.3.2" in dispatch["router.package"]["summary"]
    assert dispatch["prompts.paths"]["status"] == "PASS"
    assert "ports" not in dispatch and "gpu.nvidia_smi" not in dispatch
    for name in ("h1", "h2"):
        probes = {p["id"]: p for p in by_name[name]["report"]["probes"]}
        assert by_name[name]["reached"] and probes["connection"]["status"] == "PASS"
        assert probes["ports"]["status"] == "PASS", probes["ports"]
        # the hosts run the simulator launch: a rehearsal, said as such (not a FAIL, not hidden)
        assert probes["gpu.nvidia_smi"]["status"] == "SKIP", probes["gpu.nvidia_smi"]
        assert probes["gpu.nvidia_smi"]["summary"] == "rehearsal: simulated GPUs"
        assert by_name[name]["report"].get("rehearsal") is True
        assert "router.package" not in probes and "prompts.paths" not in probes
    h3 = {p["id"]: p for p in by_name["h3"]["report"]["probes"]}
    assert not by_name["h3"]["reached"] and h3["connection"]["status"] == "ERROR"
    assert sim_hosts.host("h3").address in h3["connection"]["summary"] or sim_hosts.host("h3").listen in json.dumps(h3["connection"]) \
        or "127.0.0.1" in json.dumps(h3["connection"])
    assert r.returncode == 1, r.stderr

    text = regen_cli("probe", "local", "--config", str(run_toml), "--only", "ports", timeout=240)
    assert text.returncode == 1
    assert "h1 (regen-h1)" in text.stdout and "h3 (regen-h3) not reached" in text.stdout


def test_regen_start_preflights_every_host_and_refuses_when_one_is_down(tmp_path, tiny_model_dir, any_hosts):
    sim_hosts = any_hosts  # either kind of cut makes the host unreachable, which is all the preflight sees
    cfg = multihost_config(tmp_path, tiny_model_dir, sim_hosts, prompts=30, names=["h1", "h3"])
    run_toml = tmp_path / "multi.toml"
    run_toml.write_text(dump_toml(cfg))
    sim_hosts.cut("h3")
    refused = regen_cli("start", "local", "--config", str(run_toml), timeout=240)
    assert refused.returncode == 1, refused.stderr
    assert "preflight failed on h3; nothing was started" in refused.stderr
    assert "h3 (regen-h3) not reached" in refused.stderr
    assert not (tmp_path / "run" / "supervisor.pid").exists()

    sim_hosts.rejoin("h3")
    started = regen_cli("start", "local", "--config", str(run_toml), timeout=240)
    try:
        assert started.returncode == 0, started.stderr
        assert "preflight passed on 3 hosts: dispatch, h1, h3" in started.stderr
        done = wait_for(lambda: (lambda s: s if s and s["state"] in ("done", "failed") else None)(
            status(tmp_path / "run")) or (not (tmp_path / "run" / "supervisor.pid").exists() and {"state": "exited"}),
            180, "the started run to finish")
        assert done["state"] in ("done", "exited")
        log = (tmp_path / "run" / "supervisor.log").read_text()
        # the preflight above reached both hosts; which of them came up before this 41-sample run ended is timing (under
        # two CPU hogs h1 once took every sample before h3's link was up), so at least one, and no host failed
        assert "run done" in log and ("host h1: up" in log or "host h3: up" in log), log[-3000:]
        assert "host h1 lost" not in log and "host h3 lost" not in log, log[-3000:]
        # the router picks the server; the row says it went through the router (SGLang's reply does not name it)
        assert {r["worker"] for r in read_rows(tmp_path / "run")} == {"router"}
    finally:
        regen_cli("stop", "local", "--run-dir", str(tmp_path / "run"))


async def test_tui_preflight_probes_every_host_under_its_name(tmp_path, tiny_model_dir, sim_hosts):
    from console.host.connect import open_transport
    from console.host.source import HostSource

    cfg = multihost_config(tmp_path, tiny_model_dir, sim_hosts, prompts=10, names=["h1", "h2"])
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "run.toml").write_text(dump_toml(cfg))
    transport = await open_transport("local")
    source = HostSource("local", str(run_dir), host_python=sys.executable, transport=transport)
    try:
        await source.connect()
        report = await source.probes()
        ids = {r.id: r for r in report.results}
        assert {"router.package", "prompts.paths", "h1:ports", "h2:ports", "h1:connection", "h2:gpu.nvml"} <= set(ids)
        assert ids["h1:ports"].status.value == "PASS" and ids["h1:ports"].title.startswith("h1: "), \
            [(r.id, r.status.value, r.summary) for r in report.results]
        again = await source.probes({"h2:ports"})
        assert [r.id for r in again.results if r.id.endswith("ports")] == ["h2:ports"]
    finally:
        await transport.close()


def _server_lines(host) -> list[str]:
    return [line for log in host.work_dir.glob("workers/*/server.log")
            for line in log.read_text(errors="replace").splitlines()]


def _generate_lines(host) -> int:
    """Requests the host's servers answered (the access line is written when the answer is sent)."""
    return sum(1 for line in _server_lines(host) if "POST /generate" in line)


_FETCH = "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"


def _idle(host) -> bool:
    """Nothing runs or waits on the host's server (its own /metrics, read where it listens: inside the host's
    network namespace when it has one), so a request it answers later can only be new. Counting log lines
    cannot tell: SGLang's /health is a 1-token generation through the same scheduler, and a check that is
    answered before its own generation runs is aborted unlogged."""
    launch = next(line for line in _server_lines(host) if "launching:" in line)
    port = re.search(r"--port (\d+)", launch).group(1)
    cmd = [sys.executable, "-c", _FETCH, f"http://127.0.0.1:{port}/metrics"]
    if host.netns:
        cmd = ["ip", "netns", "exec", host.netns, *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return False
    gauges = [float(m.group(2)) for m in re.finditer(r"^sglang:num_(running|queue)_reqs(?:\{[^}]*\})? (\S+)$",
                                                     r.stdout, re.M)]
    return bool(gauges) and not any(gauges)


def test_a_drained_host_gets_no_new_work_until_undrained(tmp_path, tiny_model_dir, any_hosts, supervisors,
                                                          renderer_for):
    sim_hosts = any_hosts
    from tests.test_engine_run import ctl

    # ~280 samples: ~90 are done by the undrain (the checks need ~50 after the first 20); the rest is the tail
    cfg = multihost_config(tmp_path, tiny_model_dir, sim_hosts, prompts=200, names=["h1", "h2"], gpus=1,
                           sim=("--sim-output-mean", "120", "--max-running-requests", "8", "--sim-step-ms", "60",
                                "--sim-tokens-per-step", "4"))
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    wait_for(lambda: (lambda s: s if s and len((s.get("router") or {}).get("members") or []) == 2 else None)(
        status(run_dir)), 120, "both servers in the router", sup)
    wait_for(lambda: ((status(run_dir) or {}).get("dispatch") or {}).get("done", 0) >= 20, 120, "first samples", sup)

    (run_dir / ".regen").mkdir(exist_ok=True)
    (run_dir / ".regen" / "launch.json").write_text(json.dumps({"host_python": sys.executable,
                                                                 "engine_path": str(REPO), "run_dir": str(run_dir)}))
    r = ctl(run_dir, "drain-host", "h2")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["result"]["state"] == "drained"
    wait_for(lambda: len((status(run_dir) or {}).get("router", {}).get("members") or [1, 1]) == 1, 30,
             "h2 out of the router", sup)
    # the requests already on h2 finish (the long tail of the output lengths can take several seconds)
    wait_for(lambda: _idle(sim_hosts.host("h2")), 120, "h2's requests answered", sup)
    served = _generate_lines(sim_hosts.host("h2"))
    done_before = status(run_dir)["dispatch"]["done"]
    wait_for(lambda: status(run_dir)["dispatch"]["done"] >= done_before + 30, 120, "progress on h1 alone", sup)
    assert _generate_lines(sim_hosts.host("h2")) == served, "a drained host got new requests"
    assert {h["name"]: h["state"] for h in status(run_dir)["hosts"]}["h2"] == "drained"
    assert ctl(run_dir, "drain-host", "h9").returncode == 1
    # the console reaches only the supervisor's machine: the supervisor reads a host's server log over its SSH
    told = ctl(run_dir, "log-tail", "h2.gpu0", "--lines", "50")
    assert told.returncode == 0, told.stderr
    tail = json.loads(told.stdout)["result"]
    assert tail["path"] == f"h2:{sim_hosts.host('h2').work_dir}/workers/h2.gpu0/server.log"
    # h2's own server log: a drained host that idled long shows only the supervisor's health and metrics polls
    assert any(word in tail["text"] for word in (READY_LINE, "POST /generate", "GET /metrics", "GET /health")), \
        tail["text"][-2000:]
    assert len(tail["text"].splitlines()) <= 50

    back = regen_cli("drain-host", "local", "h2", "--undo", "--run-dir", str(run_dir))
    assert back.returncode == 0 and "host h2: up (gets work again)" in back.stdout, back.stdout + back.stderr
    wait_for(lambda: _generate_lines(sim_hosts.host("h2")) > served, 60, "h2 serving again after undrain", sup)
    assert sup.wait(300) == 0, sup.log_text()[-4000:]
    rows = read_rows(run_dir)
    expected, _ = expected_samples(cfg, renderer_for(cfg))
    rejected = sum(1 for line in (run_dir / "rejects.jsonl").read_text().splitlines()
                   if json.loads(line)["reason"].startswith("turn "))
    assert len({r["sample_id"] for r in rows}) == len(rows) and len(rows) + rejected == len(expected)


def test_stop_without_its_supervisor_stops_the_host_agents_it_left(tmp_path, tiny_model_dir, any_hosts, supervisors):
    """Agents outlive their supervisor on purpose (a resumed run finds its servers warm); `regen stop` on a run whose
    supervisor died stops them over SSH, their servers with them, and says where; a host it cannot reach is named."""
    from tests.waiting import wait_until

    cfg = multihost_config(tmp_path, tiny_model_dir, any_hosts, prompts=400, names=["h1"], gpus=1,
                           sim=("--sim-step-ms", "60", "--sim-tokens-per-step", "4"))
    run_dir = tmp_path / "run"
    sup = supervisors(run_dir).start(cfg)
    wait_for(lambda: ((status(run_dir) or {}).get("dispatch") or {}).get("done", 0) >= 5, 120, "first samples", sup)
    work = any_hosts.host("h1").work_dir
    agent = int((work / "agent.pid").read_text())
    server = int(next(work.glob("workers/*/server.pid")).read_text())
    sup.kill()
    assert process_alive(agent) and process_alive(server)
    (run_dir / ".regen").mkdir(exist_ok=True)  # what `regen start` leaves for the console's later commands
    (run_dir / ".regen" / "launch.json").write_text(json.dumps({"host_python": sys.executable,
                                                                 "engine_path": str(REPO), "run_dir": str(run_dir)}))

    stopped = regen_cli("stop", "local", "--run-dir", str(run_dir))
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert stopped.stdout.strip() == (f"{run_dir}: no supervisor runs; stopped the host agent(s) its supervisor left "
                                      "running, and their servers, on 1 host(s): h1")
    assert not process_alive(agent) and not process_alive(server)  # stopped means stopped: the agent waited for its server
    told = [e for e in events(run_dir) if e.get("key") == "hosts-leftovers"]
    assert [t["severity"] for t in told] == ["warning"]
    assert told[0]["evidence"] == f"h1: stopped agent pid {agent} in {work.resolve()} and its servers"
    again = regen_cli("stop", "local", "--run-dir", str(run_dir))  # nothing left: the plain no-supervisor answer
    assert again.returncode != 0 and "no supervisor" in (again.stdout + again.stderr).lower()

    # a host that cannot be reached: named with ssh's words, exit 1
    port = free_port()
    gone = cfg.hosts[0].model_copy(update=dict(name="h9", address="127.0.0.1",
                                               ssh_options=("-p", str(port), "-o", "StrictHostKeyChecking=no")))
    (run_dir / "run.toml").write_text(dump_toml(cfg.model_copy(update=dict(hosts=(gone,)))))
    failed = regen_cli("stop", "local", "--run-dir", str(run_dir))
    said = failed.stdout + failed.stderr
    assert failed.returncode == 1, said
    assert "stopping the agent on h9 failed: ssh 127.0.0.1:" in said and f"port {port}: Connection refused" in said
    wait_until(lambda: [e["severity"] for e in events(run_dir) if e.get("key") == "hosts-leftovers"][-1] == "error",
               10, "the error alert")
