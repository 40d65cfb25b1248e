"""regen pause HOST --run-dir DIR (SHARD ... | --all)"""
from __future__ import annotations

import argparse
import json

from console.host.deploy import EXIT_ERROR, EXIT_OK, run_with_client
from console.host.ssh_options import add_ssh_options

OP = "pause"


class _IntermixedParser(argparse.ArgumentParser):
    """Parses positionals that sit on both sides of options (intermixed), also as a subparser."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):
        if self._intermixing:  # parse_known_intermixed_args calls back into this method
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def add_arguments(parser) -> None:
    # `regen pause HOST --run-dir DIR S1 S2`: positionals on both sides of an option need argparse's
    # intermixed parsing; the top-level parser hands this subparser its arguments via parse_known_args
    parser.__class__ = _IntermixedParser
    parser.add_argument("targets", nargs="+", metavar="HOST [SHARD ...]",
                        help="ssh alias, user@host[:port] or `local`, then shard ids (e.g. s00003)")
    parser.add_argument("--run-dir", required=True, help="the run dir on the host")
    add_ssh_options(parser)
    parser.add_argument("--all", action="store_true",
                        help="every shard (resume --all also releases the data-quality brake: [brake])")
    parser.add_argument("--json", action="store_true")


def run(args) -> int:
    return run_shard_op(args, OP)


def run_shard_op(args, op: str) -> int:
    args.host, args.shards = args.targets[0], args.targets[1:]
    if args.all == bool(args.shards):
        print(f"regen {op}: give shard ids or --all")
        return EXIT_ERROR

    async def call(client) -> int:
        fn = client.pause if op == "pause" else client.resume
        result = await fn(None if args.all else list(args.shards))
        if args.json:
            print(json.dumps(result.to_dict(), indent=2))
        else:
            print(f"{op}d {len(result.shards)} shard(s): {' '.join(result.shards) or '-'}; paused now: "
                  f"{' '.join(result.paused) or 'none'}; run state {result.state}")
            if result.brake:
                print(f"still braked by the data-quality brake: {result.brake}; `regen resume ... --all` "
                      "releases it")
        return EXIT_OK

    return run_with_client(args, call)
