"""Preflight of a host: the probe contexts a run config asks for (dispatch host, GPU hosts, Slurm) and one host's
probes run over its transport. `regen probe`, `regen start` and the TUI's Preflight tab all run them through here."""
from __future__ import annotations

import asyncio
import dataclasses
import shlex
import time
from typing import TYPE_CHECKING, Any

from console.host.ssh_options import SshOptions
from console.host.transport import Transport
from engine.config.load import MODEL_SAMPLING_KEYS, RunConfig
from probes.context import GIB, ProbeContext, SlurmAsk
from probes.model import ProbeReport
from probes.runner import ConnectFailure, run_probes

if TYPE_CHECKING:
    from probes.catalog.probe import Probe


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
                    constraint=s.constraint, time_min_s=s.time_min_s)


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
    from console.host.transport import TransportError
    from console.host.connect import open_transport

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

    from engine.config.load import host_workers

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


def ssh_config_of(options: tuple[str, ...], default: str | None) -> str | None:
    for i, opt in enumerate(options[:-1]):
        if opt == "-F":
            return options[i + 1]
    return default


async def fleet_probes(transport: Transport | None, host: str, cfg: RunConfig, only: set[str] | None,
                       catalog: list[Probe], ssh: SshOptions) -> ProbeReport:
    """A multi-host run: the dispatch host's probes (over `transport`) and each [[hosts]] entry's, in one report whose
    ids are <host>:<probe> (the dispatch host's stay bare)."""
    dispatch_ctx, per_host = host_contexts(cfg)
    wanted: dict[str, set[str] | None] = {"": None, **{h.name: None for h in cfg.hosts}}
    if only:
        picked: dict[str, set[str]] = {}
        for pid in only:
            name, _, probe = pid.rpartition(":")
            picked.setdefault(name, set()).add(probe)
        wanted = {name: probes for name, probes in picked.items()}
    started = time.time()

    async def dispatch() -> ProbeReport:
        return await run_probes(transport, host, dispatch_ctx, wanted[""] or DISPATCH_PROBES, catalog=catalog)

    async def one(h: Any) -> ProbeReport:
        report, _ = await probe_host(h.address, per_host[h.name], wanted[h.name] or GPU_HOST_PROBES,
                                     ssh_config=ssh_config_of(h.ssh_options, ssh.ssh_config), accept_new=ssh.accept_new)
        return report

    remote = [h for h in cfg.hosts if h.name in wanted and not h.is_local]
    jobs = ([dispatch()] if "" in wanted else []) + [one(h) for h in remote]
    reports = await asyncio.gather(*jobs)
    results = list(reports[0].results) if "" in wanted else []
    for h, report in zip(remote, reports[1:] if "" in wanted else reports):
        for r in report.results:
            r.id, r.title = f"{h.name}:{r.id}", f"{h.name}: {r.title}"
            results.append(r)
    return ProbeReport(host=f"{host} + {len(remote)} hosts", results=results, started_at=started,
                       duration_s=time.time() - started)
