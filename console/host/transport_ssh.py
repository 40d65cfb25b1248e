"""Transport over one SSH connection (asyncssh): commands as channels, SFTP copies, known_hosts always verified
(--accept-new records an unknown key; a changed one is always refused), failures as TransportError by kind.
Commands run as `exec /bin/sh -c SCRIPT` whose pid is their process group: a timeout kills the whole group.
Over 500 lines: the connection, its host-key policy and the process-group kill share one asyncssh session's state."""
from __future__ import annotations

import asyncio
import logging
import os
import posixpath
import re
import shlex
import socket
import stat
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Sequence

# cryptography 46+ deprecates DSA, and asyncssh names the DSA classes at import time: without
# this filter every regen command that reaches a host starts with ten lines of warnings the
# operator can do nothing about (asyncssh still loads DSA keys where a host offers one).
warnings.filterwarnings("ignore", message="DSA is deprecated", module=r"asyncssh\.")
import asyncssh  # noqa: E402
from asyncssh.public_key import decode_ssh_public_key

from console.host.transport import Ended, HostSpec, TransportError
from probes.model import CommandResult, ConnectErrorKind

DEFAULT_MAX_CHANNELS = 8  # OpenSSH's MaxSessions is 10 by default; keep 2 for kills and SFTP
_PID_MARKER = re.compile(rb"\x1eregen-pid:(\d+)\n")
_WRAPPER = 'printf "\\036regen-pid:%s\\n" "$$" >&2; exec /bin/sh -c "$1"'
_KILL_TIMEOUT_S = 5.0
_DRAIN_AFTER_KILL_S = 2.0
_CHANNEL_OPEN_RETRY_S = 10.0
_PID_WAIT_S = 2.0

log = logging.getLogger(__name__)


def wrap_remote(command: str) -> str:
    """The command line sent to the host: reports the group's pid, then runs `command` in it."""
    return f"exec /bin/sh -c {shlex.quote(_WRAPPER)} regen {shlex.quote(command)}"


def default_ssh_config() -> str | None:
    env = os.environ.get("REGEN_SSH_CONFIG")
    if env:
        return env
    path = Path("~/.ssh/config").expanduser()
    return str(path) if path.is_file() else None


def describe_key(key: asyncssh.SSHKey) -> str:
    return f"{key.get_algorithm()} {key.get_fingerprint('sha256')}"


def known_hosts_pattern(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


def _oneline(text: str, limit: int = 2000) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


class _HostKeyCheck:
    """What the host key check saw; filled in by the client during key exchange."""

    def __init__(self, known_hosts: asyncssh.SSHKnownHosts, accept_new: bool):
        self.known_hosts = known_hosts
        self.accept_new = accept_new
        self.presented: asyncssh.SSHKey | None = None
        self.known: list[asyncssh.SSHKey] = []
        self.verdict: str | None = None  # None: matched known_hosts; "unknown"; "changed"; "accepted"
        self.host = ""
        self.port = 22


class _Client(asyncssh.SSHClient):
    def __init__(self, check: _HostKeyCheck):
        self.check = check
        self.lost: Exception | None = None
        self.lost_event = asyncio.Event()

    def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        # Called by asyncssh only when `key` is not among the known_hosts keys for this host.
        c = self.check
        c.presented, c.host, c.port = key, host, port
        keys, ca_keys, *_ = asyncssh.match_known_hosts(c.known_hosts, host, addr, port if port != 22 else None)
        c.known = list(keys) + list(ca_keys)
        if c.known:
            c.verdict = "changed"
            return False
        if c.accept_new:
            c.verdict = "accepted"
            return True  # asyncssh still checks the server proves it holds the private key
        c.verdict = "unknown"
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionError("connection closed by the host")
        self.lost_event.set()


def _load_known_hosts(paths: Sequence[str]) -> asyncssh.SSHKnownHosts:
    chunks = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.exists():
            continue  # like OpenSSH: a missing known_hosts file is an empty one
        try:
            chunks.append(path.read_text(encoding="utf-8", errors="replace"))
        except OSError as exc:
            raise TransportError(f"cannot read known_hosts file {path}: {exc}", kind=ConnectErrorKind.HOST_KEY) from exc
    try:
        return asyncssh.import_known_hosts("\n".join(chunks))
    except (ValueError, asyncssh.KeyImportError) as exc:
        raise TransportError(f"cannot parse known_hosts ({', '.join(paths)}): {exc}",
                             kind=ConnectErrorKind.HOST_KEY) from exc


def _append_known_host(path: Path, host: str, port: int, key: asyncssh.SSHKey) -> None:
    keytype, blob = key.export_public_key("openssh").decode().split()[:2]
    line = f"{known_hosts_pattern(host, port)} {keytype} {blob}\n"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        prefix = ""
        if path.exists() and path.stat().st_size > 0:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    prefix = "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(prefix + line)
    except OSError as exc:
        raise TransportError(
            f"accepted the new host key {describe_key(key)} for {known_hosts_pattern(host, port)} "
            f"but could not record it in {path}: {exc}",
            kind=ConnectErrorKind.HOST_KEY,
        ) from exc


async def connect_ssh(
    spec: HostSpec,
    *,
    accept_new: bool = False,
    connect_timeout: float = 10.0,
    known_hosts: str | os.PathLike | None = None,
    keepalive_s: float = 15.0,
    ssh_config: str | os.PathLike | None = None,
) -> "SshTransport":
    config_path = str(ssh_config) if ssh_config is not None else default_ssh_config()
    if config_path is not None and not Path(config_path).expanduser().is_file():
        raise TransportError(f"ssh config file {config_path} does not exist (or is not a file)",
                             kind=ConnectErrorKind.ERROR)
    name = spec.raw
    try:
        base = asyncssh.SSHClientConnectionOptions(
            config=[config_path] if config_path else None,
            host=spec.host,
            port=spec.port if spec.port is not None else (),
            username=spec.user if spec.user is not None else (),
        )
    except OSError as exc:  # e.g. an IdentityFile named in the config that does not exist
        raise TransportError(f"cannot prepare the SSH connection to {name}: {exc}", kind=ConnectErrorKind.AUTH) from exc
    except (asyncssh.Error, ValueError) as exc:
        raise TransportError(f"cannot prepare the SSH connection to {name}: {exc}",
                             kind=ConnectErrorKind.ERROR) from exc
    host, port, user = base.host, int(base.port or 22), base.username
    target = f"{user}@{host}:{port}"
    where = name if spec.host == host else f"{name} ({target})"  # show what an alias resolved to

    if known_hosts is not None:
        kh_paths = [str(known_hosts)]
    elif base.known_hosts:  # UserKnownHostsFile (+ GlobalKnownHostsFile) from the config
        if not isinstance(base.known_hosts, list):  # asyncssh reads the config's into a list of paths
            raise TypeError(f"asyncssh gave the config's known hosts as {type(base.known_hosts).__name__}, "
                            f"not a list of paths")
        kh_paths = [str(p) for p in base.known_hosts]
    else:
        kh_paths = [str(Path("~/.ssh/known_hosts").expanduser()), "/etc/ssh/ssh_known_hosts"]
    check = _HostKeyCheck(_load_known_hosts(kh_paths), accept_new)
    record_to = Path(kh_paths[0]).expanduser()
    client = _Client(check)

    try:
        conn = await asyncssh.connect(
            spec.host,
            port=spec.port if spec.port is not None else (),
            username=spec.user if spec.user is not None else (),
            config=[config_path] if config_path else None,
            client_factory=lambda: client,
            known_hosts=check.known_hosts,
            connect_timeout=connect_timeout,
            keepalive_interval=keepalive_s,
            keepalive_count_max=3,
        )
    except asyncssh.HostKeyNotVerifiable as exc:
        raise _host_key_error(check, where, record_to, exc) from exc
    except asyncssh.PermissionDenied as exc:
        if check.verdict == "accepted" and check.presented is not None:
            _append_known_host(record_to, check.host, check.port, check.presented)
        raise await _auth_error(base, config_path, where, host, port, user, exc) from exc
    except (asyncio.TimeoutError, TimeoutError) as exc:
        raise TransportError(
            f"timed out after {connect_timeout:g} s connecting to {where} (the TCP connection or the SSH "
            f"handshake did not complete; is the host up, and is {port} its SSH port?)",
            kind=ConnectErrorKind.TIMEOUT,
        ) from exc
    except socket.gaierror as exc:
        raise TransportError(f"cannot resolve host name {host!r} for {name}: {exc}",
                             kind=ConnectErrorKind.UNREACHABLE) from exc
    except OSError as exc:
        if isinstance(exc, ConnectionResetError) and (changed := await _key_type_changed(check, base, where, record_to)):
            raise changed from exc
        os_text = os.strerror(exc.errno) if exc.errno else ""
        if os_text and os_text not in str(exc):
            os_text = f"{os_text}: {exc}"
        else:
            os_text = str(exc)
        raise TransportError(f"cannot reach {where}: {os_text}", kind=ConnectErrorKind.UNREACHABLE) from exc
    except (asyncssh.ConnectionLost, asyncssh.DisconnectError) as exc:
        # includes KeyExchangeFailed; a host that only has keys of a type known_hosts does not list
        # hangs up during key exchange (asyncssh offers only the known key types)
        if changed := await _key_type_changed(check, base, where, record_to):
            raise changed from exc
        raise TransportError(f"{where} closed the connection during the SSH handshake: {exc}",
                             kind=ConnectErrorKind.CLOSED) from exc
    except asyncssh.Error as exc:
        raise TransportError(f"SSH connection to {where} failed: {exc}", kind=ConnectErrorKind.ERROR) from exc

    if check.verdict == "accepted" and check.presented is not None:
        try:
            _append_known_host(record_to, check.host, check.port, check.presented)
        except TransportError:
            conn.close()
            raise
    return SshTransport(conn, client, name=name, target=target)


async def _key_type_changed(check: _HostKeyCheck, options: asyncssh.SSHClientConnectionOptions, where: str,
                            record_to: Path) -> TransportError | None:
    """If known_hosts lists keys for this host and the host now presents a key that is none of
    them (e.g. of another type), the CHANGED error; else None."""
    host, port = options.host, int(options.port or 22)
    lookup = options.host_key_alias or host
    keys, ca_keys, *_ = asyncssh.match_known_hosts(check.known_hosts, lookup, host, port if port != 22 else None)
    if not keys and not ca_keys:
        return None
    try:
        presented = await asyncio.wait_for(asyncssh.get_server_host_key(host, port), 5.0)
    except (OSError, asyncssh.Error, asyncio.TimeoutError):
        return None  # the host is not answering at all: the caller's own error says so
    if presented is None or presented in keys:
        return None
    check.presented, check.known, check.verdict = presented, list(keys) + list(ca_keys), "changed"
    check.host, check.port = lookup, port
    return _host_key_error(check, where, record_to, ConnectionError("no host key type in common"))


def _host_key_error(check: _HostKeyCheck, where: str, record_to: Path, exc: Exception) -> TransportError:
    pattern = known_hosts_pattern(check.host, check.port) if check.host else where
    if check.verdict == "changed" and check.presented is not None:
        known = ", ".join(dict.fromkeys(describe_key(k) for k in check.known))  # host and addr may both match
        return TransportError(
            f"host key for {pattern} has CHANGED: the host presented {describe_key(check.presented)}, "
            f"known_hosts ({record_to}) has {known}. This can be a man-in-the-middle attack or a reinstalled "
            f"host; refusing to connect (--accept-new never overrides a changed key). If the change is "
            f"expected, remove the old entry: ssh-keygen -R {shlex.quote(pattern)} -f {shlex.quote(str(record_to))}",
            kind=ConnectErrorKind.HOST_KEY,
        )
    if check.verdict == "unknown" and check.presented is not None:
        return TransportError(
            f"host {pattern} is not in known_hosts ({record_to}); it presented {describe_key(check.presented)}. "
            f"Refusing to connect to an unknown host. If this fingerprint is right, run again with --accept-new "
            f"to record it, or add it with ssh-keyscan.",
            kind=ConnectErrorKind.HOST_KEY, unknown_host_key=True,
        )
    # e.g. a revoked key, or no host key algorithm in common with the known keys
    return TransportError(f"host key of {where} could not be verified against {record_to}: {exc}",
                          kind=ConnectErrorKind.HOST_KEY)


async def _auth_error(
    options: asyncssh.SSHClientConnectionOptions, config_path: str | None, where: str, host: str, port: int,
    user: str, exc: Exception,
) -> TransportError:
    keys = []
    for kp in options.client_keys or []:
        comment = kp.get_comment() or ""
        pub = decode_ssh_public_key(kp.public_data)
        keys.append(f"{describe_key(pub)}{' ' + comment if comment else ''}")
    tried = [f"publickey ({len(keys)} key{'s' if len(keys) != 1 else ''}: {'; '.join(keys) or 'none found'})"]
    if options.agent_path or os.environ.get("SSH_AUTH_SOCK"):
        tried.append("ssh-agent keys")
    try:
        offered = ", ".join(
            await asyncio.wait_for(asyncssh.get_server_auth_methods(
                host, port, user, config=[config_path] if config_path else None), 5.0)
        )
    except (OSError, asyncssh.Error, asyncio.TimeoutError) as probe_exc:
        offered = f"unknown ({probe_exc})"
    return TransportError(
        f"permission denied for {user} on {where}: {exc}. Tried: {', '.join(tried)}. "
        f"The server accepts: {offered or 'nothing'}. Check IdentityFile in the ssh config and the host's "
        f"authorized_keys.",
        kind=ConnectErrorKind.AUTH,
    )


@dataclass(frozen=True)
class KillOutcome:
    ok: bool  # killed, or had already exited: nothing of it runs on
    text: str


def kill_outcome(pid: int, exit_status: int | None, complaint: str) -> KillOutcome:
    """What `kill -s KILL -- -PID || kill -s KILL PID` did, from its exit status and stderr."""
    if exit_status == 0 and not complaint:
        return KillOutcome(True, f"killed remote process group {pid}")
    if exit_status == 0:
        return KillOutcome(False, f"killed remote process {pid} but not its group ({complaint}); its children may survive")
    if "no such process" in complaint.lower():
        return KillOutcome(True, f"remote process group {pid} had already exited")
    how = "no exit status" if exit_status is None else f"exit status {exit_status}"
    return KillOutcome(False, f"kill of remote process group {pid} failed ({how}; "
                              f"{f'stderr: {complaint}' if complaint else 'it printed nothing'})")


class SshTransport:
    """One SSH connection; implements console.host.transport.Transport."""

    def __init__(self, conn: asyncssh.SSHClientConnection, client: _Client, *, name: str, target: str,
                 max_channels: int = DEFAULT_MAX_CHANNELS):
        self.name = name
        self.target = target
        self._conn = conn
        self._client = client
        self._slots = asyncio.Semaphore(max_channels)
        self._streams: dict[_Session, str] = {}  # streaming commands not yet ended (killed on close)
        self._ending: set[asyncio.Future] = set()  # their kills under way

    @property
    def connection(self) -> asyncssh.SSHClientConnection:
        return self._conn

    @property
    def is_closed(self) -> bool:
        return self._client.lost is not None

    def _lost_text(self) -> str:
        return f"connection to {self.name} lost: {self._client.lost}"

    async def _open_process(self, command: str) -> asyncssh.SSHClientProcess:
        """A channel running `command`, retrying while the server is at its MaxSessions limit."""
        deadline = time.monotonic() + _CHANNEL_OPEN_RETRY_S
        delay = 0.05
        while True:
            if self.is_closed:
                raise TransportError(self._lost_text(), kind=ConnectErrorKind.CLOSED)
            try:
                return await self._conn.create_process(command, encoding=None)
            except asyncssh.ChannelOpenError as exc:
                if exc.code != asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED or time.monotonic() > deadline:
                    raise TransportError(f"cannot open a channel on {self.name}: {exc.reason}",
                                         kind=ConnectErrorKind.ERROR) from exc
            except (asyncssh.ConnectionLost, asyncssh.DisconnectError, BrokenPipeError, ConnectionError) as exc:
                raise TransportError(f"connection to {self.name} lost: {exc}", kind=ConnectErrorKind.CLOSED) from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def _kill_group(self, pid: int | None) -> KillOutcome:
        """Kill the remote process group; returns what happened, for the user's message."""
        if pid is None:
            return KillOutcome(False, "the remote pid was never reported, so nothing could be killed")
        if self.is_closed:
            return KillOutcome(False, f"could not kill remote process group {pid}: {self._lost_text()}")
        # `kill -s KILL -- -PID` is the spelling dash, bash, zsh and procps kill all accept
        cmd = f"kill -s KILL -- -{pid} || kill -s KILL {pid}"
        try:
            res = await self._conn.run(cmd, check=False, timeout=_KILL_TIMEOUT_S, encoding="utf-8", errors="replace")
        except (asyncssh.Error, OSError, asyncio.TimeoutError) as exc:
            return KillOutcome(False, f"could not kill remote process group {pid}: {exc}")
        return kill_outcome(pid, res.exit_status, _oneline(str(res.stderr or "")))

    async def run(self, command: str, *, timeout: float, stdin: bytes | None = None) -> CommandResult:
        started = time.monotonic()
        async with self._slots:
            try:
                proc = await self._open_process(wrap_remote(command))
            except TransportError as exc:
                return CommandResult(command, None, "", "", time.monotonic() - started, error=str(exc))
            session = _Session(proc)
            try:
                return await self._finish(command, session, timeout, stdin, started)
            finally:
                session.close()

    async def _finish(self, command: str, s: "_Session", timeout: float, stdin: bytes | None,
                      started: float) -> CommandResult:
        timed_out = False
        error: str | None = None

        async def feed_and_wait() -> None:
            if stdin:
                s.proc.stdin.write(stdin)
                await s.proc.stdin.drain()
            s.proc.stdin.write_eof()
            await asyncio.wait([s.out_task, s.err_task])  # wait, not gather: a timeout must not cancel them
            await s.proc.wait_closed()

        try:
            await asyncio.wait_for(feed_and_wait(), timeout)
        except asyncio.TimeoutError:
            timed_out = True
            error = f"timed out after {timeout:g} s; " + (await self._kill_group(await s.wait_pid(_PID_WAIT_S))).text
        except (asyncssh.Error, OSError) as exc:
            error = f"lost the command's channel on {self.name}: {exc}"
        if timed_out:
            await asyncio.wait([s.out_task, s.err_task], timeout=_DRAIN_AFTER_KILL_S)
        exit_status = s.proc.exit_status
        signal_info = s.proc.exit_signal
        if not timed_out:
            if signal_info is not None:
                exit_status = None
                error = f"killed by signal {signal_info[0]}"
            elif exit_status is None or exit_status < 0:
                exit_status = None
                error = error or (self._lost_text() if self.is_closed else
                                  f"the channel on {self.name} closed without an exit status")
        else:
            exit_status = None
        return CommandResult(
            command=command,
            exit_status=exit_status,
            stdout=s.out.decode("utf-8", errors="replace"),
            stderr=s.stderr_text(),
            duration_s=time.monotonic() - started,
            timed_out=timed_out,
            error=error,
        )

    async def stream_lines(self, command: str) -> AsyncIterator[str]:
        async with self._slots:
            proc = await self._open_process(wrap_remote(command))
            s = _Session(proc, stream_stdout=True)
            self._streams[s] = command
            finished = False
            try:
                proc.stdin.write_eof()
                while True:
                    try:
                        line = await proc.stdout.readline()
                    except (asyncssh.Error, OSError) as exc:
                        raise TransportError(
                            f"stream of `{command}` on {self.name} broke: {exc}; stderr: {s.stderr_text() or '(empty)'}",
                            kind=ConnectErrorKind.CLOSED,
                        ) from exc
                    if not line:
                        break
                    yield line.decode("utf-8", errors="replace").rstrip("\n")
                await asyncio.wait([s.err_task], timeout=_DRAIN_AFTER_KILL_S)
                await asyncio.wait([asyncio.ensure_future(proc.wait_closed())], timeout=_DRAIN_AFTER_KILL_S)
                finished = True
                status, sig = proc.exit_status, proc.exit_signal
                if sig is None and (status is None or status < 0):
                    await asyncio.sleep(0)  # let a pending connection_lost land before we judge
                    raise TransportError(
                        f"{self._lost_text() if self.is_closed else 'the channel closed without an exit status'} "
                        f"while streaming `{command}`; stderr: {s.stderr_text() or '(empty)'}",
                        kind=ConnectErrorKind.CLOSED,
                    )
                if sig is not None or status != 0:
                    how = f"exited with status {status}" if sig is None else f"was killed by signal {sig[0]}"
                    raise TransportError(
                        f"`{command}` on {self.name} {how}; stderr: {s.stderr_text() or '(empty)'}",
                        kind=ConnectErrorKind.ERROR
                    )
            finally:
                if self._streams.pop(s, None) is not None and not finished and not self.is_closed:
                    ending = asyncio.ensure_future(self._end_stream(command, s))
                    self._ending.add(ending)  # a close() meanwhile waits for it before closing the connection
                    try:
                        await ending
                    finally:
                        self._ending.discard(ending)
                s.close()

    async def _end_stream(self, command: str, s: "_Session") -> None:
        """Kill a stream's remote command (its reader stopped, or the connection is closing); said only when that
        failed: a command that had already exited is the normal end of a stream."""
        outcome = await self._kill_group(await s.wait_pid(_PID_WAIT_S))
        if not outcome.ok:
            log.warning("closing the stream of `%s` on %s: %s", command, self.name, outcome.text)

    async def open_process(self, command: str) -> "SshProcess":
        """One channel held for the command's life (a slot of max_channels); close() ends the remote command."""
        await self._slots.acquire()
        try:
            proc = await self._open_process(wrap_remote(command))
        except BaseException:
            self._slots.release()
            raise
        s = _Session(proc, stream_stdout=True)
        self._streams[s] = command  # a close() of the transport ends it
        return SshProcess(self, command, s)

    # -- SFTP -------------------------------------------------------------------------------

    async def put(self, local: Path, remote: str) -> None:
        local = Path(local)
        what = f"put {local} -> {self.name}:{remote}"
        if not local.exists():
            raise TransportError(f"{what}: {FileNotFoundError(2, 'No such file or directory', str(local))}")
        async with self._slots, self._sftp(what) as sftp:
            try:
                if local.is_dir():
                    await _put_tree(sftp, local, remote)
                else:
                    parent = posixpath.dirname(remote)
                    if parent:
                        await sftp.makedirs(parent, exist_ok=True)
                    await sftp.put(str(local), remote, preserve=True)
            except asyncssh.SFTPError as exc:
                raise TransportError(f"{what}: {exc.reason}", kind=ConnectErrorKind.ERROR) from exc
            except OSError as exc:
                raise TransportError(f"{what}: {exc}", kind=ConnectErrorKind.ERROR) from exc

    async def get(self, remote: str, local: Path) -> None:
        local = Path(local)
        what = f"get {self.name}:{remote} -> {local}"
        async with self._slots, self._sftp(what) as sftp:
            try:
                attrs = await sftp.stat(remote)
                if attrs.permissions is not None and stat.S_ISDIR(attrs.permissions):
                    await _get_tree(sftp, remote, local)
                else:
                    local.parent.mkdir(parents=True, exist_ok=True)
                    await sftp.get(remote, str(local), preserve=True)
            except asyncssh.SFTPError as exc:
                raise TransportError(f"{what}: {exc.reason}", kind=ConnectErrorKind.ERROR) from exc
            except OSError as exc:
                raise TransportError(f"{what}: {exc}", kind=ConnectErrorKind.ERROR) from exc

    def _sftp(self, what: str) -> "_SftpSession":
        return _SftpSession(self, what)

    async def close(self) -> None:
        # a stream still open (its reader's cancellation may not have reached it yet) is ended first: once the
        # connection is gone, nothing could kill its remote command
        open_streams = list(self._streams.items())
        self._streams.clear()
        endings = list(self._ending)
        if not self.is_closed:
            endings += [asyncio.ensure_future(self._end_stream(command, s)) for s, command in open_streams]
        if endings:
            await asyncio.wait(endings, timeout=_PID_WAIT_S + _KILL_TIMEOUT_S)
        self._conn.close()
        try:
            await asyncio.wait_for(self._conn.wait_closed(), 5.0)
        except asyncio.TimeoutError:
            self._conn.abort()


class SshProcess:
    """A remote command with its stdin open, on its own channel; implements console.host.transport.Process."""

    def __init__(self, transport: SshTransport, command: str, session: "_Session"):
        self.command = command
        self._t = transport
        self._s = session
        self._released = False

    @property
    def pid(self) -> int | None:
        """The remote process group's pid, once its marker arrived."""
        return self._s.pid()

    async def write(self, data: bytes) -> None:
        try:
            self._s.proc.stdin.write(data)
            await self._s.proc.stdin.drain()
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(f"`{self.command}` on {self._t.name}: cannot send ({exc}); "
                                 f"{self._t._lost_text() if self._t.is_closed else 'its channel closed'}",
                                 kind=ConnectErrorKind.CLOSED) from exc

    async def readline(self) -> bytes:
        try:
            return await self._s.proc.stdout.readline()
        except (asyncssh.Error, OSError) as exc:
            raise TransportError(f"`{self.command}` on {self._t.name} broke: {exc}; stderr: "
                                 f"{self._s.stderr_text() or '(empty)'}", kind=ConnectErrorKind.CLOSED) from exc

    async def ended(self) -> Ended:
        proc = self._s.proc
        await asyncio.wait([self._s.err_task], timeout=_DRAIN_AFTER_KILL_S)
        await asyncio.wait([asyncio.ensure_future(proc.wait_closed())], timeout=_DRAIN_AFTER_KILL_S)
        status, sig = proc.exit_status, proc.exit_signal
        if sig is not None:
            how = f"was killed by signal {sig[0]}"
        elif status is None or status < 0:
            await asyncio.sleep(0)  # let a pending connection_lost land before we judge
            if self._t.is_closed:
                raise TransportError(f"`{self.command}`: {self._t._lost_text()}", kind=ConnectErrorKind.CLOSED)
            how = "its channel closed without an exit status"
        else:
            return Ended(status, f"exited with status {status}", self._s.stderr_text())
        return Ended(None, how, self._s.stderr_text())

    async def close(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            if self._t._streams.pop(self._s, None) is not None and self._s.proc.exit_status is None \
                    and self._s.proc.exit_signal is None and not self._t.is_closed:
                await self._t._end_stream(self.command, self._s)
        finally:
            self._s.close()
            self._t._slots.release()


class _SftpSession:
    def __init__(self, transport: SshTransport, what: str):
        self.t = transport
        self.what = what
        self.client: asyncssh.SFTPClient | None = None

    async def __aenter__(self) -> asyncssh.SFTPClient:
        if self.t.is_closed:
            raise TransportError(f"{self.what}: {self.t._lost_text()}", kind=ConnectErrorKind.CLOSED)
        try:
            self.client = await self.t.connection.start_sftp_client()
        except (asyncssh.Error, OSError) as exc:
            kind = ConnectErrorKind.CLOSED if self.t.is_closed else ConnectErrorKind.ERROR
            raise TransportError(f"{self.what}: cannot start SFTP: {exc}", kind=kind) from exc
        return self.client

    async def __aexit__(self, *exc_info) -> None:
        if self.client is not None:
            self.client.exit()
            await self.client.wait_closed()


async def _put_tree(sftp: asyncssh.SFTPClient, local: Path, remote: str) -> None:
    for dirpath, _dirnames, filenames in os.walk(local):
        rel = Path(dirpath).relative_to(local)
        rdir = remote if str(rel) == "." else posixpath.join(remote, rel.as_posix())
        await sftp.makedirs(rdir, exist_ok=True)
        await sftp.chmod(rdir, stat.S_IMODE(os.stat(dirpath).st_mode))
        for fname in filenames:
            await sftp.put(os.path.join(dirpath, fname), posixpath.join(rdir, fname), preserve=True)


async def _get_tree(sftp: asyncssh.SFTPClient, remote: str, local: Path) -> None:
    local.mkdir(parents=True, exist_ok=True)
    mode = None
    for entry in await sftp.readdir(remote):
        if entry.filename in (".", ".."):
            continue
        name = entry.filename
        if not isinstance(name, str):  # asyncssh names the entries of a str path in str
            raise TypeError(f"SFTP listed {remote} with a {type(name).__name__} name {name!r}, not a str")
        rpath = posixpath.join(remote, name)
        perms = entry.attrs.permissions or 0
        if stat.S_ISDIR(perms):
            await _get_tree(sftp, rpath, local / name)
        else:
            await sftp.get(rpath, str(local / name), preserve=True)
    attrs = await sftp.stat(remote)
    mode = attrs.permissions
    if mode is not None:
        os.chmod(local, stat.S_IMODE(mode))


class _Session:
    """A remote process's channel with its output being collected (and the pid marker parsed)."""

    def __init__(self, proc: asyncssh.SSHClientProcess, *, stream_stdout: bool = False):
        self.proc = proc
        self.out = bytearray()
        self.err = bytearray()
        self._pid: int | None = None
        self.read_error: Exception | None = None
        self._pid_seen: asyncio.Future = asyncio.get_running_loop().create_future()
        self.out_task = (asyncio.ensure_future(asyncio.sleep(0)) if stream_stdout
                         else asyncio.ensure_future(self._read(proc.stdout, self.out)))
        self.err_task = asyncio.ensure_future(self._read(proc.stderr, self.err, parse_pid=True))

    async def _read(self, stream: asyncssh.SSHReader, sink: bytearray, parse_pid: bool = False) -> None:
        try:
            await self._read_into(stream, sink, parse_pid)
        except (asyncssh.Error, OSError) as exc:  # the channel or connection went away: judged by the caller
            self.read_error = exc

    async def _read_into(self, stream: asyncssh.SSHReader, sink: bytearray, parse_pid: bool) -> None:
        while chunk := await stream.read(65536):
            sink += chunk
            if parse_pid and self._pid is None:
                m = _PID_MARKER.search(sink)
                if m:
                    self._pid = int(m.group(1))
                    self._pid_seen.set_result(self._pid)
                    del sink[m.start():m.end()]

    def pid(self) -> int | None:
        return self._pid

    async def wait_pid(self, timeout: float) -> int | None:
        """The remote pid, waiting a little for its marker: stderr may lag behind stdout."""
        if self._pid is None:
            await asyncio.wait([self._pid_seen], timeout=timeout)
        return self._pid

    def stderr_text(self) -> str:
        return self.err.decode("utf-8", errors="replace")

    def close(self) -> None:
        for task in (self.out_task, self.err_task):
            if not task.done():
                task.cancel()
        self.proc.close()
