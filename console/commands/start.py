"""regen start HOST --config run.toml: deploy the engine into the run dir and start the supervisor.

A multi-host config ([[hosts]]) is preflighted first: the dispatch host and every GPU host are
probed (PREFLIGHT, or --preflight IDS); any FAIL or ERROR, or a host not reached, refuses the start
with the report. The supervisor then brings up each host's agent, SSH forwards and the router.
"""
from __future__ import annotations

import asyncio
import json
import sys

from console.deploy import EXIT_ERROR, EXIT_OK, EXIT_UNREACHABLE, AlreadyRunning, DeployError, start_run
from console.hints import cannot_reach, hint_from_args
from console.ssh_options import SshOptions, add_ssh_options
from console.transport import TransportError, open_transport
from engine.config import ConfigError, load_config

# what must hold on every host for its servers to start (GPU and package probes are `regen probe`'s)
PREFLIGHT = ("connection", "host.python", "ports", "disk.run_dir", "router.package", "prompts.paths",
             "run_dir.resume")


def add_arguments(parser) -> None:
    parser.add_argument("host", help="ssh alias, user@host[:port], or `local`")
    parser.add_argument("--config", required=True, help="run.toml")
    add_ssh_options(parser)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--preflight", default=",".join(PREFLIGHT), metavar="ID,...",
                        help="multi-host: the probes that must pass on every host before the start")
    parser.add_argument("--no-preflight", action="store_true", help="multi-host: start without probing the hosts")
    parser.add_argument("--timeout", type=float, default=None, help="preflight: each probe's timeout")


def run(args) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"regen start: {exc}", file=sys.stderr)
        return EXIT_ERROR

    if cfg.hosts and not args.no_preflight:
        refused = preflight(args, cfg)
        if refused is not None:
            return refused

    async def main() -> int:
        try:
            transport = await open_transport(args.host, **SshOptions.from_args(args).connect_kwargs())
        except TransportError as exc:
            print(cannot_reach(args.host, exc, args), file=sys.stderr)
            return EXIT_UNREACHABLE
        try:
            started = await start_run(transport, cfg, progress=lambda m: print(m, file=sys.stderr))
        except AlreadyRunning as exc:
            print(f"regen start: {exc}; watch it, or stop it, with:\n  {watch_hints(args, exc.run_dir)[0]}\n"
                  f"  {hint_from_args(args, 'stop', '--run-dir', exc.run_dir)}", file=sys.stderr)
            return EXIT_ERROR
        except DeployError as exc:
            print(f"regen start: {exc}", file=sys.stderr)
            return EXIT_ERROR
        finally:
            await transport.close()
        if args.json:
            print(json.dumps({"run_dir": started.run_dir, "pid": started.pid, "status": started.status}, indent=2))
        else:
            print(f"started: supervisor pid {started.pid} on {args.host}:{started.run_dir} "
                  f"(state {started.status.get('state')}); watch it with:")
            for hint in watch_hints(args, started.run_dir):
                print(f"  {hint}")
        return EXIT_OK

    return asyncio.run(main())


def watch_hints(args, run_dir: str) -> list[str]:
    """`regen status ...` and `regen tui ...` for the run, shell-quoted, with the SSH options given."""
    return [hint_from_args(args, "status", "--run-dir", run_dir), hint_from_args(args, "tui", "--run-dir", run_dir)]


def preflight(args, cfg) -> int | None:
    """Probe every host of a multi-host run; None if all passed, else the exit code (report printed)."""
    from rich.console import Console

    from console.commands.probe import probe_fleet
    from probes.render import render_report

    wanted = {p.strip() for p in args.preflight.split(",") if p.strip()}
    sections = asyncio.run(probe_fleet(args, cfg, wanted, per_role=True))
    bad = [(name, address, report, reached) for name, address, report, reached in sections
           if not reached or report.exit_code()]
    if not bad:
        print(f"preflight passed on {len(sections)} hosts: " + ", ".join(n for n, *_ in sections), file=sys.stderr)
        return None
    console = Console(stderr=True)
    for name, address, report, reached in bad:
        console.rule(f"[bold]{name}[/] ({address})" + ("" if reached else " [red]not reached[/]"))
        render_report(report, console)
    print(f"regen start: preflight failed on {', '.join(n for n, *_ in bad)}; nothing was started"
          " (fix it, drop the host from [[hosts]], or --no-preflight)", file=sys.stderr)
    return EXIT_ERROR
