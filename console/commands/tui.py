"""regen tui HOST [--run-dir DIR]: the operations console (quitting it never stops the run)."""
from __future__ import annotations

import asyncio
import sys

from console.host.deploy import EXIT_ERROR, EXIT_UNREACHABLE, client_for
from console.host.run_client import ClientErrorKind, RunClientError
from console.host.ssh_options import SshOptions, add_ssh_options


def add_arguments(parser) -> None:
    parser.add_argument("host", metavar="HOST", help="ssh alias, user@host[:port], or `local`")
    parser.add_argument("--run-dir", default=None, help="the run to watch (without it only Preflight has data)")
    parser.add_argument("--host-python", default="python3",
                        help="python on the host, used when the run dir has no .regen/launch.json")
    parser.add_argument("--replay", metavar="TELEMETRY_JSONL", default=None,
                        help="show a recorded telemetry.jsonl instead of a live run (read-only)")
    add_ssh_options(parser)


def run(args) -> int:
    if args.replay:
        from pathlib import Path

        from console.tui.app import RegenApp
        from console.host.source import ReplaySource

        path = Path(args.replay)
        if not path.is_file():
            print(f"regen tui: {path}: no such file", file=sys.stderr)
            return 2
        app = RegenApp(ReplaySource(path, host=args.host))
        app.run()
        return int(app.return_code or 0)
    from console.tui.app import run_tui

    from console.host.hints import typed_again

    refused = asyncio.run(refusal(args))
    if refused is not None:
        return refused
    return int(run_tui(args.host, args.run_dir, host_python=args.host_python, ssh=SshOptions.from_args(args),
                       accept_new_command=typed_again(args, accept_new=True)) or 0)


async def refusal(args) -> int | None:
    """What `regen status` refuses, the console refuses before it opens, with the same words and exit code: a host
    that cannot be reached (an alias that does not resolve, an unknown key), a run dir that is not there or is not a
    run's. None: the run dir is one; the console opens (a stopped or finished run included)."""
    from console.host.connect import open_for_command

    transport = await open_for_command(args)
    if transport is None:
        return EXIT_UNREACHABLE
    try:
        if args.run_dir is not None:
            await client_for(transport, args.run_dir, args.host_python)
    except RunClientError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_UNREACHABLE if exc.kind == ClientErrorKind.UNREACHABLE else EXIT_ERROR
    finally:
        await transport.close()
    return None
