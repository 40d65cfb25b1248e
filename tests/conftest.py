"""Shared fixtures. Fixtures for SSH live in tests/sshd_fixtures.py (imported below)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_addoption(parser, pluginmanager) -> None:
    """With `-p no:xdist` the addopts' `-n 2 --dist loadgroup` (pyproject.toml) are accepted and mean one process."""
    if pluginmanager.is_blocked("xdist"):
        group = parser.getgroup("xdist", "distributed testing (pytest-xdist is off: -p no:xdist)")
        group._addoption("-n", "--numprocesses", dest="numprocesses", default=0, help="ignored: xdist is off")
        group._addoption("--dist", dest="dist", default="no", help="ignored: xdist is off")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A Qwen3-style model dir (tokenizer, chat template, config.json), built locally once."""
    from engine.text.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "Qwen3-tiny")


@pytest.fixture(scope="session")
def tiny35_model_dir(tmp_path_factory) -> Path:
    """The tiny model with the Qwen3.5/3.6 family's chat template: the generation prompt opens `<think>`."""
    from engine.text.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model-35") / "Qwen3.5-tiny", template="qwen3.5")


@pytest.fixture(scope="session", params=["qwen3", "qwen3.5"])
def family_model_dir(request) -> Path:
    """The tiny model of each template family in turn (parametrizes the test that uses it)."""
    return request.getfixturevalue("tiny_model_dir" if request.param == "qwen3" else "tiny35_model_dir")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path) -> Path:
    """A private copy of the tiny model, for tests that alter it."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_model_dir, dst)
    return dst


try:  # the SSH fixtures module is optional while it is being built
    from tests.sshd_fixtures import *  # noqa: F401,F403
except ModuleNotFoundError as exc:
    if exc.name != "tests.sshd_fixtures":
        raise


from tests.slurm_fixtures import shared_slurm, slurm  # noqa: E402,F401  (the real Slurm cluster fixtures)
