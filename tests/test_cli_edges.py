"""The CLI at the edges of a run, as the operator sees it (issue 35): --version and --help, the config check of a
missing file, `start` on a finished run, `status --follow`'s resume line, one reject count, a rate in the first
seconds, whole columns when piped, and a directory that is not a run dir (locally and over the real OpenSSH sshd)."""
from __future__ import annotations

import pytest

import engine
from console.cli import main
from tests.test_cli_run import cleanup_runs, regen  # noqa: F401  (fixture)


def test_version_prints_regen_and_the_engine_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"regen {engine.__version__}\n"


def test_help_describes_the_tool_and_its_flow_not_the_code(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "console/commands" not in out and "module" not in out
    assert "drafter training data" in out
    steps = [out.index(f"regen {cmd} HOST") for cmd in ("probe", "plan", "start", "status")]
    assert steps == sorted(steps), out  # probe -> plan -> start -> watch -> export, in that order
    assert steps[-1] < out.index("regen export HOST:DIR --format F --out PATH")
    assert "regen demo" in out


def test_config_check_of_a_missing_file_names_the_command_it_was_given_to(tmp_path, capsys):
    missing = tmp_path / "nonexistent.toml"
    assert main(["config", "check", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"regen config check: {missing}: (file): cannot be read: [Errno 2] No such file or directory")
    assert err.rstrip().endswith("fix: check the path given to `regen config check`"), err
    assert "--config" not in err


# -- piped output: every column whole, as `regen status` prints it -------------------------------------------------

LONG = "a-directory-name-long-enough-that-an-80-column-table-must-cut-it"


def _piped_at_80_columns(monkeypatch) -> None:
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)  # capsys: stdout is not a terminal
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setenv("COLUMNS", "80")


def test_stats_piped_prints_whole_columns(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from engine.text.render import Renderer
    from engine.store.shard_store import ShardStore
    from tests.test_stats import make_row

    renderer = Renderer(str(tiny_model_dir), enable_thinking=True)
    source = str(tmp_path / LONG / "chat_prompts.jsonl")
    rows = [{**make_row(renderer, i), "source": source, "worker": f"http://127.0.0.1:30000/{LONG}"} for i in range(6)]
    with ShardStore(tmp_path) as store:
        store.ensure_shards({"s00000": 6})
        store.commit("s00000", rows)
    _piped_at_80_columns(monkeypatch)
    main(["stats", str(tmp_path), "--empty-threshold", "1", "--truncated-threshold", "1"])
    out = capsys.readouterr().out
    assert source in out and f"http://127.0.0.1:30000/{LONG}" in out, out
    assert "…" not in out


def test_plan_piped_prints_whole_columns(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from tests.test_plan import write_config, write_prompts

    deep = tmp_path / LONG
    deep.mkdir()
    prompts = write_prompts(deep)
    cfg = write_config(tmp_path, tiny_model_dir, prompts)
    _piped_at_80_columns(monkeypatch)
    assert main(["plan", "local", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert all(str(p) in out for p in prompts), out
    assert "…" not in out


# -- a directory that is not a run dir: said so before any engine is asked, exit 2 -----------------------------------

def _assert_not_a_run_dir(r, where: str, looked_at, holds: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.startswith(f"{where} is not a run dir: {looked_at} on "), r.stderr
    assert "holds none of run.toml, state.sqlite, supervisor.log, fatal.json, .regen/" in r.stderr
    assert f"(it holds: {holds})" in r.stderr
    assert "A run dir is the directory `regen start` made for a run" in r.stderr
    for wrong in ("ModuleNotFoundError", "Traceback", "to resume it", "regen start local --config"):
        assert wrong not in r.stderr + r.stdout, r.stderr


def test_status_of_a_directory_that_is_not_a_run_dir_says_so_locally(tmp_path):
    not_a_run = tmp_path / "not a run"
    not_a_run.mkdir()
    (not_a_run / "notes.txt").write_text("x")
    r = regen("status", "local", "--run-dir", str(not_a_run), home=tmp_path)
    _assert_not_a_run_dir(r, f"local:{not_a_run}", not_a_run, "notes.txt")
    for op in (["stop"], ["pause", "--all"], ["status", "--json"]):
        again = regen(op[0], "local", *op[1:], "--run-dir", str(not_a_run), home=tmp_path)
        _assert_not_a_run_dir(again, f"local:{not_a_run}", not_a_run, "notes.txt")


@pytest.mark.sshd
def test_status_of_a_directory_that_is_not_a_run_dir_says_so_over_ssh(sshd, tmp_path):
    not_a_run = tmp_path / "not a run"
    not_a_run.mkdir()
    r = regen("status", sshd.alias, "--run-dir", str(not_a_run), "--ssh-config", str(sshd.ssh_config_path),
              home=tmp_path)
    _assert_not_a_run_dir(r, f"{sshd.alias}:{not_a_run}", not_a_run, "nothing")


# -- status --follow of a run that is not running: the same resume line as plain status ---------------------------

def test_follow_of_a_failed_run_prints_the_start_records_line_as_status_does(tmp_path, tiny_model_dir, cleanup_runs):
    from tests.run_helpers import make_config
    from tests.test_faults_fatal import start_fails, write_config

    run_dir = tmp_path / "run"
    cleanup_runs.append(run_dir)
    missing = tmp_path / "data" / "chat.jsonl"
    cfg = make_config(run_dir, tiny_model_dir, prompts=10, gpus=1).model_copy(update=dict(prompts=(str(missing),)))
    config = write_config(tmp_path, cfg)
    start_fails(config, tmp_path)
    plain = regen("status", "local", "--run-dir", str(run_dir), home=tmp_path)
    followed = regen("status", "local", "--run-dir", str(run_dir), "--follow", home=tmp_path, timeout=120)
    assert plain.returncode == followed.returncode == 3, (plain.stderr, followed.stderr)
    again = f"  after the fix, start again: cd {tmp_path} && regen start local --config {config} --no-preflight"
    assert again in plain.stdout.splitlines(), plain.stdout
    assert again in followed.stdout.splitlines(), followed.stdout
    assert "start again: regen start" not in followed.stdout  # not the line built without the record
    assert followed.stdout.splitlines()[0] == plain.stdout.splitlines()[0]  # `failed: PromptFileError: ...` first


# -- start on a finished run: says so (exit 3), leaves no supervisor -----------------------------------------------

def _supervisors_of(run_dir) -> list[int]:
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "engine.supervisor" in cmd and str(run_dir) in cmd:
            found.append(p.info["pid"])
    return found


def test_start_on_a_finished_run_says_it_is_finished_and_leaves_no_supervisor(tmp_path, tiny_model_dir,
                                                                              cleanup_runs):
    import json

    from tests.run_helpers import make_config, wait_for
    from tests.test_faults_fatal import write_config

    run_dir = tmp_path / "run"
    cleanup_runs.append(run_dir)
    config = write_config(tmp_path, make_config(run_dir, tiny_model_dir, prompts=8, gpus=1))
    first = regen("start", "local", "--config", str(config), "--no-preflight", home=tmp_path)
    assert first.returncode == 0, first.stderr
    wait_for(lambda: not (run_dir / "supervisor.pid").exists(), 120, "the first run to finish")
    done = regen("status", "local", "--run-dir", str(run_dir), "--json", home=tmp_path)
    assert json.loads(done.stdout)["state"] == "done", done.stdout

    again = regen("start", "local", "--config", str(config), "--no-preflight", home=tmp_path)
    assert again.returncode == 3, again.stdout + again.stderr
    assert "started: supervisor" not in again.stdout
    said = again.stderr[again.stderr.index("regen start: the run on"):].splitlines()
    assert said[0].startswith(f"regen start: the run on local:{run_dir} is already finished (state done: "), said
    assert said[0].endswith("samples, every sample was already settled); nothing was started and no supervisor runs. "
                            "See it, check it, or export it with:"), said
    assert said[1:4] == [f"  regen status local --run-dir {run_dir}", f"  regen stats {run_dir}",
                         f"  regen export {run_dir} --format tokens-jsonl --out OUT"]
    assert said[4] == "to generate the data again, set run_dir in the config to a new directory"
    assert _supervisors_of(run_dir) == [] and not (run_dir / "supervisor.pid").exists()

    js = regen("start", "local", "--config", str(config), "--no-preflight", "--json", home=tmp_path)
    assert js.returncode == 3
    data = json.loads(js.stdout)
    assert data["started"] is False and data["already_finished"] is True and data["status"]["state"] == "done"
    assert _supervisors_of(run_dir) == []


# -- a rate from the first commits: the headless demo's lines (and --follow's) are not `- tok/s` throughout ----------

@pytest.mark.slow
def test_headless_demo_lines_show_a_rate_once_samples_are_committed(tmp_path, cleanup_runs):
    import re

    run_dir = tmp_path / "demo run"
    cleanup_runs.append(run_dir)
    r = regen("demo", "--quick", "--headless", "--until-done", "--gpus", "2", "--prompts", "200", "--run-dir",
              str(run_dir), home=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    running = [ln for ln in r.stdout.splitlines() if "] running: " in ln]
    committed = [ln for ln in running if not re.search(r"running: 0/", ln)]
    assert committed, r.stdout
    rated = [ln for ln in committed if re.search(r", \d+ tok/s, ", ln)]
    assert rated, r.stdout  # a rate exists after the first commits
    ended = [ln for ln in r.stdout.splitlines() if "] done: " in ln]
    assert ended and "- tok/s" in ended[-1], r.stdout  # the run's end: done, no rate


# -- the run's rejects: one count with its parts, the same words in status, --json and the TUI header --------------

def test_rejects_are_one_count_with_its_parts_in_status_json_and_the_tui_header():
    import io

    from rich.console import Console

    from console.commands.status import render_status
    from console.view.model import RunModel
    from console.tui.widgets import RunHeader
    from engine.api.status import Rejects, RunStatus
    from engine.api.events import DispatchEvent

    rejects = Rejects(total=7, by_reason={"malformed_json": 4, "unknown_role": 2, "context_overflow": 1})
    status = RunStatus(run_dir="/r", state="running", host="gpu-box", pid=1, started_at=0.0, rejects=rejects,
                       dispatch=DispatchEvent(done=3, total=10, rejected=1))
    out = io.StringIO()
    Console(file=out, width=200).print(render_status(status))
    printed = out.getvalue()
    assert "rejected samples 1," in printed  # the progress line: the samples' part
    assert ("rejects 7 (6 input rows, 1 sample rejected); rejects.jsonl rows by reason: context_overflow 1, "
            "malformed_json 4, unknown_role 2") in printed, printed
    assert "rejects: 7" not in printed

    said = status.to_dict()["rejects"]
    assert (said["total"], said["input_rows"], said["samples_rejected"], said["samples_failed"]) == (7, 6, 1, 0)
    assert RunStatus.from_dict(status.to_dict()).rejects == rejects

    model = RunModel("gpu-box", "/r")
    model.apply_status(status)
    header = RunHeader()
    header.show(model, 1000.0, 10.0)
    assert "  rejects 7 (6 input rows, 1 sample rejected)" in header.render().plain

    older = RunStatus.from_dict({**status.to_dict(), "rejects": {"total": 7, "by_reason": rejects.by_reason}})
    assert older.rejects.text() == "7 (6 input rows, 1 sample rejected)"  # an engine that sent no parts
    assert Rejects(3, {"generation_failed": 2, "earlier_turn_failed": 1}).text() == "3 (3 samples failed)"
    assert Rejects().text() == "0"


def test_every_sample_reject_kind_the_engine_writes_is_counted_as_a_sample():
    """The ledger and the feed settle samples with these kinds: each must be in engine.api.wire's sample kinds (else it
    would be counted as an input row)."""
    import re
    from pathlib import Path

    from engine.store.names import AFTER_CUT
    from engine.api.wire import SAMPLE_FAILED_KINDS, SAMPLE_REJECTED_KINDS

    root = Path(__file__).parent.parent / "engine" / "run"
    written = set()
    for name in ("ledger.py", "feed.py"):
        text = (root / name).read_text()
        written |= set(re.findall(r'kind="([a-z_]+)"', text))
        written |= set(re.findall(r'"generation_failed" if kind == SettleKind.FAILED else "([a-z_]+)"', text))
        if 'kind=f"earlier_turn_{kind}"' in text:
            written |= {"earlier_turn_failed", "earlier_turn_rejected"}
    written |= {"generation_failed", AFTER_CUT}
    assert written >= {"sglang_rejected", "earlier_turn_rejected", "template_error", "context_overflow"}, written
    assert written <= SAMPLE_FAILED_KINDS | SAMPLE_REJECTED_KINDS, written - (SAMPLE_FAILED_KINDS | SAMPLE_REJECTED_KINDS)
