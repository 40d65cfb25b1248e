"""`regen tui --host-python` names the python that runs engine.ctl on a run dir without .regen/launch.json."""
from __future__ import annotations

import pytest

from console.transport_local import LocalTransport
from console.tui.source import HostSource


@pytest.mark.xfail(strict=True, reason=(
    "product bug: console.deploy.client_for returns RunClient(transport, run_dir) (python3) when the run dir has no "
    ".regen/launch.json, so HostSource never reaches its fallback that uses host_python: `regen tui HOST --run-dir "
    "DIR --host-python PY` runs `python3 -m engine.ctl` there (e.g. ModuleNotFoundError: psutil) instead of PY"))
async def test_the_host_python_given_is_the_one_a_run_without_a_launch_file_is_asked_with(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # a run started by hand (python -m engine.supervisor): no .regen/launch.json
    source = HostSource("local", str(run_dir), host_python="/opt/sglang-venv/bin/python", transport=LocalTransport())
    try:
        await source.connect()
        assert source.client is not None
        assert source.client.host_python == "/opt/sglang-venv/bin/python"
    finally:
        await source.transport.close()
