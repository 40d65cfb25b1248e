"""SSH servers for tests: a real OpenSSH sshd on loopback, and an in-process asyncssh server.

`start_sshd(workdir)` / `stop_sshd(server)` are plain functions (the benchmark uses them);
the `sshd` fixture wraps them for a test session. Both servers come with a client ssh_config
(an alias) and a known_hosts file holding the server's real host key, so a transport connects
with the host key verified, as it would in production.
"""
from __future__ import annotations

import asyncio
import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import asyncssh
import psutil
import pytest

from tests.waiting import poll_until

__all__ = [
    "SshdServer", "AsyncSshServer", "sshd", "asyncssh_server", "start_sshd", "stop_sshd", "find_sshd",
    "kill_sshd_connection", "start_asyncssh_server", "stop_asyncssh_server", "write_keypair",
    "known_hosts_line", "write_client_config", "free_port",
]

SSHD_ALIAS = "regen-test-sshd"
ASYNCSSH_ALIAS = "regen-test-asyncssh"
_SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")
_START_TIMEOUT_S = 15.0


@dataclass
class SshdServer:
    host: str
    port: int
    user: str
    alias: str
    ssh_config_path: Path
    known_hosts_path: Path
    client_key_path: Path
    host_key_pub: str  # "ssh-ed25519 AAAA..." (the server's public host key line, no host pattern)
    pid: int = 0
    log_path: Path | None = None
    workdir: Path | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no sshd log)"
        return self.log_path.read_text(errors="replace")


def find_sshd() -> str | None:
    found = shutil.which("sshd")
    if found:
        return found
    for cand in _SSHD_CANDIDATES:
        if os.access(cand, os.X_OK):
            return cand
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_base(n: int) -> int:
    """A base port with `n` free ports from it (workers.base_port for n GPUs): one free port is not enough."""
    for _ in range(50):
        base = free_port()
        if base + n < 65000 and all(_port_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no free port range on 127.0.0.1")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def write_keypair(path: Path, comment: str) -> str:
    """An ed25519 private key at `path` (0600) and `path`.pub; returns the public key line."""
    key = asyncssh.generate_private_key("ssh-ed25519", comment=comment)
    key.write_private_key(str(path))
    os.chmod(path, 0o600)
    pub = key.export_public_key("openssh").decode().strip()
    path.with_name(path.name + ".pub").write_text(pub + "\n")
    return pub


def known_hosts_line(host: str, port: int, host_key_pub: str) -> str:
    keytype, blob = host_key_pub.split()[:2]
    pattern = host if port == 22 else f"[{host}]:{port}"
    return f"{pattern} {keytype} {blob}\n"


def write_client_config(path: Path, *, alias: str, port: int, user: str, key: Path, known_hosts: Path,
                        host: str = "127.0.0.1", extra_hosts: dict[str, int] | None = None) -> None:
    blocks = {alias: port, **(extra_hosts or {})}
    text = ""
    for name, p in blocks.items():
        text += (
            f"Host {name}\n"
            f"  HostName {host}\n"
            f"  Port {p}\n"
            f"  User {user}\n"
            f"  IdentityFile {key}\n"
            f"  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {known_hosts}\n"
            f"  StrictHostKeyChecking yes\n"
            f"  BatchMode yes\n\n"
        )
    path.write_text(text)


def _wait_for_port(port: int, proc: subprocess.Popen | None, log: Path | None, timeout: float,
                   host: str = "127.0.0.1") -> None:
    last_error: list[OSError] = []

    def accepts() -> bool:
        if proc is not None and proc.poll() is not None:
            log_text = log.read_text(errors="replace") if log and log.exists() else "(no log)"
            raise RuntimeError(f"sshd exited with status {proc.returncode} before listening; its log:\n{log_text}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError as exc:
            last_error[:] = [exc]
            return False

    if not poll_until(accepts, timeout):
        raise RuntimeError(f"sshd did not accept connections on {host}:{port} within {timeout:g} s: "
                           f"{last_error[0] if last_error else None}")


def start_sshd(workdir: Path, *, alias: str = SSHD_ALIAS, sshd_path: str | None = None, listen: str = "127.0.0.1",
               port: int | None = None, netns: str | None = None) -> SshdServer:
    """Start OpenSSH sshd on a free loopback port with throwaway keys; returns when it accepts.

    `listen`/`port`/`netns` put it elsewhere: an address inside a network namespace (ip netns exec).
    Keys already in `workdir` are reused, so a restarted server keeps its host key."""
    sshd_path = sshd_path or find_sshd()
    if sshd_path is None:
        raise FileNotFoundError("sshd not found on PATH or in " + ", ".join(_SSHD_CANDIDATES))
    workdir.mkdir(parents=True, exist_ok=True)
    os.chmod(workdir, 0o700)
    user = getpass.getuser()
    port = port or free_port()
    host_key = workdir / "ssh_host_ed25519_key"
    client_key = workdir / "id_ed25519"
    if host_key.exists() and client_key.exists():
        host_key_pub = host_key.with_name(host_key.name + ".pub").read_text().strip()
        client_pub = client_key.with_name(client_key.name + ".pub").read_text().strip()
    else:
        host_key_pub = write_keypair(host_key, "regen-test-host")
        client_pub = write_keypair(client_key, "regen-test-client")
    authorized = workdir / "authorized_keys"
    authorized.write_text(client_pub + "\n")
    os.chmod(authorized, 0o600)
    if os.geteuid() == 0:
        # sshd refuses to start without its privilege separation directory (made by the package's service)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    cfg = workdir / "sshd_config"
    log = workdir / "sshd.log"
    cfg.write_text(
        f"ListenAddress {listen}\n"
        f"Port {port}\n"
        f"PidFile {workdir / 'sshd.pid'}\n"
        f"HostKey {host_key}\n"
        f"AuthorizedKeysFile {authorized}\n"
        f"StrictModes no\n"
        f"UsePAM no\n"
        f"PasswordAuthentication no\n"
        f"KbdInteractiveAuthentication no\n"
        f"PubkeyAuthentication yes\n"
        f"PermitRootLogin prohibit-password\n"
        f"UseDNS no\n"
        f"Subsystem sftp internal-sftp\n"
        f"LogLevel VERBOSE\n"
    )
    known_hosts = workdir / "known_hosts"
    known_hosts.write_text(known_hosts_line(listen, port, host_key_pub))
    ssh_config = workdir / "ssh_config"
    write_client_config(ssh_config, alias=alias, port=port, user=user, key=client_key, known_hosts=known_hosts,
                        host=listen)
    log_f = open(log, "ab")
    prefix = ["ip", "netns", "exec", netns] if netns else []
    try:
        proc = subprocess.Popen(prefix + [sshd_path, "-D", "-e", "-f", str(cfg)], stdin=subprocess.DEVNULL,
                                stdout=log_f, stderr=subprocess.STDOUT)
    finally:
        log_f.close()
    server = SshdServer(
        host=listen, port=port, user=user, alias=alias, ssh_config_path=ssh_config,
        known_hosts_path=known_hosts, client_key_path=client_key, host_key_pub=host_key_pub,
        pid=proc.pid, log_path=log, workdir=workdir, process=proc,
    )
    try:
        _wait_for_port(port, proc, log, _START_TIMEOUT_S, host=listen)
    except RuntimeError:
        stop_sshd(server)
        raise
    return server


def stop_sshd(server: SshdServer) -> None:
    """Terminate sshd and the per-connection children it still has."""
    proc = server.process
    if proc is None:
        return
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            continue  # already exited with its parent
    server.process = None


def kill_sshd_connection(server: SshdServer, client_port: int) -> list[int]:
    """SIGKILL the sshd processes serving the client connection from local port `client_port`.

    The connection drops as a network cut would (no SSH disconnect message). Returns the pids killed.
    """
    master = psutil.Process(server.pid)
    victims: list[psutil.Process] = []
    for child in master.children(recursive=True):
        try:
            conns = child.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(c.raddr and c.raddr.port == client_port and c.laddr.port == server.port for c in conns):
            victims.append(child)
    if not victims:
        raise LookupError(f"no sshd child of pid {server.pid} serves a connection from port {client_port}")
    for v in list(victims):
        victims.extend(v.children(recursive=True))
    killed = []
    for v in victims:
        try:
            v.kill()
            killed.append(v.pid)
        except psutil.NoSuchProcess:
            continue  # exited as its parent died
    return killed


@pytest.fixture(scope="session")
def sshd(tmp_path_factory) -> SshdServer:
    path = find_sshd()
    if path is None:
        msg = "OpenSSH sshd is not installed (looked on PATH and in " + ", ".join(_SSHD_CANDIDATES) + ")"
        if os.environ.get("REGEN_REQUIRE_SSHD") == "1":
            pytest.fail(msg + "; REGEN_REQUIRE_SSHD=1 requires it (apt-get install openssh-server)")
        pytest.skip(msg)
    server = start_sshd(tmp_path_factory.mktemp("sshd"), sshd_path=path)
    try:
        yield server
    finally:
        stop_sshd(server)


# --- in-process asyncssh server, for scripted faults -------------------------------------


@dataclass
class AsyncSshServer:
    """An asyncssh server on loopback that runs commands with the local /bin/sh.

    Faults, set by the test before it connects:
      drop_after_bytes: once this many stdout bytes have been sent on a connection, the
        connection is aborted (TCP closed, no SSH disconnect), like a network cut.
    `silent_alias` / `silent_port`: a listener that accepts TCP and never says a word
    (no SSH banner), for connect timeouts.
    """

    host: str
    port: int
    user: str
    alias: str
    ssh_config_path: Path
    known_hosts_path: Path
    client_key_path: Path
    host_key_pub: str
    silent_port: int
    silent_alias: str
    drop_after_bytes: int | None = None
    connections: list = field(default_factory=list, repr=False)
    handlers: set = field(default_factory=set, repr=False)


class _FaultServer(asyncssh.SSHServer):
    def __init__(self, state: AsyncSshServer):
        self.state = state

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.state.connections.append(conn)
        conn.set_extra_info(sent_bytes=0)

    def begin_auth(self, username: str) -> bool:
        return True


async def _discard(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        continue


def _kill_group(pid: int) -> bool:
    """SIGKILL a process group; False if it had already exited entirely."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


async def _reap(proc: asyncio.subprocess.Process, worker: asyncio.Future) -> None:
    if proc.returncode is None:  # the client went away (or we were cancelled): end the command
        _kill_group(proc.pid)
    if not worker.done():
        worker.cancel()
    await asyncio.wait({worker}, timeout=2)
    # read the pipes to EOF while waiting: asyncio's wait() returns only once they are closed
    drains = [asyncio.ensure_future(_discard(s)) for s in (proc.stdout, proc.stderr)]
    await asyncio.wait([*drains, asyncio.ensure_future(proc.wait())], timeout=5)


async def _run_command(state: AsyncSshServer, process: asyncssh.SSHServerProcess) -> None:
    conn = process.channel.get_connection()
    proc = await asyncio.create_subprocess_exec(
        "/bin/sh", "-c", process.command or "",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # like sshd: the command leads its own session and process group
    )

    async def pump_in() -> None:
        try:
            async for chunk in process.stdin:
                proc.stdin.write(chunk)
                await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError, asyncssh.Error):
            return  # the command closed stdin, or the client went away: nothing more to feed
        finally:
            proc.stdin.close()

    async def pump_out(src: asyncio.StreamReader, dst, count: bool) -> None:
        try:
            await copy(src, dst, count)
        except (BrokenPipeError, ConnectionResetError, asyncssh.Error):
            return  # the client went away; the command is killed below

    async def copy(src: asyncio.StreamReader, dst, count: bool) -> None:
        while chunk := await src.read(4096):
            if count and state.drop_after_bytes is not None:
                sent = conn.get_extra_info("sent_bytes") + len(chunk)
                conn.set_extra_info(sent_bytes=sent)
                if sent >= state.drop_after_bytes:
                    dst.write(chunk[: max(0, len(chunk) - (sent - state.drop_after_bytes))])
                    await asyncio.sleep(0.05)  # kept: the simulated drop lets the partial chunk out first
                    conn.abort()
                    return
            dst.write(chunk)

    async def work() -> int:
        await asyncio.gather(pump_out(proc.stdout, process.stdout, True),
                             pump_out(proc.stderr, process.stderr, False))
        return await proc.wait()

    feeder = asyncio.ensure_future(pump_in())
    worker = asyncio.ensure_future(work())
    closed = asyncio.ensure_future(process.channel.wait_closed())
    try:
        await asyncio.wait({worker, closed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        feeder.cancel()
        closed.cancel()
        # asyncssh cancels handlers when a connection drops: reap in a task of its own that a
        # second cancellation cannot interrupt, and that stop_asyncssh_server waits for
        reaper = asyncio.ensure_future(_reap(proc, worker))
        state.handlers.add(reaper)
        reaper.add_done_callback(state.handlers.discard)
        await asyncio.shield(reaper)
    rc = proc.returncode
    if process.channel.is_closing():
        return
    if rc < 0:
        process.exit_with_signal(signal.Signals(-rc).name.removeprefix("SIG"))
    else:
        process.exit(rc)


async def start_asyncssh_server(workdir: Path, *, alias: str = ASYNCSSH_ALIAS) -> tuple[AsyncSshServer, list]:
    """Start the in-process server; returns it and the listeners to close."""
    workdir.mkdir(parents=True, exist_ok=True)
    host_key = workdir / "host_key"
    client_key = workdir / "client_key"
    host_key_pub = write_keypair(host_key, "regen-asyncssh-host")
    client_pub = write_keypair(client_key, "regen-asyncssh-client")
    state_box: list[AsyncSshServer] = []

    async def handle(process: asyncssh.SSHServerProcess) -> None:
        task = asyncio.current_task()
        state_box[0].handlers.add(task)
        try:
            await _run_command(state_box[0], process)
        finally:
            state_box[0].handlers.discard(task)

    listener = await asyncssh.create_server(
        lambda: _FaultServer(state_box[0]), "127.0.0.1", 0,
        server_host_keys=[str(host_key)],
        authorized_client_keys=asyncssh.import_authorized_keys(client_pub + "\n"),
        process_factory=handle, encoding=None, sftp_factory=True, allow_scp=False,
    )
    port = listener.sockets[0].getsockname()[1]
    silent_writers: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        silent_writers.append(writer)  # hold the socket open and never answer

    silent_server = await asyncio.start_server(silent, "127.0.0.1", 0)
    silent_port = silent_server.sockets[0].getsockname()[1]
    known_hosts = workdir / "known_hosts"
    known_hosts.write_text(known_hosts_line("127.0.0.1", port, host_key_pub)
                           + known_hosts_line("127.0.0.1", silent_port, host_key_pub))
    ssh_config = workdir / "ssh_config"
    user = getpass.getuser()
    write_client_config(ssh_config, alias=alias, port=port, user=user, key=client_key, known_hosts=known_hosts,
                        extra_hosts={f"{alias}-silent": silent_port})
    state = AsyncSshServer(
        host="127.0.0.1", port=port, user=user, alias=alias, ssh_config_path=ssh_config,
        known_hosts_path=known_hosts, client_key_path=client_key, host_key_pub=host_key_pub,
        silent_port=silent_port, silent_alias=f"{alias}-silent",
    )
    state_box.append(state)

    def close_silent() -> None:
        for w in silent_writers:
            w.close()
        silent_server.close()

    return state, [listener, close_silent]


async def stop_asyncssh_server(state: AsyncSshServer, closers: list) -> None:
    for conn in state.connections:
        conn.abort()
    listener, close_silent = closers
    close_silent()
    listener.close()
    await listener.wait_closed()
    # commands still running see their channel gone; their handlers kill and reap them (a handler
    # that ends adds its reaper to the set, so look again until nothing is left)
    deadline = time.monotonic() + 10
    while state.handlers and time.monotonic() < deadline:
        await asyncio.wait(list(state.handlers), timeout=max(0.1, deadline - time.monotonic()))
    for task in list(state.handlers):
        task.cancel()


@pytest.fixture
async def asyncssh_server(tmp_path) -> AsyncSshServer:
    state, closers = await start_asyncssh_server(tmp_path / "asyncssh-server")
    try:
        yield state
    finally:
        await stop_asyncssh_server(state, closers)
