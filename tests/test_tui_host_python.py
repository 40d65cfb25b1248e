"""`regen tui --host-python` names the python that runs engine.ctl on a run dir without .regen/launch.json."""
from __future__ import annotations

import pytest

from console.host.transport_local import LocalTransport
from console.host.source import HostSource


async def test_the_host_python_given_is_the_one_a_run_without_a_launch_file_is_asked_with(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # a run started by hand (python -m engine.supervisor): no .regen/launch.json
    (run_dir / "supervisor.log").write_text("")  # what such a supervisor writes first (a run dir, not any directory)
    source = HostSource("local", str(run_dir), host_python="/opt/sglang-venv/bin/python", transport=LocalTransport())
    try:
        await source.connect()
        assert source.client is not None
        assert source.client.host_python == "/opt/sglang-venv/bin/python"
    finally:
        await source.transport.close()
