"""The small fixes of issue 18, each asserted on what the operator sees."""
from __future__ import annotations

from console.transport_ssh import kill_outcome


def test_kill_outcome_never_prints_an_empty_reason():
    assert kill_outcome(7, 0, "").text == "killed remote process group 7"
    gone = kill_outcome(7, 1, "sh: 1: kill: No such process\nsh: 1: kill: No such process")
    assert gone.ok and gone.text == "remote process group 7 had already exited"
    silent = kill_outcome(7, None, "")
    assert not silent.ok and "()" not in silent.text
    assert silent.text == "kill of remote process group 7 failed (no exit status; it printed nothing)"
    denied = kill_outcome(7, 1, "kill: Operation not permitted")
    assert not denied.ok and denied.text.endswith("(exit status 1; stderr: kill: Operation not permitted)")
