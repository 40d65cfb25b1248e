"""Which pytest-xdist worker this process is (`gw3` -> 3; 0 without xdist): fixtures that take fixed network
addresses (the multi-host and Slurm namespaces) give each worker its own, so workers never share one."""
from __future__ import annotations

import os


def worker_index() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0
