"""regen drain-host HOST NAME --run-dir DIR [--undo]: a multi-host run stops (or resumes) sending
new work to one of its [[hosts]]; requests already on it finish and are committed."""
from __future__ import annotations

import json

from console.host.deploy import EXIT_OK, add_host_args, run_with_client


def add_arguments(parser) -> None:
    add_host_args(parser)
    parser.add_argument("name", help="the [[hosts]] name to drain")
    parser.add_argument("--undo", action="store_true", help="undrain: the host gets work again")
    parser.add_argument("--json", action="store_true")


def run(args) -> int:
    async def call(client) -> int:
        result = await client.drain_host(args.name, undo=args.undo)
        if args.json:
            print(json.dumps(result.to_dict(), indent=2))
        else:
            print(f"host {args.name}: {result.state}"
                  + (" (no new work; requests on it finish)" if not args.undo else " (gets work again)"))
        return EXIT_OK

    return run_with_client(args, call)
