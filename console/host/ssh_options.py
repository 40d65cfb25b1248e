"""The SSH options every connecting command takes, declared once with one help text: `--ssh-config FILE` (else
$REGEN_SSH_CONFIG, else ~/.ssh/config) and `--accept-new` (records an unknown host's key; a changed key is always
refused)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TypedDict

ENV_SSH_CONFIG = "REGEN_SSH_CONFIG"

SSH_CONFIG_HELP = (f"OpenSSH client config file for HOST (and for [[hosts]] whose ssh_options carry no -F); "
                   f"default: ${ENV_SSH_CONFIG}, else ~/.ssh/config")
ACCEPT_NEW_HELP = ("first contact with a host not yet in known_hosts: accept its key and record it (a CHANGED key "
                   "is always refused)")


class SshConnectKwargs(TypedDict):
    """The keywords SshOptions.connect_kwargs gives console.host.connect.open_transport (and probe_host)."""

    ssh_config: str | None
    accept_new: bool


@dataclass(frozen=True)
class SshOptions:
    """The SSH options as the operator gave them (ssh_config None: $REGEN_SSH_CONFIG, else ~/.ssh/config)."""

    ssh_config: str | None = None
    accept_new: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "SshOptions":
        return cls(ssh_config=args.ssh_config, accept_new=args.accept_new)

    def connect_kwargs(self) -> SshConnectKwargs:
        """Keyword arguments for console.host.connect.open_transport."""
        return SshConnectKwargs(ssh_config=self.ssh_config, accept_new=self.accept_new)

    def hint_argv(self, *, accept_new: bool = False) -> list[str]:
        """The options a pasted command must carry: --ssh-config if one was given (absolute, so the hint works
        from any directory), never --accept-new unless asked (after the first contact the key is recorded)."""
        argv: list[str] = []
        if self.ssh_config:
            argv += ["--ssh-config", os.path.abspath(os.path.expanduser(self.ssh_config))]
        if accept_new:
            argv.append("--accept-new")
        return argv


def add_ssh_options(parser: argparse.ArgumentParser) -> None:
    """--ssh-config and --accept-new, the same for every command that connects."""
    group = parser.add_argument_group("SSH options", f"the same for every command that connects; HOST `local` "
                                                     f"uses no SSH. ${ENV_SSH_CONFIG}: default for --ssh-config")
    group.add_argument("--ssh-config", metavar="FILE", default=None, help=SSH_CONFIG_HELP)
    group.add_argument("--accept-new", action="store_true", help=ACCEPT_NEW_HELP)
