"""Shell words for host paths, shared by the probes, the engine's host links and the console."""
from __future__ import annotations

import shlex


def shell_path(path: str) -> str:
    """A path for the host's shell: `~/x` becomes "$HOME"/'x' (quoting stops tilde expansion)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)
