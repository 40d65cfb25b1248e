"""A real Slurm cluster for tests: munged, slurmctld and one slurmd per node, all under a temporary dir.

`start_slurm(root, nodes=1)` / `SlurmCluster.close()` are plain functions (a benchmark can use
them). The `slurm` fixture (and test_slurm_run's `cluster2`) lend a test the session's cluster of that
many nodes (`shared_slurm`), reset after it (`SlurmCluster.reset`): starting and stopping one per test
cost ~3-5 s each. A test that breaks a cluster for good (a killed slurmd) starts its own. One node runs on loopback; several nodes are
network namespaces on a bridge (host side 10.<78+10w+k>.<p>.1, node i at .(i+1); w the xdist worker, k the
cluster's number in this process, p from the pid: no two clusters side by side share a subnet), each slurmd
entered with `nsenter --net` (`ip netns exec` remounts /sys and Slurm 22.05's cgroup code then
fails) under `unshare --uts --mount` with its own hostname and a hosts file bind-mounted over
/etc/hosts, so names resolve per node and nothing in the real /etc changes. Without network
namespaces the nodes are several slurmd on 127.0.0.1, one port each.

GPUs are character devices (`mknod ... c 1 3`, /dev/null's numbers): Slurm 22.05 drops a GPU
without a device file. Client commands find the cluster through `SLURM_CONF` (`cluster.env`).
What these settings are and why: ../shared/reference/slurm_in_tests.md.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from tests.netns_hosts import netns_available
from tests.sshd_fixtures import free_port
from tests.waiting import poll_until
from tests.xdist_worker import worker_index

__all__ = ["SlurmCluster", "SlurmNode", "lent_cluster", "shared_slurm", "slurm", "slurm_missing", "start_slurm",
           "require_slurm"]

_DAEMONS = ("munged", "slurmctld", "slurmd")
_CLIENTS = ("sinfo", "sbatch", "srun", "squeue", "scancel", "scontrol")
_IDLE_TIMEOUT_S = 30.0
_RESET_TIMEOUT_S = 30.0
_started = 0  # clusters this process started: several netns clusters (a shared one and a test's own) coexist
PARTITION = "gpu"
URGENT = "urgent"  # same nodes, a higher tier: its jobs preempt those in PARTITION


def slurm_missing() -> str | None:
    """None if Slurm's daemons and client commands are installed here, else what is missing."""
    missing = [c for c in _DAEMONS + _CLIENTS if shutil.which(c) is None and not os.access(f"/usr/sbin/{c}", os.X_OK)]
    return ", ".join(missing) if missing else None


def _which(cmd: str) -> str:
    return shutil.which(cmd) or f"/usr/sbin/{cmd}"


def require_slurm() -> None:
    """Skip (or, with REGEN_REQUIRE_SSHD=1 as in CI, fail) where Slurm is not installed."""
    missing = slurm_missing()
    if missing is None:
        return
    msg = f"Slurm is not installed (missing: {missing})"
    if os.environ.get("REGEN_REQUIRE_SSHD") == "1":
        pytest.fail(msg + "; REGEN_REQUIRE_SSHD=1 requires it (apt-get install slurm-wlm munge)")
    pytest.skip(msg)


@dataclass
class SlurmNode:
    name: str
    address: str
    gpu_dir: Path
    netns: str | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    def nsenter(self) -> list[str]:
        """The prefix that runs a command inside this node's network namespace ([] on loopback)."""
        return ["nsenter", f"--net=/run/netns/{self.netns}"] if self.netns else []


@dataclass
class SlurmCluster:
    root: Path
    conf: Path
    nodes: list[SlurmNode]
    gpus_per_node: int
    mode: str  # "netns" | "loopback"
    controller_address: str
    partition: str = PARTITION
    max_time: str = "INFINITE"
    bridge: str | None = None
    processes: list[subprocess.Popen] = field(default_factory=list, repr=False)

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client command (sinfo, squeue, scontrol ...) against this cluster."""
        # in the cluster's dir: a job's default output (slurm-<id>.out) lands there, not in the checkout
        r = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=timeout, cwd=self.root)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.strip()}")
        return r

    def node_states(self) -> dict[str, str]:
        r = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)

    def kill_slurmd(self, name: str) -> None:
        """SIGKILL the node's slurmd (its job steps run on, as on a node that stopped answering): past SlurmdTimeout
        the controller sets the node down and its jobs end NODE_FAIL (or are requeued)."""
        node = next(n for n in self.nodes if n.name == name)
        node.process.kill()  # nsenter, unshare and sh exec each other: the pid is slurmd's
        node.process.wait(timeout=10)

    def log_text(self) -> str:
        parts = []
        for log in sorted(self.root.glob("log/*.log")):
            parts.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(parts)

    def wait_idle(self, timeout: float = _IDLE_TIMEOUT_S) -> None:
        names = {n.name for n in self.nodes}
        for proc in self.processes:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited {proc.returncode} while starting; logs:\n{self.log_text()}")
        if not poll_until(lambda: set(self.node_states().items()) >= {(n, "idle") for n in names}, timeout,
                          interval=0.2):
            raise RuntimeError(f"Slurm nodes not idle within {timeout:g} s: {self.node_states()}; "
                               f"logs:\n{self.log_text()}")

    def jobs(self) -> list[str]:
        """The ids of every job in the queue (pending, running, completing)."""
        return self.run("squeue", "-h", "-o", "%i", timeout=10).stdout.split()

    def reservations(self) -> list[str]:
        """The names of the cluster's reservations (a test's idle window ends at one)."""
        out = self.run("scontrol", "show", "reservation", "-o", timeout=10).stdout
        return re.findall(r"ReservationName=(\S+)", out)

    def alive(self) -> bool:
        return bool(self.processes) and all(p.poll() is None for p in self.processes)

    def reset(self) -> str | None:
        """Back to how start_slurm left it, after a test that shared it: that test's jobs cancelled (every job in
        the queue: tests run one at a time), what they left running killed, the partitions' settings and every
        node idle again. None once done, else why not (the caller then closes the cluster and starts another)."""
        if not self.alive():
            return "a daemon exited: " + ", ".join(f"{p.args[0]} ({p.returncode})" for p in self.processes
                                                    if p.poll() is not None)
        try:
            if self.jobs():
                self.run("scancel", "--full", "-u", "root", check=False, timeout=10)
            if not poll_until(lambda: not self.jobs(), _RESET_TIMEOUT_S, interval=0.1):
                return f"jobs still queued {_RESET_TIMEOUT_S:g} s after scancel: {self.jobs()}"
            daemons = {p.pid for p in self.processes}
            for p in _orphans(self.root, self.conf):  # a job's processes that outlived it (not Slurm's own)
                if p.pid not in daemons and p.name() not in _DAEMONS + ("slurmstepd",):
                    try:
                        p.kill()
                    except psutil.NoSuchProcess:
                        continue
            for part in (PARTITION, URGENT):  # (a test may set PreemptMode=CANCEL on a partition)
                self.run("scontrol", "update", f"PartitionName={part}", f"MaxTime={self.max_time}", "State=UP",
                         "PreemptMode=REQUEUE")
            for name in self.reservations():
                self.run("scontrol", "delete", f"reservation={name}")
            for name, state in self.node_states().items():
                if state != "idle":  # down or drained by the test (state=resume), or still completing
                    self.run("scontrol", "update", f"nodename={name}", "state=resume", check=False)
            self.wait_idle(_RESET_TIMEOUT_S)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            return str(exc)
        return None

    def close(self) -> None:
        """Stop every job, the daemons (together: each takes ~2 s on SIGTERM), and what jobs left behind."""
        self.run("scancel", "--full", "-u", "root", check=False, timeout=10) if self.processes else None
        tree: list[psutil.Process] = []
        for proc in self.processes:
            try:
                tree += psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                continue
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 3  # a slurmd with job steps left may take ~10 s: they are killed below
        for proc in self.processes:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        # job steps a slurmd started (slurmstepd and below) outlive a stopped slurmd
        # twice: a slurmstepd still reporting to the stopped controller can appear after the first look
        for sweep in (tree + _orphans(self.root, self.conf), None):
            if sweep is None:  # a step daemon forking away from slurmd shows up within half a second, or never
                sweep = poll_until(lambda: _orphans(self.root, self.conf), 0.5)
            for p in sweep:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    continue
        self.processes.clear()
        for node in self.nodes:
            if node.netns:
                for pid in _ip("netns", "pids", node.netns).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        continue  # exited meanwhile
                _ip("netns", "del", node.netns)
        if self.bridge:
            _ip("link", "del", self.bridge)


def _orphans(root: Path, conf: Path) -> list[psutil.Process]:
    """What this cluster left running: slurmstepd daemonizes away from slurmd, so it is found by its environment
    (SLURM_CONF of this cluster) or by a command line naming the cluster's dir (job scripts)."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if p.pid in mine:
            continue
        try:
            if any(str(root) in part for part in (p.info["cmdline"] or [])) or \
                    p.environ().get("SLURM_CONF") == str(conf) or \
                    (p.name() == "slurmstepd" and any(str(root) in f.path for f in p.open_files())):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def _ip_checked(*args: str) -> None:
    r = _ip(*args)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def reap_stale_clusters() -> None:
    """Namespaces and bridges (rs<pid>...) of a test session killed before its clean-up."""
    for name in _ip("netns", "list").stdout.split():
        m = re.fullmatch(r"rs(\d+)(?:c\d+)?n\d+", name)
        if m and not psutil.pid_exists(int(m.group(1))):
            for pid in _ip("netns", "pids", name).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    continue
            _ip("netns", "del", name)
    for line in _ip("-o", "link", "show", "type", "bridge").stdout.splitlines():
        m = re.search(r": (rs(\d+)(?:c\d+)?br)[:@]", line)
        if m and not psutil.pid_exists(int(m.group(2))):
            _ip("link", "del", m.group(1))


def _start_munge(root: Path) -> tuple[subprocess.Popen, Path]:
    mdir = root / "munge"
    mdir.mkdir(mode=0o700)
    key = mdir / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    socket_path = mdir / "munge.socket"
    proc = subprocess.Popen(
        [_which("munged"), "--foreground", "--force", f"--key-file={key}", f"--socket={socket_path}",
         f"--pid-file={mdir / 'munged.pid'}", f"--log-file={root / 'log' / 'munged.log'}",
         f"--seed-file={mdir / 'seed'}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(root / "log" / "munged.err.log", "ab"))
    if not poll_until(lambda: socket_path.exists() or proc.poll() is not None, 10) or proc.poll() is not None:
        raise RuntimeError(f"munged did not start: {(root / 'log' / 'munged.err.log').read_text(errors='replace')}")
    return proc, socket_path


def _conf_text(root: Path, nodes: list[SlurmNode], gpus: int, controller: str, ctld_port: int,
               node_ports: dict[str, int], munge_socket: Path, cpus: int, max_time: str) -> str:
    lines = [
        "ClusterName=regentest",
        f"SlurmctldHost=localhost({controller})",
        f"SlurmctldPort={ctld_port}",
        f"AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket},cred_expire=10",
        "SlurmUser=root", "SlurmdUser=root", "MailProg=/bin/true",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool' / '%n'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "GresTypes=gpu",
        "SchedulerParameters=bf_interval=1", "SlurmdTimeout=10", "KillWait=5", "ReturnToService=1",
        "MinJobAge=30",
        # a job in the `urgent` partition (same nodes, higher tier) preempts one in `gpu`: requeued, as on a
        # cluster with preemptible partitions (the cancel mode is per partition, PreemptMode on `gpu`)
        "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
    ]
    for n in nodes:
        port = f" Port={node_ports[n.name]}" if n.name in node_ports else ""
        lines.append(f"NodeName={n.name} NodeAddr={n.address} CPUs={cpus} RealMemory=4000 Gres=gpu:{gpus}{port}")
    if not node_ports:
        lines.append(f"SlurmdPort={free_port()}")
    node_names = ",".join(n.name for n in nodes)
    lines.append(f"PartitionName={PARTITION} Nodes={node_names} Default=YES MaxTime={max_time} State=UP PriorityTier=1")
    lines.append(f"PartitionName={URGENT} Nodes={node_names} MaxTime={max_time} State=UP PriorityTier=10")
    return "\n".join(lines) + "\n"


def start_slurm(root: Path, nodes: int = 1, *, gpus_per_node: int = 4, cpus: int = 2,
                force_loopback: bool = False, max_time: str = "INFINITE") -> SlurmCluster:
    """A cluster of `nodes` idle nodes with `gpus_per_node` fake GPUs each; returns once sinfo says idle."""
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("log", "state", "spool", "gpus"):
        (root / sub).mkdir(exist_ok=True)
    why_not = "one node" if nodes == 1 else ("forced" if force_loopback else netns_available())
    mode = "netns" if why_not is None else "loopback"
    global _started
    pid, k = os.getpid(), _started % 10
    _started += 1
    tag = f"{pid}c{k}"  # interface names: at most 15 characters ("rs<pid>c<k>n<i>a")
    if mode == "netns":
        reap_stale_clusters()
        subnet = f"10.{78 + 10 * (worker_index() % 12) + k}.{pid % 250}"
        controller = f"{subnet}.1"
        node_list = [SlurmNode(name=f"n{i}", address=f"{subnet}.{i + 1}", gpu_dir=root / "gpus" / f"n{i}",
                               netns=f"rs{tag}n{i}") for i in range(1, nodes + 1)]
    else:
        controller = "127.0.0.1"
        node_list = [SlurmNode(name=f"n{i}", address="127.0.0.1", gpu_dir=root / "gpus" / f"n{i}")
                     for i in range(1, nodes + 1)]
    cluster = SlurmCluster(root=root, conf=root / "slurm.conf", nodes=node_list, gpus_per_node=gpus_per_node,
                           mode=mode, controller_address=controller, max_time=max_time,
                           bridge=f"rs{tag}br" if mode == "netns" else None)
    try:
        gres = ["AutoDetect=off"]
        for n in node_list:
            n.gpu_dir.mkdir(parents=True, exist_ok=True)
            for g in range(gpus_per_node):
                dev = n.gpu_dir / f"gpu{g}"
                if not dev.exists():
                    os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # S_IFCHR: /dev/null's numbers
            gres.append(f"NodeName={n.name} Name=gpu File={n.gpu_dir}/gpu[0-{gpus_per_node - 1}]")
        (root / "gres.conf").write_text("\n".join(gres) + "\n")
        if mode == "netns":
            _make_network(cluster)
        munge, socket_path = _start_munge(root)
        cluster.processes.append(munge)
        node_ports = {n.name: free_port() for n in node_list} if mode == "loopback" and nodes > 1 else {}
        cluster.conf.write_text(_conf_text(root, node_list, gpus_per_node, controller, free_port(), node_ports,
                                           socket_path, cpus, max_time))
        env = cluster.env

        def daemon(argv: list[str], log_name: str) -> subprocess.Popen:
            out = open(root / "log" / log_name, "ab")
            try:
                cluster.processes.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                                          stderr=subprocess.STDOUT, env=env))
            finally:
                out.close()
            return cluster.processes[-1]

        daemon([_which("slurmctld"), "-D", "-i", "-f", str(cluster.conf)], "slurmctld.out.log")
        for n in node_list:
            argv = [_which("slurmd"), "-D", "-N", n.name, "-f", str(cluster.conf)]
            if n.netns:
                hosts = root / f"hosts-{n.name}"
                hosts.write_text("127.0.0.1 localhost\n" + f"{controller} regen-login\n"
                                 + "".join(f"{m.address} {m.name}\n" for m in node_list))
                inner = (f"hostname {n.name} && mount --bind {hosts} /etc/hosts && exec "
                         + " ".join(argv))
                argv = n.nsenter() + ["unshare", "--uts", "--mount", "sh", "-c", inner]
            n.process = daemon(argv, f"slurmd-{n.name}.out.log")
        cluster.wait_idle()
    except BaseException:
        cluster.close()
        raise
    return cluster


def _make_network(cluster: SlurmCluster) -> None:
    br = cluster.bridge
    _ip_checked("link", "add", br, "type", "bridge")
    _ip_checked("addr", "add", f"{cluster.controller_address}/24", "dev", br)
    _ip_checked("link", "set", br, "up")
    for n in cluster.nodes:
        host_end, node_end = f"{n.netns}a", f"{n.netns}b"
        _ip_checked("netns", "add", n.netns)
        _ip_checked("link", "add", host_end, "type", "veth", "peer", "name", node_end)
        _ip_checked("link", "set", host_end, "master", br)
        _ip_checked("link", "set", host_end, "up")
        _ip_checked("link", "set", node_end, "netns", n.netns)
        _ip_checked("netns", "exec", n.netns, "ip", "addr", "add", f"{n.address}/24", "dev", node_end)
        _ip_checked("netns", "exec", n.netns, "ip", "link", "set", node_end, "up")
        _ip_checked("netns", "exec", n.netns, "ip", "link", "set", "lo", "up")
        _ip_checked("netns", "exec", n.netns, "ip", "route", "add", "default", "via", cluster.controller_address)


class SharedClusters:
    """One cluster per node count for the whole test session: each test gets it idle with an empty queue and
    hands it back reset (SlurmCluster.reset); one it could not reset is closed and the next test starts another.
    A test that breaks a cluster for good (kills a slurmd) starts its own with start_slurm instead."""

    def __init__(self, base: Path):
        self.base = base
        self.clusters: dict[int, SlurmCluster] = {}

    def lend(self, nodes: int) -> SlurmCluster:
        cluster = self.clusters.get(nodes)
        if cluster is None or not cluster.alive():
            if cluster is not None:
                cluster.close()
            root = self.base / f"slurm{nodes}-{_started}"
            cluster = self.clusters[nodes] = start_slurm(root, nodes)
        return cluster

    def give_back(self, nodes: int) -> None:
        cluster = self.clusters[nodes]
        why = cluster.reset()
        if why is not None:
            del self.clusters[nodes]
            cluster.close()
            raise RuntimeError(f"the shared {nodes}-node Slurm cluster could not be reset after this test "
                               f"(closed; the next test starts another): {why}")

    def close(self) -> None:
        for cluster in self.clusters.values():
            cluster.close()
        self.clusters.clear()


@pytest.fixture(scope="session")
def shared_slurm(tmp_path_factory) -> SharedClusters:
    shared = SharedClusters(tmp_path_factory.mktemp("slurm-shared"))
    try:
        yield shared
    finally:
        shared.close()


@contextlib.contextmanager
def lent_cluster(shared: SharedClusters, nodes: int, monkeypatch) -> Iterator[SlurmCluster]:
    """The shared cluster of `nodes` nodes for one test, SLURM_CONF pointing at it; reset when the test is done."""
    require_slurm()
    cluster = shared.lend(nodes)
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    try:
        yield cluster
    finally:
        shared.give_back(nodes)


@pytest.fixture
def slurm(shared_slurm, monkeypatch) -> SlurmCluster:
    """One idle node with 4 fake GPUs (the session's, reset after each test); SLURM_CONF points at it for the
    test and its subprocesses."""
    with lent_cluster(shared_slurm, 1, monkeypatch) as cluster:
        yield cluster


@contextlib.contextmanager
def own_cluster(tmp_path: Path, monkeypatch, nodes: int) -> Iterator[SlurmCluster]:
    """A cluster of the test's own (`nodes` nodes), for a test that breaks one for good (a killed slurmd)."""
    require_slurm()
    cluster = start_slurm(tmp_path / "slurm", nodes)
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    try:
        yield cluster
    finally:
        cluster.close()
