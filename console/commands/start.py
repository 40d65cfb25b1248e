"""regen start HOST --config run.toml: deploy the engine into the run dir and start the supervisor."""
from __future__ import annotations

import asyncio
import json
import sys

from console.deploy import EXIT_ERROR, EXIT_OK, EXIT_UNREACHABLE, DeployError, start_run
from console.transport import TransportError, open_transport
from engine.config import ConfigError, load_config


def add_arguments(parser) -> None:
    parser.add_argument("host", help="ssh alias, user@host[:port], or `local`")
    parser.add_argument("--config", required=True, help="run.toml")
    parser.add_argument("--accept-new", action="store_true", help="accept an unknown host key (first contact)")
    parser.add_argument("--ssh-config", default=None)
    parser.add_argument("--json", action="store_true")


def run(args) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"regen start: {exc}", file=sys.stderr)
        return EXIT_ERROR

    async def main() -> int:
        try:
            transport = await open_transport(args.host, accept_new=args.accept_new, ssh_config=args.ssh_config)
        except TransportError as exc:
            print(f"cannot reach {args.host}: {exc}", file=sys.stderr)
            return EXIT_UNREACHABLE
        try:
            started = await start_run(transport, cfg, progress=lambda m: print(m, file=sys.stderr))
        except DeployError as exc:
            print(f"regen start: {exc}", file=sys.stderr)
            return EXIT_ERROR
        finally:
            await transport.close()
        if args.json:
            print(json.dumps({"run_dir": started.run_dir, "pid": started.pid, "status": started.status}, indent=2))
        else:
            print(f"started: supervisor pid {started.pid} on {args.host}:{started.run_dir} "
                  f"(state {started.status.get('state')}); `regen status {args.host} --run-dir {started.run_dir}`")
        return EXIT_OK

    return asyncio.run(main())
