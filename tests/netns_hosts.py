"""Several simulated GPU hosts for the multi-host tests, each with its own real OpenSSH sshd.

Where the machine allows it (root, `ip netns`), every host is a network namespace joined to the
root namespace by a veth pair (10.<231+w>.<4s+i>.1 <-> .2, w the xdist worker, s from the pid: sessions and
workers side by side never share a subnet): its own loopback, its own ports (every host's SGLang servers use the
same base port, as on real boxes), its sshd on port 22 of its .2 address. Cutting a host takes its veth link
down, as a pulled cable would; rejoining brings it back. Elsewhere the hosts are sshd servers on separate
loopback ports, with separate server ports per host; cutting one kills its sshd and its host agent's process group.

The filesystem is shared, so the engine copy, the tiny model and the work dirs are plain paths.
"""
from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.sshd_fixtures import SshdServer, start_sshd, stop_sshd
from tests.xdist_worker import worker_index

PORTS_PER_HOST = 8  # server ports of one host in loopback mode (base_port, base_port + 1, ...)
# where loopback hosts' server ports are looked for: under the dispatch host's forward ports (40000 up,
# engine.config.load.Hosts.forward_base_port) and under the kernel's ephemeral range (32768 up)
SERVER_PORTS = range(30000, 32768)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_available() -> str | None:
    """None if network namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root"
    probe = f"rgprobe{os.getpid() % 100000}"
    try:
        r = _ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "no `ip` command (iproute2)"
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class SimHost:
    name: str
    index: int
    workdir: Path  # its sshd's keys and config
    work_dir: Path  # [[hosts]].work_dir
    netns: str | None
    address: str  # the ssh alias
    base_port: int
    sshd: SshdServer | None = None
    veth_root: str | None = None
    listen: str = "127.0.0.1"
    ssh_port: int | None = None
    cut: bool = False

    def agent_pid(self) -> int | None:
        try:
            return int((self.work_dir / "agent.pid").read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def kill_agent(self) -> None:
        """SIGKILL the host agent's process group (its servers die with it: PDEATHSIG)."""
        pid = self.agent_pid()
        if pid:
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # already gone, or gone with its namespace


@dataclass
class SimHosts:
    hosts: list[SimHost]
    ssh_config: Path
    mode: str  # "netns" | "loopback"
    why_not_netns: str | None = None
    _root: Path = field(default=Path("."))

    def host(self, name: str) -> SimHost:
        return next(h for h in self.hosts if h.name == name)

    def write_ssh_config(self) -> None:
        text = ""
        for h in self.hosts:
            text += (Path(h.workdir) / "ssh_config").read_text()
        self.ssh_config.write_text(text)

    def cut(self, name: str) -> None:
        h = self.host(name)
        h.cut = True
        if self.mode == "netns":
            _ip("link", "set", h.veth_root, "down")
            return
        if h.sshd is not None:
            stop_sshd(h.sshd)
        h.kill_agent()

    def rejoin(self, name: str) -> None:
        h = self.host(name)
        h.cut = False
        if self.mode == "netns":
            _ip("link", "set", h.veth_root, "up")
            return
        h.sshd = start_sshd(h.workdir, alias=h.address, listen=h.listen, port=h.ssh_port)

    def close(self) -> None:
        for h in self.hosts:
            h.kill_agent()
            if h.sshd is not None:
                stop_sshd(h.sshd)
            if h.netns:
                # processes left in the namespace (servers) die with their agent's group above
                r = _ip("netns", "pids", h.netns, check=False)
                for pid_text in r.stdout.split():
                    try:
                        os.kill(int(pid_text), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass  # exited meanwhile
                _ip("netns", "del", h.netns, check=False)
            if h.veth_root:
                _ip("link", "del", h.veth_root, check=False)


def reap_stale_namespaces() -> list[str]:
    """Namespaces (and their veth ends) left by a test session that was killed before its clean-up:
    their addresses could clash with ours. Named rg<pid>h<i>; a live pid's are kept."""
    listed = _ip("netns", "list", check=False).stdout.split()
    reaped = []
    for name in listed:
        m = re.fullmatch(r"rg(\d+)(h\d+)", name)
        if not m or psutil.pid_exists(int(m.group(1))):
            continue
        for pid in _ip("netns", "pids", name, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _ip("netns", "del", name, check=False)
        _ip("link", "del", f"{name}a", check=False)
        reaped.append(name)
    return reaped


def free_server_ports(n: int) -> int:
    """The first of n consecutive ports free on 127.0.0.1, at a random place in SERVER_PORTS."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(SERVER_PORTS.start, SERVER_PORTS.stop - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue  # one of them is taken: another place
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1 in {SERVER_PORTS}")


def start_hosts(root: Path, count: int, *, force_loopback: bool = False) -> SimHosts:
    why = "forced" if force_loopback else netns_available()
    mode = "netns" if why is None else "loopback"
    if mode == "netns":
        reap_stale_namespaces()
    tag = os.getpid()  # whole pid: reap_stale_namespaces() tells a dead session's names by it
    if mode == "netns" and count > 3:
        raise ValueError(f"start_hosts: at most 3 namespace hosts (their subnets are 4 apart), not {count}")
    prefix, slot = f"10.{231 + worker_index() % 20}", (tag % 60) * 4
    hosts: list[SimHost] = []
    sim = SimHosts(hosts=hosts, ssh_config=root / "ssh_config", mode=mode, why_not_netns=why, _root=root)
    # loopback: every host's servers share this machine's ports; a free block, not a fixed range, so that two
    # sessions on one machine (or a leftover server) do not take each other's ports (the agent refuses a busy one)
    block = free_server_ports(PORTS_PER_HOST * count) if mode == "loopback" else 0
    try:
        for i in range(1, count + 1):
            name = f"h{i}"
            workdir = root / f"{name}-sshd"
            work_dir = root / f"{name}-work"
            work_dir.mkdir(parents=True, exist_ok=True)
            base_port = 30000 if mode == "netns" else block + PORTS_PER_HOST * (i - 1)
            h = SimHost(name=name, index=i, workdir=workdir, work_dir=work_dir, netns=None,
                        address=f"regen-{name}", base_port=base_port)
            hosts.append(h)
            if mode == "netns":
                h.netns = f"rg{tag}{name}"
                h.veth_root = f"rg{tag}{name}a"
                peer = f"rg{tag}{name}b"
                _ip("netns", "add", h.netns)
                _ip("link", "add", h.veth_root, "type", "veth", "peer", "name", peer)
                _ip("link", "set", peer, "netns", h.netns)
                _ip("addr", "add", f"{prefix}.{slot + i}.1/24", "dev", h.veth_root)
                _ip("link", "set", h.veth_root, "up")
                _ip("netns", "exec", h.netns, "ip", "addr", "add", f"{prefix}.{slot + i}.2/24", "dev", peer)
                _ip("netns", "exec", h.netns, "ip", "link", "set", peer, "up")
                _ip("netns", "exec", h.netns, "ip", "link", "set", "lo", "up")
                h.listen, h.ssh_port = f"{prefix}.{slot + i}.2", 22
            h.sshd = start_sshd(workdir, alias=h.address, listen=h.listen, port=h.ssh_port, netns=h.netns)
            h.ssh_port = h.sshd.port
        sim.write_ssh_config()
    except BaseException:
        sim.close()
        raise
    return sim
