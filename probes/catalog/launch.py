"""Probes of what a run's launch needs: its worker ports free, its run dir new or resumable.
"""
from __future__ import annotations

from probes.catalog.output import (
    ScriptOutputError,
    script_error_verdict,
    script_json,
)
from probes.catalog.probe import Findings, JudgeInput, Verdict
from probes.model import CommandResult, Status

PLAN_RECORD = "tuning.json"  # the engine's TUNING_FILE (engine/store/run_dir.py): probes never import the engine

# ---------------------------------------------------------------------------------------------- ports, run dir


def judge_ports(res: CommandResult, inp: JudgeInput) -> Verdict:
    try:
        info = script_json(res, "ports")
    except ScriptOutputError as exc:
        return script_error_verdict(exc, inp.ctx)
    ports = info.get("ports", [])
    f = Findings()
    for p in ports:
        if p["free"]:
            continue
        holders = p.get("holders") or []
        if holders and all(h.get("run_worker") for h in holders):
            # never "stop that process": it is this run's own server, and the run is live (run_dir.resume says so)
            f.warn(f"port {p['port']} on {info['host']} is held by this run's own server "
                   f"{holders[0]['run_worker']} (pid {holders[0]['pid']}): the run is live",
                   "watch it with `regen status` / `regen tui`; to start it again, `regen stop` it first")
            continue
        who = ", ".join(f"pid {h['pid']} ({h['cmdline']})" for h in holders) or (p.get("holders_note") or "holder unknown")
        f.fail(f"port {p['port']} on {info['host']} is busy ({p['error']}); held by {who}",
               "stop that process or set workers.base_port to a free range")
    first, last = inp.ctx.base_port, inp.ctx.base_port + len(ports) - 1
    return f.verdict(f"ports {first}..{last} free on {info.get('host')}",
                     expected=f"{len(ports)} worker port(s) {first}..{last} free on {info.get('host')}",
                     actual=", ".join(f"{p['port']} {'free' if p['free'] else 'busy'}" for p in ports), data=info)


def changed_fields(old: dict, new: dict) -> list[str]:
    changed = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += [f"{key}.{k} {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            changed.append(f"{key} {a!r} -> {b!r}")
    return changed


def judge_resume(res: CommandResult, inp: JudgeInput) -> Verdict:
    try:
        info = script_json(res, "run dir")
    except ScriptOutputError as exc:
        return script_error_verdict(exc, inp.ctx)
    ctx = inp.ctx
    rd = info.get("run_dir")
    expected = "a new run dir, or one started with the same content fields (same hash)"
    if info.get("exists") is False:
        return Verdict(Status.PASS, f"new run: {rd} does not exist yet", expected, info.get("stat_error", ""),
                       data=dict(info, mode="new"))
    if info.get("exists") is None:
        return Verdict(Status.FAIL, f"cannot stat {rd}: {info.get('error')}", expected, data=info)
    if not info.get("is_dir"):
        return Verdict(Status.FAIL, f"{rd} exists and is not a directory", expected,
                       remedy="choose another run_dir", data=info)
    f = Findings()
    if info.get("error"):
        f.fail(f"cannot list {rd}: {info['error']}")
    if not info.get("writable"):
        f.fail(f"{rd} is not writable by this user")
    own = ""  # the console asking is attached to this run: its live supervisor is the run's own, not a rival
    if info.get("supervisor_alive"):
        if ctx.attached:
            own = f"this run's supervisor (pid {info['supervisor_pid']}) runs it"
        else:
            f.fail(f"a supervisor (pid {info['supervisor_pid']}) already runs this run dir {rd}",
                   "watch it with `regen status` / `regen tui`, or `regen stop` it before starting it again")
    if info.get("db_error"):
        f.fail(f"{rd}/state.sqlite: {info['db_error']}")
    stored = info.get("content_hash")
    mode = "new"
    if not info.get("state_db") and not info.get("run_toml"):
        # `regen plan --pilot` records its tuning choice in a new run dir for the start (engine/store/run_dir.py)
        planned = PLAN_RECORD in info.get("entries", [])
        if (info.get("entry_count") or 0) - planned and not info.get("deployed"):
            f.fail(f"{rd} is not empty and is not a regen run dir (no state.sqlite or run.toml; it has "
                   f"{', '.join(info.get('entries', [])[:8])})", "choose an empty or new directory")
        summary = f"new run: {rd} exists and is empty" + (f" but for the pilot's {PLAN_RECORD}" if planned else "")
    elif stored is None:
        summary = f"{rd} has no content hash recorded yet: starting records it (new run)"
    elif ctx.content_hash is None or stored == ctx.content_hash:
        mode = "resume"
        summary = f"resumable: {rd} was started with the same content (hash {stored[:12]}); " \
                  f"{info.get('samples_committed', 0)} samples committed"
    else:
        changes = changed_fields(info.get("content_fields") or {}, ctx.content_fields)
        from_model = [c for c in changes if c.split(" ")[0] in {f"sampling.{k}" for k in ctx.sampling_from_model}]
        changes = [c for c in changes if c not in from_model]
        note = (f" ({', '.join(c.split(' ')[0] for c in from_model)}: taken from the model's generation_config.json "
                "on the host at the start, checked there)") if from_model else ""
        if not changes:
            mode = "resume"
            summary = f"resumable: {rd}; {info.get('samples_committed', 0)} samples committed{note}"
        elif not info.get("samples_committed"):
            mode = "changed-empty"
            summary = (f"{rd} has no committed sample: the changed config is taken (changed: {', '.join(changes)})"
                       f"{note}")
        else:
            mode = "changed"
            f.fail(f"not resumable: {rd} was started with another config and has {info.get('samples_committed')} "
                   f"samples committed; changed: {', '.join(changes)}{note}",
                   "set run_dir to a new directory to start over with these values, or revert these fields to resume")
            summary = ""
    if own and mode == "resume":
        mode, summary = "live", f"live: {own}; {info.get('samples_committed', 0)} samples committed"
    return f.verdict(summary, expected=expected, actual=f"stored hash {stored}, config hash {ctx.content_hash}",
                     data=dict(info, mode=mode))
