"""Probes of the host itself: the connection, its Python and packages, sampling.seed support, the router package.
"""
from __future__ import annotations

import json
import shlex

from probes.catalog.output import (
    ScriptOutputError,
    json_lines,
    last_line,
    script_error_verdict,
    script_json,
    shell_failure,
)
from probes.catalog.probe import Findings, JudgeInput, Verdict
from probes.context import (
    DETERMINISTIC_FLAG,
    REHEARSAL,
    ProbeContext,
)
from probes.model import CommandResult, Status

MIN_PYTHON = (3, 10)
# (module, distribution) imported by `packages`; sglang last: it imports torch and may crash the interpreter.
# (module, distribution) imported by `packages`; sglang last: it imports torch and may crash the interpreter.
PACKAGES = (
    ("transformers", "transformers"),
    ("pyarrow", "pyarrow"),
    ("psutil", "psutil"),
    ("pynvml", "nvidia-ml-py"),
    ("aiohttp", "aiohttp"),
    ("orjson", "orjson"),
    ("prometheus_client", "prometheus-client"),
    ("sglang", "sglang"),
)


# ---------------------------------------------------------------------------------------------- connection


def judge_connection(res: CommandResult, inp: JudgeInput) -> Verdict:
    if res.exit_status != 0:
        return Verdict(Status.FAIL, shell_failure(res, "`id -un && uname -n && uname -srm`"),
                       expected="a POSIX shell with id and uname", actual=res.stderr.strip(),
                       remedy="check the account's login shell on the host")
    lines = res.stdout.strip().splitlines()
    user, host, kernel = (lines + ["?", "?", "?"])[:3]
    return Verdict(Status.PASS, f"connected as {user}@{host} ({kernel})",
                   data={"user": user, "hostname": host, "kernel": kernel})


# ---------------------------------------------------------------------------------------------- python and packages


def judge_python(res: CommandResult, inp: JudgeInput) -> Verdict:
    py = inp.ctx.python
    expected = f"{py} runs and is Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]}"
    if res.exit_status == 127:
        return Verdict(Status.FAIL, shell_failure(res, py), expected, res.stderr.strip(),
                       remedy=f"install Python >= 3.10 or set host_python in the run config to the SGLang env's python "
                              f"(e.g. /opt/venv/bin/python); `command -v python3` on the host lists what is on PATH")
    try:
        info = script_json(res, "interpreter")
    except ScriptOutputError as exc:
        return Verdict(Status.FAIL, f"{py} did not run the probe script: {exc}", expected, res.stderr.strip(),
                       remedy="set host_python to a Python >= 3.10")
    version = tuple(info.get("version") or ())
    vtext = ".".join(map(str, version))
    venv = info.get("prefix") != info.get("base_prefix")
    where = f"{info.get('executable')}" + (f" (venv {info.get('prefix')})" if venv else "")
    data = dict(info, venv=venv)
    if version[:2] < MIN_PYTHON:
        return Verdict(Status.FAIL, f"{py} is Python {vtext} at {where}: too old", expected, f"Python {vtext}",
                       remedy="point host_python at a Python >= 3.10 (the SGLang env's)", data=data)
    return Verdict(Status.PASS, f"Python {vtext} at {where}", expected, f"Python {vtext}", data=data)


def packages_for(ctx: ProbeContext) -> tuple[tuple[str, str], ...]:
    """(module, distribution) the host env needs: a rehearsal runs the simulator, not sglang."""
    return tuple(p for p in PACKAGES if not (ctx.rehearsal and p[0] == "sglang"))


def packages_in_flight(res: CommandResult) -> str | None:
    records = json_lines(res.stdout)
    done = {r["module"] for r in records if "module" in r}
    hung = next((r["start"] for r in records if "start" in r and r["start"] not in done), None)
    return f"while importing {hung}" if hung else None


def judge_packages(res: CommandResult, inp: JudgeInput) -> Verdict:
    records = json_lines(res.stdout)
    done = {r["module"]: r for r in records if "module" in r}
    started = [r["start"] for r in records if "start" in r]
    finished = any(r.get("done") for r in records)
    wanted = packages_for(inp.ctx)
    expected = "importable in " + inp.ctx.python + ": " + ", ".join(m for m, _ in wanted)
    f = Findings()
    if not finished:
        crashed = next((m for m in started if m not in done), None)
        how = f"exit {res.exit_status}" if res.exit_status is not None else (res.error or "no exit status")
        if crashed:
            f.add(Status.FAIL, f"importing {crashed} crashed the interpreter ({how}): {last_line(res.stderr) or '(no stderr)'}",
                  f"reinstall {crashed} in the host env and try `{inp.ctx.python} -c 'import {crashed}'` by hand")
        else:
            return Verdict(Status.ERROR, f"the package script printed no result ({how}): {last_line(res.stderr)}",
                           expected, res.stderr.strip())
    lines, versions, broken = [], {}, []
    for module, dist in wanted:
        r = done.get(module)
        if r is None:
            lines.append(f"{module}: not checked")
            continue
        if r.get("ok"):
            versions[module] = r.get("version")
            lines.append(f"{module} {r.get('version') or '(version unknown)'}")
        else:
            lines.append(f"{module}: {r['error']}")
            broken.append(dist)
            f.fail(f"{module}: {r['error']}")
    if broken:
        f.fail(f"{len(broken)} of {len(wanted)} not importable", f"install into the host env: {inp.ctx.python} -m pip "
               "install " + " ".join(broken) + " (sglang pins torch and the rest; `pip install 'sglang[all]'`)")
    if len(wanted) < len(PACKAGES):
        lines.append(f"sglang: not needed ({REHEARSAL})")
    ok = ", ".join(f"{m} {versions[m]}" for m in versions)
    return f.verdict(f"all {len(wanted)} importable: {ok}" + ("; sglang not needed (rehearsal)" if inp.ctx.rehearsal
                                                              else ""),
                     expected=expected, actual="\n".join(lines), data={"packages": {m: done.get(m) for m, _ in wanted}})


# ---------------------------------------------------------------------------------------------- seed


def judge_seed(res: CommandResult, inp: JudgeInput) -> Verdict:
    """sampling.seed set: will the servers follow it? (the launch flag, and an sglang that knows the field)"""
    ctx = inp.ctx
    try:
        info = script_json(res, "seed support")
    except ScriptOutputError as exc:
        return script_error_verdict(exc, ctx)
    expected = (f"servers launched with {DETERMINISTIC_FLAG} by an sglang whose SamplingParams take sampling_seed"
                f" (sampling.seed = {ctx.sampling_seed})")
    drop = "or remove sampling.seed from the run config"
    f = Findings()
    if not ctx.seed_honoured_by_launch:
        f.warn(f"the servers will ignore sampling.seed = {ctx.sampling_seed}: SGLang reads a request's sampling_seed"
               f" only with {DETERMINISTIC_FLAG}, which the launch line and workers.extra_args lack",
               f'add "{DETERMINISTIC_FLAG}" to workers.extra_args (SGLang then uses deterministic, slower kernels), '
               + drop)
    where = info.get("sglang") or "sglang"
    if info.get("error"):
        f.fail(f"cannot check sglang: {info['error']}", f"install sglang into {ctx.python}'s env, " + drop)
    if info.get("sampling_seed") is False:
        f.fail(f"{where}: SamplingParams has no sampling_seed (sglang 0.4.x): every request carrying the seed fails"
               " with HTTP 500", "upgrade sglang (0.5.5 or later), " + drop)
    if info.get("deterministic_flag") is False:
        f.fail(f"{where}: ServerArgs has no {DETERMINISTIC_FLAG}: a server launched with it does not start, and"
               " without it the seed is ignored", "upgrade sglang (0.5.5 or later), " + drop)
    for key in ("sampling_seed", "deterministic_flag"):
        if info.get(key + "_error"):
            f.warn(f"{where}: could not read the source that says it: {info[key + '_error']}")
    return f.verdict(f"sampling.seed = {ctx.sampling_seed} is honoured: {DETERMINISTIC_FLAG} in the launch line and"
                     f" {where} takes sampling_seed", expected=expected,
                     actual=json.dumps(info, sort_keys=True), data=info)


# ---------------------------------------------------------------------------------------------- router


def router_command(ctx: ProbeContext) -> str:
    code = "import importlib.metadata as m, sglang_router; print(m.version('sglang-router'))"
    return f"{shlex.quote(ctx.router_python or ctx.python)} -c {shlex.quote(code)}"


def judge_router(res: CommandResult, inp: JudgeInput) -> Verdict:
    python = inp.ctx.router_python or inp.ctx.python
    expected = f"{python} imports sglang_router (the multi-host run's router)"
    if res.exit_status != 0:
        return Verdict(Status.FAIL, shell_failure(res, f"{python} -c 'import sglang_router'"), expected,
                       res.stderr.strip() or res.stdout.strip(),
                       remedy=f"{python} -m pip install sglang-router (on the dispatch host)")
    version = last_line(res.stdout)
    return Verdict(Status.PASS, f"sglang-router {version}", expected, version, data={"version": version})
