"""`regen probe HOST [--config run.toml] [--json] [--only ID,...]`: can this run start on that host, and if not, why.
With [[hosts]] every host is probed too, concurrently; with --config the first probe is `config`. Exit status: 0 no
FAIL/ERROR, 1 some FAIL/ERROR, 2 could not run at all (unknown probe id, host not reached: the report says why)."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys

from rich.console import Console

from console.host.config_probe import CONFIG_PROBE, config_failed_report, config_passed
from console.host.hints import typed_again
from console.host.preflight import (DISPATCH_PROBES, GPU_HOST_PROBES, SLURM_PROBES, context_from_config, host_contexts,
                                    probe_host, ssh_config_of)
from console.host.ssh_options import add_ssh_options
from engine.config.load import ConfigError, RunConfig, load_config
from probes.catalog import PROBE_IDS, UnknownProbe, probes_for
from probes.context import ProbeContext
from probes.model import ProbeReport
from probes.render import render_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("host", metavar="HOST", help="ssh alias, user@host[:port], or `local`")
    p.add_argument("--config", metavar="RUN_TOML", help="run config: adds the model, prompts, ports, disk and "
                   "run dir probes (without it only the config-free probes run)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (schema regen.probe/1)")
    p.add_argument("--only", metavar="ID,...", help="run only these probes (and what they need); an id prefix such "
                   f"as `gpu` selects gpu.*; ids: {', '.join(PROBE_IDS)}")
    add_ssh_options(p)
    p.add_argument("--timeout", type=float, metavar="S", help="timeout of each probe's command (and of connecting), "
                   "instead of each probe's own")


async def probe_fleet(args: argparse.Namespace, cfg: RunConfig, only: set[str] | None, *, per_role: bool = False
                      ) -> list[tuple[str, str, ProbeReport, bool]]:
    """(section name, address, report, reached) for the dispatch host, then each host, probed concurrently.
    per_role: `only` is cut down to what each role runs (the dispatch host's, a GPU host's probes)."""
    dispatch_ctx, per_host = host_contexts(cfg)

    def selection(role: set[str]) -> set[str]:
        if not only:
            return role
        if not per_role:
            return only
        return {p for p in only if p == "connection" or p == "host.python"
                or any(p == r or p.startswith(r + ".") or r.startswith(p + ".") for r in role)} or {"connection"}

    jobs = [("dispatch", args.host, dispatch_ctx, selection(DISPATCH_PROBES), args.ssh_config)]
    for h in cfg.hosts:
        address = args.host if h.is_local else h.address
        jobs.append((h.name, address, per_host[h.name], selection(GPU_HOST_PROBES),
                     args.ssh_config if h.is_local else ssh_config_of(h.ssh_options, args.ssh_config)))
    results = await asyncio.gather(*(
        probe_host(address, ctx, set(sel), accept_new=args.accept_new, timeout_s=args.timeout, ssh_config=ssh_cfg)
        for _, address, ctx, sel, ssh_cfg in jobs))
    return [(name, address, report, reached) for (name, address, *_), (report, reached) in zip(jobs, results)]


def run_fleet(args: argparse.Namespace, cfg: RunConfig, only: set[str] | None) -> int:
    sections = asyncio.run(probe_fleet(args, cfg, only))
    sections[0][2].results.insert(0, config_passed(cfg, sections[0][2], [rep for _, _, rep, _ in sections[1:]]))
    if args.json:
        doc = {"schema": "regen.probe-fleet/1",
               "hosts": [{"name": n, "address": a, "reached": r, "report": rep.to_dict()} for n, a, rep, r in sections]}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        console = Console()
        for name, address, report, reached in sections:
            console.rule(f"[bold]{name}[/] ({address})" + ("" if reached else " [red]not reached[/]"))
            render_report(report, console)
    if not sections[0][3]:
        return 2  # the dispatch host itself was not reached
    # a GPU host not reached is a failed preflight of that host (its connection probe says why)
    return 1 if any(not reached or rep.exit_code() for _, _, rep, reached in sections) else 0


def run(args: argparse.Namespace) -> int:
    if args.config:
        try:
            cfg = load_config(args.config)
        except ConfigError as exc:
            return print_report(args, config_failed_report(args.host, exc), Console())
        ctx = context_from_config(cfg)
    else:
        ctx = ProbeContext()
    only = {s.strip() for s in args.only.split(",") if s.strip() and s.strip() != CONFIG_PROBE} if args.only else None
    if args.config and cfg.slurm is not None and not only:
        only = DISPATCH_PROBES | SLURM_PROBES  # HOST is the login node; the GPU nodes are Slurm's
    try:
        probes_for(ctx, only)
    except UnknownProbe as exc:
        print(f"regen probe: {exc}", file=sys.stderr)
        return 2
    if args.config and cfg.hosts:
        return run_fleet(args, cfg, only)
    report, reached = asyncio.run(probe_host(args.host, ctx, only, accept_new=args.accept_new, timeout_s=args.timeout,
                                             ssh_config=args.ssh_config,
                                             accept_new_command=typed_again(args, accept_new=True)))
    if args.config:
        report.results.insert(0, config_passed(cfg, report))
    print_report(args, report, Console())
    if args.config and not args.json:
        print("effective sampling (where each value comes from):\n  " + "\n  ".join(
            report.results[0].actual.splitlines()))
    if not reached:
        retry = next((r.data.get("accept_new_command") for r in report.results if r.id == "connection"), None)
        if retry:  # unwrapped, to paste (the report's panel may wrap it)
            print(f"if that fingerprint is {args.host}'s, record it and go on with:\n  {retry}", file=sys.stderr)
        return 2
    return report.exit_code()


def print_report(args: argparse.Namespace, report: ProbeReport, console: Console) -> int:
    """The report as JSON or as the table; its exit code (an invalid config: 1, the `config` probe FAILed)."""
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
    else:
        render_report(report, console)
    return report.exit_code()
