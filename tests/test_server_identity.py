"""Who holds a port (engine/servers/port_holder.py) and whether the server on it is the one regen launched
(engine/servers/identity.py): the lookups against real sockets and processes, the verdict table."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from engine.config.load import RunConfig, Workers
from engine.servers.port_holder import PortHolder, check_port, describe_pid, process_tree
from engine.servers.identity import (
    Expected, ServedNames, SocketOwner, Verdict, check_identity, judge, operator_served_name, read_served_names,
    served_name,
)
from engine.servers.launch import launch_argv, worker_specs
from engine.servers.server_log import bind_failure
from tests.sim_fixtures import start_sim  # noqa: F401  (fixture)


@pytest.fixture
def listener():
    socks = []

    def make(host: str = "127.0.0.1", listen: bool = True) -> int:
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        s.bind((host, 0))
        if listen:
            s.listen(4)
        socks.append(s)
        return s.getsockname()[1]

    yield make
    for s in socks:
        s.close()


# -- the holder of a port ------------------------------------------------------------------------
def test_a_free_port_is_free_and_a_listened_one_is_held(listener):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    assert check_port("127.0.0.1", free_port).free
    check = check_port("127.0.0.1", listener())
    assert not check.free and check.held


def test_the_holder_is_named_with_its_pid_and_command_line(listener):
    port = listener()
    check = check_port("127.0.0.1", port)
    assert check.held and "Address already in use" in check.bind_error
    assert [h.pid for h in check.holders] == [os.getpid()]
    assert "pytest" in check.holders[0].cmdline
    assert check.holder_text().startswith(f"pid {os.getpid()} (")
    assert f"holder pid: {os.getpid()}" in check.evidence() and f"port: {port} on 127.0.0.1" in check.evidence()


def test_a_wildcard_listener_holds_the_loopback_port(listener):
    port = listener("0.0.0.0")
    check = check_port("127.0.0.1", port)
    assert check.held and [h.pid for h in check.holders] == [os.getpid()]


def test_a_bound_but_not_listening_port_says_why_no_holder_is_named(listener):
    port = listener(listen=False)
    check = check_port("127.0.0.1", port)
    assert check.held and check.holders == ()
    assert "bound but not listening" in check.holder_text()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to drop to nobody")
def test_another_users_holder_is_not_visible_and_the_check_says_why(listener):
    port = listener()  # held by root (this process); looked up as nobody
    code = (f"from engine.servers.port_holder import check_port; c = check_port('127.0.0.1', {port}); "
            "print(c.held, [h.pid for h in c.holders]); print(c.holder_text())")
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=60, env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")
                                                                          or str(Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr
    held, text = out.stdout.splitlines()
    assert held == "True [None]"
    assert text == ("a process whose pid is not visible (another user's process, or one exiting right now; run regen "
                    "as root or as that user to see it)")


def test_an_invisible_pid_says_why():
    holder = describe_pid(None)
    assert holder.pid is None and "another user's process" in holder.describe()
    assert "run regen as root" in holder.describe()


def test_the_process_tree_holds_descendants():
    child = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        assert {os.getpid(), child.pid} <= process_tree(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert process_tree(child.pid) == set()


# -- the launch line -------------------------------------------------------------------------------
def _cfg(**workers) -> RunConfig:
    return RunConfig(run_dir="/runs/my run", model="/m", prompts=("p",), workers=Workers(**workers))


def test_the_launch_line_carries_the_per_launch_name_before_the_key():
    cfg = _cfg(api_key="k")
    name = served_name(cfg.run_dir, "gpu0", "abc123")
    assert name == "regen-my_run-gpu0-abc123"
    argv = launch_argv(cfg, worker_specs(cfg)[0], "/py", served_model_name=name)
    assert argv[argv.index("--served-model-name") + 1] == name and argv[-2:] == ["--api-key", "k"]
    assert operator_served_name(argv) == name


@pytest.mark.parametrize("extra", [("--served-model-name", "Qwen/Qwen3-27B"), ("--served-model-name=Qwen/Qwen3-27B",)])
def test_an_operators_served_name_is_kept(extra):
    cfg = _cfg(extra_args=extra)
    argv = launch_argv(cfg, worker_specs(cfg)[0], "/py", served_model_name="regen-x-gpu0-1")
    assert operator_served_name(argv) == "Qwen/Qwen3-27B" and "regen-x-gpu0-1" not in argv


# -- the verdict ---------------------------------------------------------------------------------
OURS = Expected(served_model_name="regen-r-gpu0-aa", token_is_ours=True, pid=100, host="127.0.0.1", port=30000)
THEIRS = PortHolder(pid=4242, cmdline="python -m sglang.launch_server --port 30000")
HIDDEN = describe_pid(None)


@pytest.mark.parametrize("owner, answer, verdict, words", [
    (SocketOwner(ours=(101,)), ServedNames(names=("regen-r-gpu0-aa",)), Verdict.PROVEN, ["matches"]),
    (SocketOwner(foreign=(THEIRS,)), ServedNames(names=("Qwen3",)), Verdict.FOREIGN,
     ["port 30000 on 127.0.0.1 is served by pid 4242 (python -m sglang.launch_server --port 30000)",
      "not by the server regen launched (pid 100)", "answers as 'Qwen3', expected 'regen-r-gpu0-aa'"]),
    (SocketOwner(hidden=(HIDDEN,)), ServedNames(names=("Qwen3",)), Verdict.FOREIGN,
     ["a process whose pid is not visible", "answers as 'Qwen3'"]),
    (SocketOwner(note="socket table not readable"), ServedNames(error="GET /v1/models -> HTTP 401"),
     Verdict.FOREIGN, ["cannot see (socket table not readable)", "does not say its name (GET /v1/models -> HTTP 401)"]),
    (SocketOwner(ours=(100,)), ServedNames(names=("/models/Qwen3",)), Verdict.OWN_MISMATCH,
     ["the server regen launched (pid 100) serves port 30000", "answers as '/models/Qwen3'",
      "must pass regen's --served-model-name on"]),
    (SocketOwner(ours=(100,)), ServedNames(error="GET /v1/models: ClientConnectorError", reachable=False),
     Verdict.PENDING, ["not answering yet"]),
    (SocketOwner(), ServedNames(names=("Qwen3",)), Verdict.PENDING, ["nobody listens"]),
])
def test_the_verdict_table(owner, answer, verdict, words):
    check = judge(OURS, owner, answer)
    assert check.verdict == verdict, check.reason
    for w in words:
        assert w in check.reason


def test_a_proxy_answering_with_this_launchs_token_is_accepted_with_a_warning():
    check = judge(OURS, SocketOwner(foreign=(PortHolder(pid=7, cmdline="docker-proxy -host-port 30000"),)),
                  ServedNames(names=("regen-r-gpu0-aa",)))
    assert check.verdict == Verdict.PROVEN and "docker-proxy" in check.warning


def test_the_operators_own_name_proves_nothing_without_the_socket_owner():
    theirs = Expected(served_model_name="Qwen3", token_is_ours=False, pid=100, host="127.0.0.1", port=30000)
    assert judge(theirs, SocketOwner(ours=(100,)), ServedNames(names=("Qwen3",))).verdict == Verdict.PROVEN
    check = judge(theirs, SocketOwner(hidden=(HIDDEN,)), ServedNames(names=("Qwen3",)))
    assert check.verdict == Verdict.FOREIGN and "remove --served-model-name" in check.reason
    assert judge(theirs, SocketOwner(foreign=(THEIRS,)), ServedNames(names=("Qwen3",))).verdict == Verdict.FOREIGN


# -- against the simulator ---------------------------------------------------------------------------
async def test_the_simulator_reports_its_served_name_where_sglang_does(start_sim):
    sim = await start_sim(served_model_name="regen-r-gpu0-bb")
    async with aiohttp.ClientSession() as session:
        assert (await read_served_names(session, sim.url, {})).names == ("regen-r-gpu0-bb",)
        async with session.get(sim.url + "/model_info") as resp:  # 0.5.23 carries it here too
            assert (await resp.json())["served_model_name"] == "regen-r-gpu0-bb"
        old = await start_sim(served_model_name="regen-r-gpu0-bb", sim_sglang_version="0.5.5")
        assert (await read_served_names(session, old.url, {})).names == ("regen-r-gpu0-bb",)
        async with session.get(old.url + "/get_model_info") as resp:  # 0.5.5: no such field
            assert "served_model_name" not in await resp.json()


async def test_check_identity_ties_the_socket_to_the_launched_tree(start_sim):
    sim = await start_sim(served_model_name="regen-r-gpu0-cc")
    port = sim.server.port
    ours = Expected(served_model_name="regen-r-gpu0-cc", token_is_ours=True, pid=os.getpid(), host="127.0.0.1",
                    port=port)
    other = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        async with aiohttp.ClientSession() as session:
            assert (await check_identity(session, sim.url, {}, ours)).verdict == Verdict.PROVEN
            wrong = Expected(**{**ours.__dict__, "served_model_name": "regen-r-gpu0-dd"})
            assert (await check_identity(session, sim.url, {}, wrong)).verdict == Verdict.OWN_MISMATCH
            # launched as `other`: the simulator in this test process is someone else's server
            elsewhere = Expected(**{**wrong.__dict__, "pid": other.pid})
            check = await check_identity(session, sim.url, {}, elsewhere)
            assert check.verdict == Verdict.FOREIGN and f"pid {os.getpid()} (" in check.reason
    finally:
        other.kill()
        other.wait()


async def test_no_answer_at_all_is_unreachable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with aiohttp.ClientSession() as session:
        started = time.monotonic()
        names = await read_served_names(session, f"http://127.0.0.1:{port}", {}, timeout_s=2)
    assert not names.reachable and "ClientConnectorError" in names.error and time.monotonic() - started < 10


def test_the_bind_failure_is_the_worker_ports_own(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("[t] ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): "
                   "address already in use\n")
    assert bind_failure(log, 0, 30000).startswith("[t] ERROR:    [Errno 98]")
    assert bind_failure(log, 0, 3000) is None  # another port's line (a distributed-init port) is not ours
    assert bind_failure(log, log.stat().st_size, 30000) is None  # an earlier launch's line
