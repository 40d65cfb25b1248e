"""Open the transport a HOST names: `local` is this machine (console/host/transport_local.py), anything else an ssh alias
or `user@host[:port]` reached with asyncssh (console/host/transport_ssh.py)."""
from __future__ import annotations

from console.host.transport import HostSpec, Transport
from console.host.transport_local import LocalTransport


async def open_transport(
    host: str,
    *,
    accept_new: bool = False,
    connect_timeout: float = 10.0,
    known_hosts: str | None = None,
    keepalive_s: float = 15.0,
    ssh_config: str | None = None,
) -> Transport:
    """ssh_config: an OpenSSH client config file (default: $REGEN_SSH_CONFIG, else ~/.ssh/config).
    Commands take both options from the command line through console/host/ssh_options.py."""
    spec = HostSpec.parse(host)
    if spec.is_local:
        return LocalTransport()
    from console.host.transport_ssh import connect_ssh  # asyncssh loads only when a host is remote

    return await connect_ssh(
        spec, accept_new=accept_new, connect_timeout=connect_timeout, known_hosts=known_hosts, keepalive_s=keepalive_s,
        ssh_config=ssh_config,
    )
