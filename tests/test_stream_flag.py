"""The delta-streaming flag a launch gets, by SGLang version: read from the launch's python, or the simulator's."""
from __future__ import annotations

import asyncio
import sys

from engine.servers.stream_flag import INCREMENTAL, LEGACY, choose, flag_for


def test_the_flag_follows_the_version():
    assert flag_for("0.5.5.post3") == LEGACY  # 0.5.5 has only --stream-output (deltas of text and ids)
    assert flag_for("0.5.10") == INCREMENTAL and flag_for("0.5.23") == INCREMENTAL and flag_for("1.0.0") == INCREMENTAL
    assert flag_for("nightly") is None


def test_the_simulator_speaks_its_profile_and_the_operator_line_wins():
    sim = ["python", "-m", "engine.simulator", "--model-path", "m"]
    got = asyncio.run(choose(sim + ["--sim-sglang-version", "0.5.5"], sys.executable))
    assert (got.flag, got.version) == (LEGACY, "0.5.5")
    assert asyncio.run(choose(sim, sys.executable)).flag == INCREMENTAL  # the simulator's default, 0.5.23
    wrapped = ["python", "bench/sim_ms.py", "--model-path", "m", "--sim-output-mean", "2000"]  # a wrapper script
    assert asyncio.run(choose(wrapped, sys.executable)).flag == INCREMENTAL
    given = asyncio.run(choose(sim + ["--stream-output"], sys.executable))
    assert given.flag is None and given.how == "the launch line has --stream-output already"


def test_an_sglang_version_read_from_the_launch_python(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 0.5.10\n")
    fake.chmod(0o755)
    got = asyncio.run(choose([str(fake), "-m", "sglang.launch_server"], str(fake)))
    assert (got.flag, got.version) == (INCREMENTAL, "0.5.10")
    broken = tmp_path / "nosglang"
    broken.write_text("#!/bin/sh\necho \"PackageNotFoundError: No package metadata was found for sglang\" >&2\nexit 1\n")
    broken.chmod(0o755)
    none = asyncio.run(choose([str(broken), "-m", "sglang.launch_server"], str(broken)))
    assert none.flag is None and "exited 1: PackageNotFoundError" in none.how, none.how
    missing = asyncio.run(choose(["/no/such/python", "-m", "sglang.launch_server"], "/no/such/python"))
    assert missing.flag is None and "FileNotFoundError" in missing.how
