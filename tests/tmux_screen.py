"""tmux driven as a person would, for the tmux tests: run tmux commands, read the screen back, wait on it."""
from __future__ import annotations

import os
import subprocess

from tests.waiting import wait_until

# a tmux server of this test process's own: test processes side by side (xdist workers) never race one server's
# exit when its last session is killed
SOCKET = f"regen-tests-{os.getpid()}"


def tmux(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["tmux", "-L", SOCKET, *args], capture_output=True, text=True, timeout=20, check=check)


def capture(session: str, history: int = 0) -> str:
    """The visible pane; with `history`, that many lines of scrollback too, wrapped lines joined."""
    scroll = ["-J", "-S", f"-{history}"] if history else []
    return tmux("capture-pane", "-p", *scroll, "-t", session).stdout


def wait_screen(session: str, predicate, what: str, timeout: float = 60.0, history: int = 0) -> str:
    """The screen once `predicate(screen)` holds; on timeout the assertion shows the last screen."""
    seen = {"text": ""}

    def shown() -> str | None:
        seen["text"] = capture(session, history)
        return seen["text"] if predicate(seen["text"]) else None

    return wait_until(shown, timeout, what, interval=0.2, describe=lambda: f"the screen was:\n{seen['text']}")
