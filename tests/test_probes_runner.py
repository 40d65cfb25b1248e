"""The runner: concurrency, timeouts, dependency skips, judge errors, connection failures; the catalog's rules."""
from __future__ import annotations

import asyncio
import dataclasses
import shlex

import pytest
from rich.console import Console

import probes.runner as runner_mod
from probes.catalog import CATALOG, UnknownProbe, probes_for
from probes.catalog.probe import Probe, Verdict
from probes.model import CommandResult, Status
from probes.render import display_command, render_report
from probes.runner import ConnectFailure, run_probes
from tests.test_probes_fakes import context, probe, probe_local, run_local


def _echo_judge(res, inp):
    return Verdict(Status.PASS, res.stdout.strip())


def test_hanging_probe_is_error_and_the_others_still_report():
    hang = Probe("slow", "hangs", lambda c: "echo started; sleep 60", _echo_judge, needs=("connection",), timeout_s=1)
    quick = Probe("quick", "answers", lambda c: "echo fine", _echo_judge, needs=("connection",), timeout_s=10)
    after = Probe("after", "needs the hang", lambda c: "echo never", _echo_judge, needs=("slow",))
    res = run_local(context(), catalog=[probe("connection"), hang, quick, after])
    assert res["slow"].status is Status.ERROR
    assert res["slow"].summary.startswith("timed out after 1s")
    assert res["slow"].stdout.strip() == "started"  # what it printed before it hung is kept
    assert res["quick"].status is Status.PASS and res["quick"].summary == "fine"
    assert res["after"].status is Status.SKIP
    assert res["after"].summary == "needs slow, which is ERROR"


def test_timeout_override_applies_to_every_probe():
    hang = Probe("slow", "hangs", lambda c: "sleep 60", _echo_judge, needs=("connection",), timeout_s=600)
    res = run_local(context(), catalog=[probe("connection"), hang], timeout_s=2)
    assert res["slow"].status is Status.ERROR and res["slow"].summary.startswith("timed out after 2s")


def test_runner_that_never_returns_is_error(monkeypatch):
    monkeypatch.setattr(runner_mod, "RUNNER_GRACE_S", 0.2)

    class StuckRunner:
        async def run(self, command, *, timeout, stdin=None):
            if command.startswith("id -un"):
                return CommandResult(command, 0, "me\nbox\nLinux 6\n", "", 0.0)
            await asyncio.Event().wait()  # never set: a command that never returns (the probe's timeout ends it)

    stuck = Probe("stuck", "stuck", lambda c: "true", _echo_judge, needs=("connection",), timeout_s=0.3)
    report = asyncio.run(run_probes(StuckRunner(), "h", context(), catalog=[probe("connection"), stuck]))
    r = {x.id: x for x in report.results}["stuck"]
    assert r.status is Status.ERROR
    assert "the transport did not return within 0.5 s" in r.summary


def test_judge_exception_is_error_never_pass():
    def broken(res, inp):
        return {"a": 1}["missing"]

    bad = Probe("bad", "bad judge", lambda c: "echo hi", broken, needs=("connection",))
    r = run_local(context(), catalog=[probe("connection"), bad])["bad"]
    assert r.status is Status.ERROR
    assert r.summary == "the judge of bad raised: KeyError: 'missing'"
    assert "Traceback" in r.data["traceback"]
    assert r.stdout.strip() == "hi"


def test_transport_error_mid_run_is_error():
    class LostRunner:
        async def run(self, command, *, timeout, stdin=None):
            if command.startswith("id -un"):
                return CommandResult(command, 0, "me\nbox\nLinux 6\n", "", 0.0)
            raise ConnectionResetError("connection reset by peer")

    p = Probe("p", "p", lambda c: "true", _echo_judge, needs=("connection",))
    report = asyncio.run(run_probes(LostRunner(), "h", context(), catalog=[probe("connection"), p]))
    r = report.results[1]
    assert r.status is Status.ERROR
    assert r.summary == "could not run the command: ConnectionResetError: connection reset by peer"


@pytest.mark.parametrize("kind,status,label", [
    ("unreachable", Status.ERROR, "unreachable"),
    ("timeout", Status.ERROR, "unreachable (timed out)"),
    ("auth", Status.FAIL, "authentication failed"),
    ("host_key", Status.FAIL, "host key not verified"),
])
def test_connect_failure_reported_on_connection_probe(kind, status, label):
    failure = ConnectFailure(kind, "cannot reach h (1.2.3.4:22): Connection refused", 0.1)
    report = asyncio.run(run_probes(None, "h", context(), connect_failure=failure))
    res = {r.id: r for r in report.results}
    conn = res["connection"]
    assert conn.status is status
    assert conn.summary == f"{label}: cannot reach h (1.2.3.4:22): Connection refused"
    assert conn.data["kind"] == kind
    assert conn.data["reachable"] is (kind not in ("unreachable", "timeout"))
    assert res["host.python"].summary == f"needs connection, which is {status.value}"
    assert all(r.status is Status.SKIP for r in report.results if r.id != "connection")
    assert report.exit_code() == 1


def test_probes_run_concurrently(tmp_path):
    # four 1 s sleeps under one runner: concurrent means all four start before any ends (checked by ordering,
    # not by timing): each probe records when it started and ended in a shared file.
    log = str(tmp_path / "events")
    cmds = [Probe(f"s{i}", "s", (lambda i: lambda c: f"echo start{i} >> {shlex.quote(log)}; sleep 1; "
                                                     f"echo end{i} >> {shlex.quote(log)}")(i),
                  lambda res, inp: Verdict(Status.PASS, "ok"), needs=("connection",)) for i in range(4)]
    run_local(context(), catalog=[probe("connection")] + cmds)
    events = open(log).read().split()
    first_end = min(i for i, e in enumerate(events) if e.startswith("end"))
    assert sum(e.startswith("start") for e in events[:first_end]) == 4


def test_catalog_rules():
    ids = [p.id for p in CATALOG]
    assert len(ids) == len(set(ids))
    seen = set()
    for p in CATALOG:  # dependencies come earlier: no cycles, no waiting on a later probe
        assert set(p.needs) <= seen, p.id
        assert set(p.uses) <= set(ids), p.id
        seen.add(p.id)
    ctx = context(has_config=True, run_dir="/r/it's here", model="/m/a b", prompts=("/p/x y.jsonl", "~/q/*.jsonl"),
                  gpus=(0, 1), tokenizer="/t/$(rm -rf x)")
    from probes.host import script

    for p in probes_for(ctx):
        cmd = p.command(ctx)
        assert "/dev/null" not in cmd and "DEVNULL" not in cmd, p.id
        argv = shlex.split(cmd)  # well-formed shell quoting
        if p.script:
            assert argv[:3] == [ctx.python, "-c", script(p.script)]
    model_cmd = probe("model.dir").command(ctx)
    assert "/t/$(rm -rf x)" in shlex.split(model_cmd)[3]  # the $(...) stays inside a quoted argument
    for name in ("pyinfo", "packages", "nvml", "torch_cuda", "model_dir", "prompts", "ports", "resume"):
        src = script(name)
        assert "DEVNULL" not in src and "2>/dev/null" not in src
        assert "except Exception:\n        pass" not in src and "except:" not in src


def test_config_free_selection_only_and_unknown():
    free = [p.id for p in probes_for(context())]
    assert free == ["connection", "host.python", "packages", "gpu.nvidia_smi", "gpu.nvml", "cuda.torch", "disk.home",
                    "disk.shm"]
    cfg = context(has_config=True)
    assert "disk.home" not in [p.id for p in probes_for(cfg)]
    assert [p.id for p in probes_for(cfg, {"gpu"})] == ["connection", "host.python", "gpu.nvidia_smi", "gpu.nvml"]
    assert [p.id for p in probes_for(cfg, {"prompts.tokens"})] == [
        "connection", "host.python", "model.dir", "prompts.paths", "prompts.format", "prompts.tokens"]
    with pytest.raises(UnknownProbe, match="unknown probe 'gpus'"):
        probes_for(cfg, {"gpus"})
    with pytest.raises(UnknownProbe, match=r"probe 'model.dir' needs a run config \(--config run.toml\)"):
        probes_for(context(), {"model.dir"})


def test_render_shows_evidence_for_non_pass():
    report = asyncio.run(probe_local(context(), {"gpu.nvidia_smi", "host.python"}))
    console = Console(record=True, width=120)
    render_report(report, console)
    text = console.export_text()
    assert "FAIL" in text and "gpu.nvidia_smi" in text
    assert "/bin/sh: 1: nvidia-smi: not found" in text
    assert "exit status: 127" in text
    assert "remedy:" in text
    py = {r.id: r for r in report.results}["host.python"]
    assert display_command(py) == f"{py.command.split(' -c ')[0]} -c <probes/host/pyinfo.py>"
    assert text.count("╭") == 1  # only the FAIL gets a detail block


def test_default_probes_lists_the_exact_commands():
    from probes.catalog import default_probes

    cmds = {p.id: p.command for p in default_probes()}
    assert cmds["connection"] == "id -un && uname -n && uname -srm"
    assert cmds["gpu.nvidia_smi"].startswith(
        "nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv,noheader,nounits")
    assert cmds["host.python"].startswith("python3 -c ")
