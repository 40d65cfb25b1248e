"""Run dir: created private, frozen config, content changes refused with the field named."""
from __future__ import annotations

import json
import stat

import pytest

from engine.config.load import config_from_dict, load_config
from engine.store.run_dir import ConfigChanged, RunDirError, RunPaths, prepare_run_dir
from engine.store.shard_store import ShardStore
from tests.test_shard_store import make_row


def cfg_for(run_dir, **kw):
    d = {"run_dir": str(run_dir), "model": "/models/Qwen3-27B", "prompts": ["/data/*.jsonl"]}
    d.update(kw)
    return config_from_dict(d)


def with_one_committed_sample(run):
    """A run dir with data made under its config (one with nothing committed accepts a changed config)."""
    with ShardStore(run) as store:
        store.ensure_shards({"s00000": 1})
        store.commit("s00000", [make_row("a")])


def test_fresh_run_dir_is_private_with_frozen_config_and_hash(tmp_path):
    run = tmp_path / "runs" / "r1"
    cfg = cfg_for(run, sampling={"temperature": 0.7})
    assert prepare_run_dir(cfg) == run
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    paths = RunPaths.of(run)
    assert paths.shards.is_dir() and paths.workers.is_dir()
    frozen = load_config(paths.run_toml)
    assert frozen.content_hash() == cfg.content_hash() and frozen.sampling.temperature == 0.7
    with ShardStore(run) as store:
        assert store.get_meta("content_hash") == cfg.content_hash()
        assert json.loads(store.get_meta("content_fields")) == json.loads(json.dumps(cfg.content_fields()))


def test_same_content_resumes_and_operational_fields_may_change(tmp_path):
    run = tmp_path / "r"
    prepare_run_dir(cfg_for(run))
    changed_ops = cfg_for(run, dispatch={"max_retries": 9}, workers={"gpus": [0, 1]}, host_python="/venv/bin/python")
    assert prepare_run_dir(changed_ops) == run
    frozen = load_config(run / "run.toml")
    assert frozen.dispatch.max_retries == 9 and frozen.workers.gpus == (0, 1)  # the frozen copy follows


def test_changed_content_is_refused_naming_each_field(tmp_path):
    run = tmp_path / "r"
    prepare_run_dir(cfg_for(run))
    with_one_committed_sample(run)
    with pytest.raises(ConfigChanged) as exc:
        prepare_run_dir(cfg_for(run, sampling={"temperature": 0.7}, turns="last"))
    message = str(exc.value)
    assert "changed: sampling.temperature 0.6 -> 0.7, turns \"all\" -> \"last\"." in message
    assert "new directory" in message and "revert these fields" in message
    assert exc.value.changes == [("sampling.temperature", 0.6, 0.7), ("turns", "all", "last")]
    assert load_config(run / "run.toml").sampling.temperature == 0.6  # the frozen copy is untouched


def test_changed_prompts_and_model(tmp_path):
    run = tmp_path / "r"
    prepare_run_dir(cfg_for(run))
    with_one_committed_sample(run)
    with pytest.raises(ConfigChanged) as exc:
        prepare_run_dir(cfg_for(run, prompts=["/data/other.jsonl"], model="/models/other"))
    assert 'model "/models/Qwen3-27B" -> "/models/other"' in str(exc.value)
    assert 'prompts ["/data/*.jsonl"] -> ["/data/other.jsonl"]' in str(exc.value)
    assert "revert these fields" in str(exc.value)


def test_a_non_empty_foreign_directory_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError) as exc:
        prepare_run_dir(cfg_for(tmp_path))
    assert "not a regen run dir" in str(exc.value) and "notes.txt" in str(exc.value)


def test_a_deployed_dir_with_run_toml_is_accepted(tmp_path):
    cfg = cfg_for(tmp_path / "r")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "run.toml").write_text("# deployed by regen start\n")
    assert prepare_run_dir(cfg) == tmp_path / "r"


def test_run_paths(tmp_path):
    p = RunPaths.of(tmp_path)
    assert p.state_db == tmp_path / "state.sqlite" and p.rejects == tmp_path / "rejects.jsonl"
    assert p.server_log("gpu0") == tmp_path / "workers" / "gpu0" / "server.log"
    assert p.control_sock == tmp_path / "control.sock" and p.telemetry == tmp_path / "telemetry.jsonl"
    assert p.supervisor_pid == tmp_path / "supervisor.pid" and p.supervisor_log == tmp_path / "supervisor.log"
    assert p.shard_dir("s00003") == tmp_path / "shards" / "s00003"
    assert p.writer_lock == tmp_path / "state.sqlite.writer.lock"
