"""Candidates for a missing prompt file (issue 13, case 5): one finder, the same answer in `regen probe`,
`regen plan` and the run's PromptFileError.

The tree of case 5: `work/chat.jsonl` is configured, the file is at `work/data/prompts/chat.jsonl` (two
levels below the configured directory), and a dozen unrelated prompt-like files sit next to it. The tree is
built 3 levels below the test's tmp dir so that the 4 ancestors searched stay inside it (other tests' files
in /tmp would otherwise be candidates too), and HOME points into it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from console.cli import main as cli_main
from engine.text.ingest import resolve_prompt_files
from engine.text.row_errors import PromptFileError
from probes.host import candidates as finder
from probes.host import script
from probes.host.candidates import describe, find_candidates
from tests.test_probes_fakes import REPO, sharegpt, write_jsonl, write_run_toml

NO_DATA_ROOTS: tuple[str, ...] = ()  # in-process tests look only near the configured path (deterministic)


@pytest.fixture
def case5(tmp_path, monkeypatch) -> Path:
    """work/ with the file two levels down, close names, unrelated files and unreadable look-alikes; returns work's
    parent."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    work = tmp_path / "x1" / "x2" / "x3" / "work"
    (work / "data" / "prompts").mkdir(parents=True)
    write_jsonl(work / "data" / "prompts" / "chat.jsonl", [sharegpt(i) for i in range(3)])
    (work / "exports").mkdir()
    write_jsonl(work / "exports" / "chat.json", [sharegpt(0)])  # same stem, other extension
    write_jsonl(work / "exports" / "chat_v2.jsonl", [sharegpt(0)])  # a close name
    (work / "misc").mkdir()
    for i in range(12):  # what case 5 listed: prompt-like files with unrelated names
        write_jsonl(work / "misc" / f"train_{i:02d}.jsonl", [sharegpt(i)])
    (work / "misc" / "config.json").write_text("{}")
    (work / "old").mkdir()
    (work / "old" / "chat.jsonl").symlink_to(work / "old" / "gone.jsonl")  # dangling: cannot be read, as root too
    (work / "archive" / "chat.jsonl").mkdir(parents=True)  # a directory named like the file
    return work.parent


def paths(cands) -> list[str]:
    return [c.path for c in cands]


def size(path: Path) -> str:
    return finder.size_words(path.stat().st_size)


# ---------------------------------------------------------------------------------------------- the finder


def test_the_file_two_levels_down_is_the_first_candidate(case5):
    work = case5 / "work"
    s = find_candidates(str(work / "chat.jsonl"), data_roots=NO_DATA_ROOTS)
    assert paths(s.candidates) == [str(work / "data" / "prompts" / "chat.jsonl"), str(work / "exports" / "chat.json"),
                                   str(work / "exports" / "chat_v2.jsonl")]
    assert [(c.match, c.hops) for c in s.candidates] == [("exact", 2), ("stem", 1), ("close", 1)]
    assert s.candidates[0].size == (work / "data" / "prompts" / "chat.jsonl").stat().st_size
    assert not any("train_" in p or "config.json" in p for p in paths(s.candidates))  # unrelated names: never
    assert s.roots == [str(work), str(case5), str(case5.parent), str(case5.parents[1]), str(case5.parents[2])]
    assert s.depth == 4 and s.cut is None
    assert str(work / "chat.jsonl") not in paths(s.candidates) + paths(s.unreadable)


def test_unreadable_look_alikes_are_listed_apart_with_their_error(case5):
    work = case5 / "work"
    s = find_candidates(str(work / "chat.jsonl"), data_roots=NO_DATA_ROOTS)
    errors = {c.path: c.error for c in s.unreadable}
    dangling, directory = str(work / "old" / "chat.jsonl"), str(work / "archive" / "chat.jsonl")
    assert errors == {
        dangling: f"FileNotFoundError: [Errno 2] No such file or directory: '{dangling}'",
        directory: f"IsADirectoryError: [Errno 21] Is a directory: '{directory}'",
    }
    lines = describe(s)
    assert lines[0] == (f"looked for chat.jsonl and similar names under {', '.join(s.roots)} (4 levels deep; "
                        f"{s.dirs_scanned} directories in {s.elapsed_s:.1f} s)")
    best, json_, v2 = work / "data" / "prompts" / "chat.jsonl", work / "exports" / "chat.json", work / "exports" / "chat_v2.jsonl"
    assert lines[1:5] == ["candidates, best first:",
                          f"  {best} ({size(best)}; same name, 2 dirs away)",
                          f"  {json_} ({size(json_)}; same name, other extension, 1 dir away)",
                          f"  {v2} ({size(v2)}; similar name, 1 dir away)"]
    assert lines[5] == "found but unreadable:"
    assert f"  {dangling}: FileNotFoundError: [Errno 2] No such file or directory: '{dangling}'" in lines


def test_permission_denied_is_listed_apart_with_the_permission_error(case5, monkeypatch):
    # Tests run as root, who opens a chmod 000 file. The finder's readability test is a real open() (in
    # open_check); here that one call raises what open() raises for a user without read permission.
    work = case5 / "work"
    locked = work / "exports" / "chat.jsonl"
    write_jsonl(locked, [sharegpt(0)])
    real = finder.open_check

    def as_a_user(path):
        if path == str(locked):
            raise PermissionError(13, "Permission denied", path)
        return real(path)

    monkeypatch.setattr(finder, "open_check", as_a_user)
    s = find_candidates(str(work / "chat.jsonl"), data_roots=NO_DATA_ROOTS)
    assert str(locked) not in paths(s.candidates)
    assert {c.path: c.error for c in s.unreadable}[str(locked)] == \
        f"PermissionError: [Errno 13] Permission denied: '{locked}'"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod 000 file; the mocked test above covers it")
def test_permission_denied_for_real(case5):
    work = case5 / "work"
    locked = write_jsonl(work / "exports" / "chat.jsonl", [sharegpt(0)])
    locked.chmod(0)
    s = find_candidates(str(work / "chat.jsonl"), data_roots=NO_DATA_ROOTS)
    assert {c.path: c.error for c in s.unreadable}[str(locked)].startswith("PermissionError: [Errno 13]")


def test_the_configured_path_is_never_its_own_candidate(case5):
    dangling = case5 / "work" / "old" / "chat.jsonl"  # configured, exists as a name, cannot be read
    s = find_candidates(str(dangling), data_roots=NO_DATA_ROOTS)
    assert str(dangling) not in paths(s.candidates) + paths(s.unreadable)
    assert s.candidates[0].path == str(case5 / "work" / "data" / "prompts" / "chat.jsonl")


def test_a_glob_matching_nothing_gets_the_directories_where_it_would(case5):
    work = case5 / "work"
    s = find_candidates(str(work / "data" / "prompt" / "*.jsonl"), data_roots=NO_DATA_ROOTS)  # prompt, not prompts
    assert s.name == "*.jsonl"
    assert [(c.path, c.match, c.files, c.hops) for c in s.candidates[:3]] == [
        (str(work / "data" / "prompts" / "*.jsonl"), "glob", 1, 2),  # the sibling with the closest name first
        (str(work / "exports" / "*.jsonl"), "glob", 1, 3),
        (str(work / "misc" / "*.jsonl"), "glob", 12, 3)]
    assert describe(s)[1:3] == ["candidates, best first:", f"  {work}/data/prompts/*.jsonl (1 file; 2 dirs away)"]


def test_the_time_budget_holds_on_a_large_tree(tmp_path):
    # 400 directories, the file in the last one; a clock that advances 10 ms each time the walk polls it:
    # the walk must stop at the 2 s budget (about 200 polls) and say so, whatever the machine's speed.
    big = tmp_path / "big"
    for i in range(400):
        (big / f"d{i:03d}").mkdir(parents=True)
    write_jsonl(big / "d399" / "chat.jsonl", [sharegpt(0)])
    ticks = iter(range(10**6))
    s = find_candidates(str(big / "chat.jsonl"), data_roots=NO_DATA_ROOTS, clock=lambda: next(ticks) * 0.01)
    assert s.cut == f"time budget 2 s reached after {s.dirs_scanned} directories"
    assert 150 < s.dirs_scanned < 250
    assert describe(s)[-1] == f"search stopped early: {s.cut}"
    capped = find_candidates(str(big / "chat.jsonl"), data_roots=NO_DATA_ROOTS, max_dirs=50)
    assert capped.cut == "directory cap 50 reached" and capped.dirs_scanned == 50


def test_the_host_script_inlines_the_finder():
    src = script("prompts")
    assert "# @include" not in src and "def find_candidates(" in src
    compile(src, "<probes/host/prompts.py>", "exec")  # one valid script for `python -c`


# ---------------------------------------------------------------------------------------------- the same in probe, plan, start


def regen(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "console.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_regen_probe_json_shows_the_candidates(case5, tiny_model_dir):
    work = case5 / "work"
    cfg = write_run_toml(case5 / "run.toml", run_dir=case5 / "run", model=tiny_model_dir,
                         prompts=[str(work / "chat.jsonl")])
    proc = regen("probe", "local", "--config", str(cfg), "--json", "--only", "prompts.paths")
    assert proc.returncode == 1, proc.stderr
    probe = {p["id"]: p for p in json.loads(proc.stdout)["probes"]}["prompts.paths"]
    best = str(work / "data" / "prompts" / "chat.jsonl")
    assert probe["status"] == "FAIL"
    assert probe["summary"] == (f"{work}/chat.jsonl: cannot stat: [Errno 2] No such file or directory: "
                                f"'{work}/chat.jsonl'; best candidate: {best} ({size(Path(best))}; same name, 2 dirs away)")
    assert probe["remedy"] == (f"set `prompts` in {cfg} to the best candidate ({work}/chat.jsonl -> {best}), "
                               "or copy the files to those paths on the host")
    search = probe["data"]["missing"][0]["candidates"]
    near = [c["path"] for c in search["candidates"] if c["path"].startswith(str(case5))]
    assert near == [best, str(work / "exports" / "chat.json"), str(work / "exports" / "chat_v2.jsonl")]
    assert {c["path"] for c in search["unreadable"]} >= {str(work / "old" / "chat.jsonl"),
                                                         str(work / "archive" / "chat.jsonl")}
    assert probe["data"]["candidates"]["files"][0]["path"] == best  # the older shape of regen.probe/1 still there
    assert "  candidates, best first:" in probe["actual"] and "  found but unreadable:" in probe["actual"]


def test_regen_plan_shows_the_same_candidates(case5, tiny_model_dir, capsys):
    work = case5 / "work"
    cfg = write_run_toml(case5 / "run.toml", run_dir=case5 / "run", model=tiny_model_dir,
                         prompts=[str(work / "chat.jsonl")])
    assert cli_main(["plan", "local", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"regen plan: prompts: prompt file {work}/chat.jsonl: [Errno 2] No such file or directory: "
                      f"'{work}/chat.jsonl'")
    assert err[1].startswith(f"  looked for chat.jsonl and similar names under {work}, {case5}, ")
    assert err[2].startswith("  candidates, best first")
    best = work / "data" / "prompts" / "chat.jsonl"
    assert err[3] == f"    {best} ({size(best)}; same name, 2 dirs away)"
    assert f"    {work}/old/chat.jsonl: FileNotFoundError: [Errno 2] No such file or directory: " \
           f"'{work}/old/chat.jsonl'" in err


def test_the_runs_prompt_file_error_carries_the_candidates(case5):
    work = case5 / "work"
    with pytest.raises(PromptFileError) as exc:
        resolve_prompt_files([str(work / "chat.jsonl")])
    assert exc.value.candidates.candidates[0].path == str(work / "data" / "prompts" / "chat.jsonl")
    best = work / "data" / "prompts" / "chat.jsonl"
    assert f"    {best} ({size(best)}; same name, 2 dirs away)" in str(exc.value).splitlines()
    with pytest.raises(PromptFileError) as exc:
        resolve_prompt_files([str(work / "data" / "prompt" / "*.jsonl")])
    assert "glob matched no files" in str(exc.value).splitlines()[0]
    assert exc.value.candidates.candidates[0].path == str(work / "data" / "prompts" / "*.jsonl")
