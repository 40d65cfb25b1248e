"""regen resume HOST --run-dir DIR (SHARD ... | --all)"""
from __future__ import annotations

from console.commands.pause import add_arguments, run_shard_op  # noqa: F401  (same arguments)


def run(args) -> int:
    return run_shard_op(args, "resume")
