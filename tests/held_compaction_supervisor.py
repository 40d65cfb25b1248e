"""The real supervisor (`python -m engine.supervisor`) with every shard compaction held until RUN_DIR/release-compaction
exists, for tests/test_end_compaction.py: it looks at the run while the compaction waits (RUN_DIR/compaction-held
says one does), then releases it or kills the supervisor.

    python -m tests.held_compaction_supervisor --run-dir D
"""
from __future__ import annotations

import sys
from pathlib import Path

from engine.supervisor import main as supervisor
from engine.store.shard_store import ShardStore
from tests.waiting import poll_until

RELEASE_FILE = "release-compaction"
HELD_FILE = "compaction-held"
HOLD_S = 120.0


def hold_compactions() -> None:
    """ShardStore.compact (run in the compactor's thread) waits for the release file first."""
    real = ShardStore.compact

    def compact(self: ShardStore, shard_id: str):
        (self.run_dir / HELD_FILE).touch()
        poll_until(lambda: (self.run_dir / RELEASE_FILE).exists(), HOLD_S)
        return real(self, shard_id)

    ShardStore.compact = compact


def held_path(run_dir: Path) -> Path:
    return run_dir / HELD_FILE


def release(run_dir: Path) -> None:
    (run_dir / RELEASE_FILE).touch()


if __name__ == "__main__":
    hold_compactions()
    sys.exit(supervisor.main())
