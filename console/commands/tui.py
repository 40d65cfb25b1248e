"""regen tui HOST [--run-dir DIR]: the operations console (quitting it never stops the run)."""
from __future__ import annotations

import sys

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

    from console.view.hints import typed_again

    return int(run_tui(args.host, args.run_dir, host_python=args.host_python, ssh=SshOptions.from_args(args),
                       accept_new_command=typed_again(args, accept_new=True)) or 0)
