"""Commands regen prints for the operator to paste: `regen <cmd> HOST ...`, shell-quoted (shlex.join), with
the SSH options that were given (console/host/ssh_options.py). Every such hint is built here."""
from __future__ import annotations

import argparse
import shlex

from console.host.ssh_options import SshOptions
from console.host.transport import TransportError

PROG = "regen"


def regen_command(cmd: str, host: str, *rest: str, ssh: SshOptions = SshOptions(), accept_new: bool = False) -> str:
    """`regen cmd HOST rest... [--ssh-config FILE] [--accept-new]`, one shell-quoted line. HOST `local` uses no
    SSH, so it carries no SSH option."""
    argv = [PROG, cmd, host, *rest]
    if host != "local":
        argv += ssh.hint_argv(accept_new=accept_new)
    return shlex.join(argv)


def run_dir_command(cmd: str, host: str, run_dir: str, *rest: str, ssh: SshOptions = SshOptions()) -> str:
    """`regen cmd DIR|HOST:DIR rest...` for the commands that take a run dir as their target (stats, export): the
    plain DIR for `local` (a run dir here), else HOST:DIR with the SSH options given."""
    argv = [PROG, cmd, run_dir if host == "local" else f"{host}:{run_dir}", *rest]
    if host != "local":
        argv += ssh.hint_argv()
    return shlex.join(argv)


def hint_from_args(args: argparse.Namespace, cmd: str, *rest: str, accept_new: bool = False) -> str:
    """The same for the host and SSH options of a parsed command line (args.host, args.ssh_config, args.accept_new)."""
    return regen_command(cmd, args.host, *rest, ssh=SshOptions.from_args(args), accept_new=accept_new)


def typed_again(args: argparse.Namespace, *, accept_new: bool = False) -> str:
    """The command line the operator typed (cli.main keeps it in args.argv), shell-quoted, with --accept-new
    added if asked and not already there."""
    argv = [PROG, *args.argv]
    if accept_new and "--accept-new" not in argv:
        argv.append("--accept-new")
    return shlex.join(argv)


def cannot_reach(host: str, exc: TransportError, args: argparse.Namespace) -> str:
    """`cannot reach HOST: why`, and for a host not yet in known_hosts the exact command that records its key."""
    text = f"cannot reach {host}: {exc}"
    if exc.unknown_host_key:
        text += f"\nif that fingerprint is {host}'s, record it and go on with:\n  {typed_again(args, accept_new=True)}"
    return text
