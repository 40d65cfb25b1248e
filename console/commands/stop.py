"""regen stop HOST --run-dir DIR [--drain]"""
from __future__ import annotations

import json

from console.host.deploy import EXIT_OK, add_host_args, run_with_client
from engine.api.ops import EXITED


def add_arguments(parser) -> None:
    add_host_args(parser)
    parser.add_argument("--drain", action="store_true",
                        help="finish in-flight requests and commit them before exiting (default: abort them)")
    parser.add_argument("--json", action="store_true")


def run(args) -> int:
    async def call(client) -> int:
        result = await (client.drain() if args.drain else client.stop())
        if args.json:
            print(json.dumps(result.to_dict(), indent=2))
        elif result.state.startswith(EXITED):  # no supervisor: what it left (Slurm jobs, host agents) was released
            print(f"{client.run_dir}: no supervisor runs; {result.state.removeprefix(EXITED).strip()}")
        else:
            how = "draining (in-flight requests finish and are committed)" if args.drain else \
                "stopping (in-flight requests aborted; finished rows committed)"
            print(f"{client.run_dir}: {how}; state {result.state}")
        return EXIT_OK

    return run_with_client(args, call)
