"""regen pause HOST --run-dir DIR (SHARD ... | --all)"""
from __future__ import annotations

import json

from console.deploy import EXIT_ERROR, EXIT_OK, run_with_client

OP = "pause"


def add_arguments(parser) -> None:
    # HOST and the shard ids are one positional list: argparse cannot give a second, variable-length
    # positional its values once an option (--run-dir) sits between them
    parser.add_argument("targets", nargs="+", metavar="HOST [SHARD ...]",
                        help="ssh alias, user@host[:port] or `local`, then shard ids (e.g. s00003)")
    parser.add_argument("--run-dir", required=True, help="the run dir on the host")
    parser.add_argument("--accept-new", action="store_true", help="accept an unknown host key (first contact)")
    parser.add_argument("--ssh-config", default=None, help="OpenSSH client config file")
    parser.add_argument("--all", action="store_true", help="every shard")
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
            print(json.dumps(result, indent=2))
        else:
            shards = result.get("shards") or []
            print(f"{op}d {len(shards)} shard(s): {' '.join(shards) or '-'}; paused now: "
                  f"{' '.join(result.get('paused') or []) or 'none'}; run state {result.get('state')}")
        return EXIT_OK

    return run_with_client(args, call)
