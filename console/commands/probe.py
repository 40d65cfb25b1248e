"""`regen probe HOST [--config run.toml] [--json] [--only ID,...]`: can this run start on that host, and if not, why.

With a multi-host config ([[hosts]]) HOST is the dispatch host (run dir, prompts, tokenizer,
sglang-router) and every [[hosts]] entry is probed too, concurrently, for what its servers need
(python packages, GPUs, CUDA, model dir, shared memory, its work dir's disk, its ports); the
report has one section per host.

With --config, the first probe is `config`: the file against the schema (FAIL: one line per error, and no host
probe runs) and, when it passes, the effective sampling and template values with where each came from.

Exit status: 0 no FAIL/ERROR, 1 some FAIL/ERROR (an invalid config included), 2 could not run at all (unknown
probe id, host not reached: the report is still printed, with the connection probe saying why).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time

from rich.console import Console

from console.config_probe import CONFIG_PROBE, config_failed_report, config_passed
from console.hints import typed_again
from console.ssh_options import add_ssh_options
from engine.config import MODEL_SAMPLING_KEYS, ConfigError, RunConfig, load_config
from probes.catalog import PROBE_IDS, UnknownProbe, probes_for
from probes.context import GIB, ProbeContext, SlurmAsk
from probes.model import ProbeReport
from probes.render import render_report
from probes.runner import ConnectFailure, run_probes


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


def slurm_ask(cfg: RunConfig) -> SlurmAsk | None:
    """What the run asks of the Slurm cluster, with the exact `sbatch --test-only` of its first job."""
    if cfg.slurm is None:
        return None
    from engine.placement.slurm.plan import layout_of, sbatch_argv

    s, layout = cfg.slurm, layout_of(cfg)
    return SlurmAsk(partition=s.partition, gpus_per_node=s.gpus_per_node, nodes=layout.nodes_low,
                    nodes_per_job=layout.nodes_per_group, time_limit=s.time_limit, time_limit_s=s.time_limit_s,
                    handover_s=s.handover_s, ready_timeout_s=float(cfg.workers.ready_timeout_s),
                    test_command=shlex.join(sbatch_argv(cfg, 0, test_only=True)), account=s.account, qos=s.qos,
                    constraint=s.constraint)


def context_from_config(cfg: RunConfig) -> ProbeContext:
    # with [slurm] HOST is the login node: no GPUs of its own, the router runs there
    gpus = () if cfg.slurm is not None else tuple(cfg.workers.gpus)
    return ProbeContext(
        python=cfg.host_python, has_config=True, config_path=cfg.source_path, run_dir=cfg.run_dir, model=cfg.model,
        tokenizer=cfg.tokenizer_path, prompts=tuple(cfg.prompts), prompt_format=cfg.prompt_format, turns=cfg.turns,
        enable_thinking=cfg.enable_thinking, tp_size=cfg.workers.tp_size, gpus=gpus, base_port=cfg.workers.base_port,
        bind_host=cfg.workers.host, context_length=cfg.context_length, max_new_tokens=cfg.sampling.max_new_tokens,
        disk_floor_bytes=int(cfg.alerts.disk_free_min_gb * 10**9), shm_need_bytes=GIB * max(1, len(gpus)),
        content_hash=cfg.content_hash(), content_fields=cfg.content_fields(), launch=cfg.workers.launch,
        launch_args=tuple(cfg.workers.extra_args), sampling_seed=cfg.sampling.seed,
        sampling_from_model=tuple(k for k in MODEL_SAMPLING_KEYS if k not in cfg.sampling.model_fields_set),
        slurm=slurm_ask(cfg),
        router_python=(cfg.router.python or cfg.host_python) if cfg.slurm is not None else None,
    )


async def probe_host(host: str, ctx: ProbeContext, only: set[str] | None, *, accept_new: bool = False,
                     timeout_s: float | None = None, ssh_config: str | None = None,
                     accept_new_command: str | None = None) -> tuple[ProbeReport, bool]:
    """The report, and whether the host was reached. accept_new_command: the remedy shown for a host not yet
    in known_hosts (the operator's command line again, with --accept-new)."""
    import dataclasses

    from console.transport import TransportError, open_transport

    if timeout_s is not None:  # each probe's command is cut at timeout_s: the prompt scans stop well before it
        ctx = dataclasses.replace(ctx, scan_budget_s=min(ctx.scan_budget_s, SCAN_SHARE_OF_TIMEOUT * timeout_s))
    t0 = time.monotonic()
    try:
        transport = await open_transport(host, accept_new=accept_new, connect_timeout=timeout_s or 10.0,
                                         ssh_config=ssh_config)
    except TransportError as exc:
        failure = ConnectFailure(exc.kind, str(exc), time.monotonic() - t0)
        report = await run_probes(None, host, ctx, only, connect_failure=failure, timeout_s=timeout_s)
        report.connect_s = failure.duration_s
        if exc.unknown_host_key and accept_new_command:
            for r in report.results:
                if r.id == "connection":
                    r.remedy = f"if that fingerprint is {host}'s, record it and go on with: {accept_new_command}"
                    r.data["accept_new_command"] = accept_new_command
        return report, False
    connect_s = time.monotonic() - t0
    try:
        report = await run_probes(transport, host, ctx, only, timeout_s=timeout_s)
    finally:
        await transport.close()
    report.connect_s = connect_s
    for r in report.results:
        if r.id == "connection":
            r.data["connect_s"] = round(connect_s, 3)
    return report, True


# with --timeout S, the prompt probes read rows for at most this share of S (then say how far they read), leaving the
# rest for the tokenizer and the reply: a scan cut by the timeout would say nothing at all
SCAN_SHARE_OF_TIMEOUT = 0.6
DISPATCH_PROBES = {"prompts", "disk.run_dir", "run_dir.resume", "router.package", "model.dir"}
SLURM_PROBES = {"slurm"}
GPU_HOST_PROBES = {"packages", "sampling.seed", "gpu", "cuda.torch", "disk.run_dir", "disk.shm", "model.dir", "model.weights", "ports"}


def host_contexts(cfg: RunConfig) -> tuple[ProbeContext, dict[str, ProbeContext]]:
    """The dispatch host's context and one per [[hosts]] entry (a local host's GPUs probed with the dispatch host)."""
    import dataclasses

    from engine.config import host_workers

    base = context_from_config(cfg)
    dispatch = dataclasses.replace(base, gpus=(), router_python=cfg.router.python or cfg.host_python)
    per_host = {}
    for h in cfg.hosts:
        w = host_workers(cfg, h)
        per_host[h.name] = dataclasses.replace(
            base, python=h.host_python, run_dir=h.work_dir, prompts=(), gpus=tuple(w.gpus), tp_size=w.tp_size,
            base_port=w.base_port, bind_host=w.host, shm_need_bytes=GIB * max(1, len(w.gpus)), router_python=None,
            launch=w.launch)
    return dispatch, per_host


def _ssh_config_of(options: tuple[str, ...], default: str | None) -> str | None:
    for i, opt in enumerate(options[:-1]):
        if opt == "-F":
            return options[i + 1]
    return default


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
                     args.ssh_config if h.is_local else _ssh_config_of(h.ssh_options, args.ssh_config)))
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
