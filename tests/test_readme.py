"""The README and docs/ say only what the code does: every `regen ...` command line they show names a real
subcommand and only flags its parser has, every link into docs/ reaches a file (and heading), every complete
run.toml they show passes `regen config check`, every Prometheus series they name is exported, every benchmark
table names the command that produced it, and the README stays a front door (under 260 lines)."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from console.cli import build_parser
from console.cli import main as cli_main
from console.reference import PAGES

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
# the generated references are checked against the code by tests/test_reference.py
PAGES_WRITTEN = [REPO / "README.md"] + sorted(p for p in DOCS.glob("*.md") if p.name not in PAGES)
README_MAX_LINES = 260

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
COMMENT = re.compile(r"(?:^|\s)#")  # a shell or TOML comment: what follows is prose
# `regen` as a command: at a line's start, after a prompt, a path (.venv/bin/regen), `&&` or a backtick
COMMAND = re.compile(r"(?:^|(?<=[\s/`(]))regen[ \t]+(.*)$")
SEGMENT_END = re.compile(r"\s#|\s\|\s|&&|;|`|\s\(")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's subcommands (console/reference.py walks it the same way)."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def commands_in(text: str) -> list[tuple[str, str]]:
    """(the `regen ...` text up to a comment, pipe, `&&` or closing backtick, the line it is on) for every command
    in the page's code: fenced blocks (JSON bodies aside: their `regen critical: ...` is an alert title) and inline
    code spans."""
    found = []
    code_lines = []
    for lang, body in FENCE.findall(text):
        if lang == "json":
            continue
        for line in body.splitlines():
            comment = COMMENT.search(line)
            code_lines.append(line[:comment.start()] if comment else line)
            if comment:  # a comment is prose: only its code spans are commands
                code_lines += INLINE.findall(line[comment.start():])
    prose = FENCE.sub("", text)
    code_lines += INLINE.findall(prose)
    for line in code_lines:
        for m in COMMAND.finditer(line):
            rest = m.group(1)
            end = SEGMENT_END.search(rest)
            found.append((rest[:end.start()] if end else rest, line.strip()))
    return found


def problems_of(command: str, parser: argparse.ArgumentParser) -> list[str]:
    """What in one `regen ...` text the parser does not have: its subcommand (`pause|resume`: each), a nested
    subcommand (`config check`), any --flag."""
    words = command.split()
    if not words:
        return ["`regen` without a subcommand"]
    commands = subparsers(parser)
    out = []
    for name in words[0].rstrip(":,.").split("|"):
        sub = commands.get(name)
        if sub is None:
            out.append(f"no subcommand `regen {name}` (regen has: {', '.join(commands)})")
            continue
        flags = flags_of(sub)
        nested = subparsers(sub)
        if nested and len(words) > 1:
            nested_name = words[1].rstrip(":,.")
            if nested_name in nested:
                flags |= flags_of(nested[nested_name])
            elif re.fullmatch(r"[a-z]+(\|[a-z]+)*", nested_name):
                out.append(f"no subcommand `regen {name} {nested_name}` (it has: {', '.join(nested)})")
            else:
                flags = flags.union(*(flags_of(p) for p in nested.values()))
        out += [f"`regen {name}` has no flag {flag}" for flag in FLAG.findall(command) if flag not in flags]
        choices = {s: a.choices for p in [sub, *nested.values()] for a in p._actions if a.choices
                   for s in a.option_strings}
        for flag, value in re.findall(r"(--[a-z][a-z0-9-]*)[ =]([a-z][\w.-]*)", command):
            if flag in choices and value not in choices[flag]:
                out.append(f"`regen {name} {flag}` takes {', '.join(choices[flag])}, not {value}")
    return out


@pytest.mark.parametrize("page", PAGES_WRITTEN, ids=lambda p: p.name)
def test_every_regen_command_shown_exists_in_the_parser(page):
    parser = build_parser()
    commands = commands_in(page.read_text())
    problems = [f"{line!r}: {p}" for command, line in commands for p in problems_of(command, parser)]
    assert not problems, f"{page.relative_to(REPO)} shows commands the parser does not have:\n" + "\n".join(problems)


def test_the_readme_shows_the_commands_of_a_real_run():
    text = (REPO / "README.md").read_text()
    subcommands = {command.split()[0] for command, _ in commands_in(text) if command.split()}
    assert {"demo", "probe", "plan", "start", "tui", "status", "export", "config"} <= subcommands
    assert "--pilot" in text and "[plan]" in text


def test_the_check_catches_what_it_is_for():
    parser = build_parser()
    text = "```\nregen plan HOST --config run.toml --pilot 20  # fine --not-a-flag\nregen sart HOST\n```\n" \
           "and `regen export DIR --keep x --frobnicate` and `regen config chek f` and `regen pause|resme H --all`" \
           " and `regen export DIR --format tokens-json --out O`\n"
    problems = [p for command, _ in commands_in(text) for p in problems_of(command, parser)]
    assert problems == [
        "no subcommand `regen sart` (regen has: " + ", ".join(subparsers(parser)) + ")",
        "`regen export` has no flag --frobnicate",
        "no subcommand `regen config chek` (it has: check, schema)",
        "no subcommand `regen resme` (regen has: " + ", ".join(subparsers(parser)) + ")",
        "`regen export --format` takes " + ", ".join(flags_choices(parser, "export", "--format")) + ", not tokens-json",
    ]


def flags_choices(parser, command: str, flag: str) -> list[str]:
    return next(a.choices for a in subparsers(parser)[command]._actions if flag in a.option_strings)


def test_the_keep_list_shown_is_the_one_the_parser_takes():
    from engine.export.options import KEEPABLE

    lists = [page_list.split(",") for page in PAGES_WRITTEN
             for page_list in re.findall(r"--keep ([a-z,]+)", page.read_text())]
    assert lists, "the docs show no --keep list"
    for shown in lists:
        assert set(shown) <= set(KEEPABLE), f"--keep {','.join(shown)}: regen export keeps only {', '.join(KEEPABLE)}"
    assert any(set(shown) == set(KEEPABLE) for shown in lists), "no page shows the whole --keep list"


def test_the_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines: move the details to docs/"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES_WRITTEN, ids=lambda p: p.name)
def test_every_link_into_the_repository_resolves(page):
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            missing.append(f"{target}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md":
            anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", FENCE.sub("", dest.read_text()), re.M)}
            if anchor not in anchors:
                missing.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not missing, f"{page.relative_to(REPO)}: " + "; ".join(missing)


def test_every_page_in_docs_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    unlinked = [p.name for p in DOCS.iterdir() if p.suffix in (".md", ".json") and f"(docs/{p.name})" not in readme]
    assert not unlinked, f"pages in docs/ the README does not link: {unlinked}"


@pytest.mark.parametrize("page", PAGES_WRITTEN, ids=lambda p: p.name)
def test_every_complete_run_toml_shown_is_valid(page, tmp_path, capsys):
    complete = [body for lang, body in FENCE.findall(page.read_text()) if lang == "toml" and "\nrun_dir = " in
                f"\n{body}"]
    for i, body in enumerate(complete):
        path = tmp_path / f"run{i}.toml"
        path.write_text(body)
        assert cli_main(["config", "check", str(path)]) == 0, capsys.readouterr()


def test_every_prometheus_series_named_is_exported():
    from engine.observe.metrics_server import SHARE_KINDS

    source = (REPO / "engine" / "observe" / "metrics_server.py").read_text()
    exported = set(re.findall(r'"(regen_[a-z_]+)"', source)) | {f"regen_samples_{kind}" for kind in SHARE_KINDS}
    for page in PAGES_WRITTEN:
        for name in set(re.findall(r"\bregen_[a-z_]+", page.read_text())):
            assert name.removesuffix("_total") in exported, \
                f"{page.name} names {name}, which engine/observe/metrics_server.py does not export"


def test_every_benchmark_table_names_its_command_and_commit():
    """docs/benchmarks.md: each section with a table of figures says the command that produced them and the commit
    it ran on (the machine is said once, for all)."""
    text = (DOCS / "benchmarks.md").read_text()
    assert "2 cores" in text and "Python 3.11" in text
    sections = re.split(r"^## ", FENCE.sub("", text), flags=re.M)[1:]
    with_tables = [s for s in sections if re.search(r"^\|.*\|$", s, re.M) and "each benchmark measures" not in s]
    assert len(with_tables) >= 8
    for s in with_tables:
        title = s.splitlines()[0]
        assert re.search(r"`(python -m tests\.bench\.[a-z_]+[^`]*)`", s), f"section {title!r} names no command"
        assert re.search(r"commit\s+`[0-9a-f]{7}`", s), f"section {title!r} names no commit"
