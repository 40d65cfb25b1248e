"""Open the transport a HOST names: `local` is this machine (console/host/transport_local.py), anything else an ssh alias
or `user@host[:port]` reached with asyncssh (console/host/transport_ssh.py)."""
from __future__ import annotations

import argparse
import sys

from console.host.transport import HostSpec, Transport, TransportError
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


async def open_for_command(args: argparse.Namespace) -> Transport | None:
    """The transport a command's HOST and SSH options name; None after saying on stderr why it could not be opened
    (`cannot reach HOST: why`, and for an unknown host key the command that records it): the caller exits 2."""
    from console.host.hints import cannot_reach
    from console.host.ssh_options import SshOptions

    try:
        return await open_transport(args.host, **SshOptions.from_args(args).connect_kwargs())
    except TransportError as exc:
        print(cannot_reach(args.host, exc, args), file=sys.stderr)
        return None
