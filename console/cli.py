"""`regen` command line (each subcommand is a module under console/commands/, see COMMANDS)."""
from __future__ import annotations

import argparse
import importlib
import sys

import engine

# what `regen --help` says of the tool: the operator's view of it and its flow, not the code's layout
DESCRIPTION = """\
regen regenerates speculative-decoding drafter training data (DFlash, EAGLE-3) with the target
model itself: one SGLang server per GPU on a training host reached over SSH (HOST: an ssh alias,
user@host[:port], or `local` for this machine), writing shards of exact token ids and loss masks.

the flow:
  regen probe HOST --config run.toml      preflight the host: prompts, model, GPUs, ports, disk
  regen plan HOST --config run.toml       shards, GPU time, wall time, disk (--pilot N: measured)
  regen start HOST --config run.toml      start the run, detached (it survives the SSH session)
  regen status HOST --run-dir DIR         watch it (--follow; or the console: regen tui HOST)
  regen export HOST:DIR --format F --out PATH
                                          the files a drafter trainer reads (first: regen stats)

regen demo runs the whole flow on this machine, the SGLang simulator standing in for the GPUs."""
EPILOG = "`regen COMMAND --help` describes each command, its options and its exit status."

# (subcommand, module under console.commands). Each module has add_arguments(p) and run(args) -> int.
COMMANDS = [
    ("demo", "demo", "run the whole flow on this machine with the SGLang simulator"),
    ("probe", "probe", "preflight probes of a host"),
    ("plan", "plan", "shard plan and GPU-time / wall-time / disk projection"),
    ("start", "start", "deploy the engine and start a run (detached)"),
    ("status", "status", "status of a run"),
    ("pause", "pause", "pause shards of a run"),
    ("resume", "resume", "resume shards of a run"),
    ("stop", "stop", "stop a run (optionally draining in-flight requests)"),
    ("drain-host", "drain_host", "multi-host: stop (or --undo: resume) sending new work to one host"),
    ("stats", "stats", "data-quality statistics of the shards"),
    ("export", "export", "export the shards for a drafter trainer (tokens, conversations, messages, hf) with a manifest"),
    ("tui", "tui", "the operations console"),
    ("config", "config", "check a run.toml offline, or print its JSON Schema"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="regen", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"regen {engine.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name, help_text in COMMANDS:
        try:
            module = importlib.import_module(f"console.commands.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"console.commands.{module_name}":
                raise
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed: hints repeat it (console/host/hints.py)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
