"""Clear words, as the operator reads them: a stopped run points to the `regen start` that resumes it, a
refused config change names the changed fields first, a missing run dir says so and where regen looked
(`status`, `stop`, `stats`, over the local transport and over the real OpenSSH sshd)."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from console.view.startup_failure import cause_first, startup_failure_text
from engine.config.load import dump_toml, load_config
from engine.store.run_dir import ConfigChanged
from tests.run_helpers import make_config, status, wait_for
from tests.test_cli_run import cleanup_runs, regen  # noqa: F401  (fixture)


def test_cause_first_lists_every_changed_field_and_the_remedy(tmp_path):
    exc = ConfigChanged(tmp_path / "run, with comma", [
        ("prompts", ["/d/a.jsonl", "/d/b.jsonl"], ["/d/a.jsonl"]),
        ("sampling.temperature", 0.6, 0.7),
        ("model", "/m/old, v1", "/m/new"),
    ])
    lines = cause_first(f"2026-01-01 ERROR regen.supervisor: refusing to resume: {exc}", "gpu1:/r")
    assert lines[0].startswith("refused to resume gpu1:/r: the config changed since the run was started")
    assert lines[1:4] == ['  changed: prompts ["/d/a.jsonl", "/d/b.jsonl"] -> ["/d/a.jsonl"]',
                          "  changed: sampling.temperature 0.6 -> 0.7",
                          '  changed: model "/m/old, v1" -> "/m/new"']
    assert lines[4].startswith("  remedy: either set run_dir to a new directory to start over with these values, "
                               "or revert these fields in the config to resume")
    assert cause_first("2026-01-01 ERROR regen.supervisor: something else", "gpu1:/r") is None


def test_startup_failure_shows_only_this_starts_log_after_the_cause():
    old_start = [f"2026-01-01 INFO regen.supervisor: old line {i}" for i in range(40)]
    this = ["2026-01-02 INFO regen.supervisor: supervisor pid 77 starting on /r (python p)",
            "2026-01-02 ERROR regen.supervisor: refusing to resume: "
            + str(ConfigChanged(Path("/r"), [("shard_size", 50, 60)])),
            "2026-01-02 INFO regen.supervisor: supervisor exits with 3"]
    text = startup_failure_text(77, "local:/r", "/r/supervisor.log",
                                "\n".join(["2026-01-01 INFO regen.supervisor: supervisor pid 5 starting on /r", *old_start,
                                           *this]))
    lines = text.splitlines()
    assert lines[0] == "refused to resume local:/r: the config changed since the run was started (its shards were " \
                       "generated with the old values):"
    assert lines[1] == "  changed: shard_size 50 -> 60"
    assert lines[2].startswith("  remedy: ")
    assert lines[3] == "the supervisor (pid 77) exited during startup on local:/r; this start in /r/supervisor.log " \
                       "(its lines):"
    assert lines[4:] == [f"  {line}" for line in this]
    assert "old line" not in text


def _write(cfg, path: Path) -> Path:
    path.write_text(dump_toml(cfg))
    return path


def _no_supervisor(run_dir: Path) -> None:
    wait_for(lambda: not (run_dir / "supervisor.pid").exists(), 60, "the supervisor to exit")


def test_stopped_run_points_to_start_and_a_changed_config_names_the_fields_first(tmp_path, tiny_model_dir,
                                                                                   cleanup_runs):
    run_dir = tmp_path / "run 'q'; echo x"
    cleanup_runs.append(run_dir)
    cfg = make_config(run_dir, tiny_model_dir, prompts=200, sim=("--sim-output-mean", "300", "--sim-step-ms", "60"))  # outlasts a stop under load
    config = _write(cfg, tmp_path / "run.toml")
    started = regen("start", "local", "--config", str(config), home=tmp_path)
    assert started.returncode == 0, started.stderr
    stop = regen("stop", "local", "--run-dir", str(run_dir), home=tmp_path)
    assert stop.returncode == 0, stop.stderr
    _no_supervisor(run_dir)

    for op in (["resume", "--all"], ["pause", "s00000"], ["stop"]):
        r = regen(op[0], "local", *op[1:], "--run-dir", str(run_dir), home=tmp_path)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert lines[0] == (f"regen {op[0]}: no supervisor runs in local:{run_dir} (the run is stopped or finished);"
                            " to resume it:"), r.stderr
        # the start as it was typed (the run's start record), in the directory it was typed in
        assert shlex.split(lines[1]) == ["cd", str(tmp_path), "&&", "regen", "start", "local", "--config", str(config)]
        assert "Traceback" not in r.stderr

    # the hint, pasted (the `regen` of the hint is this checkout's console.cli): the run resumes
    resumed = regen(*shlex.split(lines[1])[4:], home=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "started: supervisor pid" in resumed.stdout
    # samples committed: from now on a changed config is refused (a run dir with none would take it)
    wait_for(lambda: ((status(run_dir) or {}).get("dispatch") or {}).get("done", 0) > 0, 120, "a committed sample")
    assert regen("stop", "local", "--run-dir", str(run_dir), home=tmp_path).returncode == 0
    _no_supervisor(run_dir)

    changed = cfg.model_copy(update=dict(sampling=cfg.sampling.model_copy(update=dict(temperature=0.7)),
                                     shard_size=60))
    changed_toml = str(_write(changed, tmp_path / "changed.toml"))
    # the preflight sees it first (run_dir.resume names the fields) and starts nothing
    probed = regen("start", "local", "--config", changed_toml, home=tmp_path, env={"COLUMNS": "400"})
    assert probed.returncode == 1
    assert "FAIL run_dir.resume" in probed.stderr
    assert "changed: sampling.temperature 0.6 -> 0.7, shard_size 50 -> 60" in probed.stderr
    assert "regen start: preflight on local failed: run_dir.resume; nothing was started" in probed.stderr
    # without it, the supervisor refuses: its recorded cause, each changed field first, no log dump
    refused = regen("start", "local", "--config", changed_toml, "--no-preflight", home=tmp_path)
    assert refused.returncode == 1
    out = refused.stderr[refused.stderr.index("regen start: the supervisor"):].splitlines()
    assert out[0].startswith("regen start: the supervisor (pid ") and out[0].endswith(" exited during its start:")
    assert out[1] == (f"refused to resume local:{run_dir}: the config changed since the run was started"
                      " (its shards were generated with the old values):")
    assert sorted(out[2:4]) == ["  changed: sampling.temperature 0.6 -> 0.7", "  changed: shard_size 50 -> 60"]
    assert out[4].startswith("  remedy: either set run_dir to a new directory to start over with these values, "
                             "or revert these fields in the config to resume")
    assert out[5] == f"  after the fix, start again: regen start local --config {changed_toml}"
    assert len(out) == 6 and "starting on" not in refused.stderr  # the old starts' log is not dumped
    # the refused config never replaced the run's own: the resume hint still names the accepted one
    assert load_config(run_dir / "run.toml").content_hash() == cfg.model_copy(update={"run_dir": str(run_dir)}).content_hash()
    resumed = regen(*shlex.split(lines[1])[4:], home=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert regen("stop", "local", "--run-dir", str(run_dir), home=tmp_path).returncode == 0
    _no_supervisor(run_dir)


def test_missing_run_dir_says_so_and_where_it_looked(tmp_path):
    missing = tmp_path / "runs" / "mistyped run"
    for op in (["status"], ["resume", "--all"], ["stop"]):
        r = regen(op[0], "local", *op[1:], "--run-dir", str(missing), home=tmp_path)
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith(f"local:{missing}: no such run dir (FileNotFoundError); looked for {missing} on "
                                   f"local."), r.stderr
    relative = regen("status", "local", "--run-dir", "runs/nope", home=tmp_path)
    assert f"looked for runs/nope under {tmp_path} on local" in relative.stderr, relative.stderr

    here = regen("stats", str(missing), home=tmp_path)
    assert here.returncode == 2
    assert here.stderr.startswith(f"regen stats: {missing}: no such run dir (FileNotFoundError: No such file or "
                                  f"directory); looked for {missing} on this machine."), here.stderr
    via_local = regen("stats", f"local:{missing}", home=tmp_path)
    assert via_local.returncode == 2
    assert via_local.stderr.startswith(f"regen stats: local:{missing}: no such run dir (FileNotFoundError)")
    assert "ModuleNotFoundError" not in here.stderr + via_local.stderr


@pytest.mark.sshd
def test_stats_over_ssh_on_a_wrong_run_dir_says_so(sshd, tmp_path):
    ssh = ["--ssh-config", str(sshd.ssh_config_path)]
    missing = tmp_path / "mistyped"
    r = regen("stats", f"{sshd.alias}:{missing}", *ssh, home=tmp_path)
    assert r.returncode == 2
    assert r.stderr.startswith(f"regen stats: {sshd.alias}:{missing}: no such run dir (FileNotFoundError); looked "
                               f"for {missing} on {sshd.alias}."), r.stderr
    not_a_run = tmp_path / "not a run"
    not_a_run.mkdir()
    r = regen("stats", f"{sshd.alias}:{not_a_run}", *ssh, home=tmp_path)
    assert r.returncode == 2
    assert r.stderr.startswith(f"regen stats: {sshd.alias}:{not_a_run}: not a run dir started by `regen start` "
                               f"(checked {not_a_run}/.regen/engine: no engine deployed there)"), r.stderr
    assert "pass --python PY" in r.stderr and "Traceback" not in r.stderr


async def test_tui_source_on_a_missing_run_dir_says_so(tmp_path):
    from console.host.connect import open_transport
    from console.host.source import HostSource, SourceError

    missing = tmp_path / "mistyped"
    source = HostSource("local", str(missing), transport=await open_transport("local"))
    with pytest.raises(SourceError) as err:
        await source.connect()
    assert err.value.kind == "error"  # not retried as a lost connection, not "the run ended"
    assert str(err.value).startswith(f"local:{missing}: no such run dir (FileNotFoundError); looked for {missing}")
    await source.transport.close()
