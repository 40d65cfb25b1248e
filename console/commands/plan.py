"""`regen plan HOST --config run.toml [--pilot N]`: shard plan and GPU-time / wall-time / disk projection.
HOST `local` runs engine.plan.projection here; another host gets the config copied to a temp file and runs
`<host_python> -m engine.plan.projection --config ... --json` there; its JSON is decoded as engine.api.reports.Plan.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import uuid
from pathlib import Path
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from console.host.hints import cannot_reach
from console.host.ssh_options import SshOptions, add_ssh_options
from console.host.transport import TransportError, quote_argv
from console.host.connect import open_transport
from engine.api.reports import BrakePlan, CutPolicyProjection, Plan, Range, SlurmPlan
from engine.api.wire import WireError, duration_text
from console.view.tuning_text import plan_lines
from console.view.wide_console import report_console

EXIT_OK, EXIT_FAILED = 0, 2
PLAN_TIMEOUT_S = 3600.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Shard plan (conversations, samples per turn mode, shards), prompt token counts from a sample, "
                     "and the projection of output tokens, GPU-hours, wall time and disk. Without --pilot the "
                     "throughput and output length are the config's [plan] assumptions (marked 'assumed'); with "
                     "--pilot N they are measured on live workers (outputs are not written into the run). "
                     "Exit status: 0 plan made, 2 it could not be made (config, prompts, tokenizer, workers).")
    p.add_argument("host", help="ssh alias, user@host[:port], or local")
    p.add_argument("--config", required=True, help="run config (TOML) on this machine")
    p.add_argument("--pilot", type=int, default=0, metavar="N",
                   help="measure on N prompts with live workers first (raised, with a note, to what keeps each "
                        "server's batch full)")
    p.add_argument("--sample", type=int, default=None, metavar="N", help="conversations tokenized (default [plan])")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (schema regen.plan/1)")
    add_ssh_options(p)


def run(args: argparse.Namespace) -> int:
    from engine.config.load import ConfigError, load_config

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        if args.json:
            sys.stdout.write(json.dumps({"schema": "regen.plan/1", "error": str(exc), "config_errors": exc.to_dict()},
                                        indent=2) + "\n")
        print(f"regen plan: {exc}\nno plan made (check the file alone with `regen config check {args.config}`)",
              file=sys.stderr)
        return EXIT_FAILED
    if args.host == "local":
        from engine.plan.projection import make_plan
        from engine.plan.prompts import PlanError

        try:
            plan = make_plan(cfg, pilot=args.pilot, sample_conversations=args.sample)
        except PlanError as exc:
            print(f"regen plan: {exc}", file=sys.stderr)
            return EXIT_FAILED
        data = plan.to_dict()
    else:
        try:
            data = asyncio.run(_remote_plan(args, cfg))
            plan = Plan.from_dict(data, f"{args.host}: the plan report")
        except (RemotePlanError, WireError) as exc:
            print(f"regen plan: {exc}", file=sys.stderr)
            return EXIT_FAILED
    if args.json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        render(plan, report_console(highlight=False))
    return EXIT_OK


class RemotePlanError(Exception):
    pass


async def _remote_plan(args: argparse.Namespace, cfg) -> dict[str, Any]:
    try:
        transport = await open_transport(args.host, **SshOptions.from_args(args).connect_kwargs())
    except TransportError as exc:
        raise RemotePlanError(cannot_reach(args.host, exc, args)) from exc
    remote_cfg = f"/tmp/regen-plan-{uuid.uuid4().hex[:12]}.toml"
    try:
        try:
            await transport.put(Path(args.config), remote_cfg)
        except (TransportError, OSError) as exc:
            raise RemotePlanError(f"cannot copy {args.config} to {args.host}:{remote_cfg}: {exc}") from exc
        engine = shlex.quote(f"{cfg.run_dir.rstrip('/')}/.regen/engine")
        argv = [cfg.host_python, "-m", "engine.plan.projection", "--config", remote_cfg, "--json"]
        if args.pilot:
            argv += ["--pilot", str(args.pilot)]
        if args.sample:
            argv += ["--sample", str(args.sample)]
        command = (f"if [ -d {engine} ]; then PYTHONPATH={engine}${{PYTHONPATH:+:$PYTHONPATH}}; export PYTHONPATH; fi; "
                   f"{quote_argv(argv)}; status=$?; rm -f -- {shlex.quote(remote_cfg)}; exit $status")
        result = await transport.run(command, timeout=PLAN_TIMEOUT_S)
    finally:
        await transport.close()
    if result.error or result.timed_out:
        raise RemotePlanError(f"{args.host}: `{command}` did not complete: {result.error or 'timed out'}")
    lines = result.stdout.strip().splitlines()
    try:
        data = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise RemotePlanError(f"{args.host}: `{command}` exited {result.exit_status} without a JSON plan; "
                              f"stderr: {result.stderr.strip() or '(empty)'}")
    if "error" in data:
        raise RemotePlanError(f"{args.host}: {data['error']}")
    data["config"] = args.config  # the operator's file, not the temp copy the host read (and removed)
    return data


# --- rendering -------------------------------------------------------------------------------


def _si(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def _bytes(x: float) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def _hours(x: float) -> str:
    return f"{x:,.1f}" if x >= 10 else f"{x:.3g}"


def render(d: Plan, console: Console) -> None:
    sp, pt, pr = d.shard_plan, d.prompt_tokens, d.projection
    console.print(Text(f"regen plan  {d.config or ''}  run dir {d.run_dir}", style="bold"))
    t = Table(title="shard plan", header_style="bold")
    t.add_column("item")
    t.add_column("value", justify="right")
    t.add_row("conversations", f"{sp.conversations:,}")
    t.add_row("rejected rows", f"{sp.rejects:,}" + (f" ({', '.join(f'{k}: {v}' for k, v in sp.rejects_by_reason.items())})"
                                                     if sp.rejects_by_reason else ""))
    for mode, n in sp.samples_by_mode.items():
        t.add_row(f"samples if turns = {mode}" + (" (configured)" if mode == sp.turn_mode else ""), f"{n:,}")
    t.add_row("shards", f"{sp.shards:,} x {sp.shard_size:,} conversations (last: {sp.last_shard_conversations:,})")
    for src, n in sp.sources.items():
        t.add_row(f"  source {src}", f"{n:,}")
    console.print(t)
    if d.sampling:
        st = Table(title="sampling sent with every request", header_style="bold")
        for col in ("key", "value", "from"):
            st.add_column(col, justify="right" if col == "value" else "left")
        for key, v in d.sampling.items():
            st.add_row(key, str(v.value), v.source)
        console.print(st)
        if d.sampling_note:
            console.print(f"[dim]{d.sampling_note}[/dim]")
    if pt.mean is not None:
        console.print(f"prompt tokens ({pt.samples_sampled:,} prompts of {pt.conversations_sampled:,} sampled "
                      f"conversations): mean {pt.mean:.0f}, p50 {pt.p50:.0f}, p90 {pt.p90:.0f}, "
                      f"p99 {pt.p99:.0f}, max {pt.max:,}  [dim]({pt.note})[/dim]")
    ctx = d.context
    if ctx:
        console.print(Text(f"context {ctx.context_length:,} ({ctx.context_source}): prompts of "
                           f"{ctx.input_limit:,} tokens or more are refused; {ctx.rendered:,} prompts rendered "
                           f"({ctx.how}): {ctx.over_limit:,} over, {ctx.capped:,} leave less than "
                           f"max_new_tokens {ctx.max_new_tokens:,}", style="dim"))
    for warning in d.warnings:
        console.print(Text("WARN ", style="bold yellow") + Text(warning))
    if d.pilot:
        p = d.pilot
        asked = (f"{p.requested} asked, {p.needed} fill the batches" if p.requested != p.prompts
                 else f"{p.needed} fill the batches")
        wt = Table(title=f"pilot: {p.prompts} prompts ({asked}) in {p.wall_s:.1f} s", header_style="bold")
        for col in ("worker", "batch (source)", "in flight", "batch reached", "requests", "tokens", "full-batch s",
                    "tokens/s"):
            wt.add_column(col, justify="right" if col != "worker" else "left")
        for w in p.workers:
            wt.add_row(w.url, f"{w.batch} ({w.batch_source})", str(w.in_flight), str(w.batch_reached),
                       str(w.requests), f"{w.completion_tokens:,}", f"{w.full_batch_window_s:.1f}",
                       f"{w.tokens_per_s:,.0f}")
        console.print(wt)
        console.print(f"pilot output tokens: mean {p.output_mean:.0f} (95% CI {p.output_mean_ci[0]:.0f}-"
                      f"{p.output_mean_ci[1]:.0f}), p50 {p.output_p50:.0f}, p90 {p.output_p90:.0f}, "
                      f"max {p.output_max:,}; truncated {p.truncated_share:.1%}")
        console.print(f"pilot server logs (on the host, kept for reading): {p.log_dir}", soft_wrap=True)
    if d.tuning:
        for i, line in enumerate(plan_lines(d.tuning, d.run_dir)):
            console.print(Text(line, style="bold" if i == 0 else ""), soft_wrap=True)
    jt = Table(title=f"projection ({pr.workers} workers x {pr.gpus_per_worker} GPU)", header_style="bold")
    for col in ("quantity", "value", "low", "high", "basis"):
        jt.add_column(col, justify="right" if col in ("value", "low", "high") else "left")

    def row(label: str, r: Range, fmt: Callable[[float], str]) -> None:
        assumed = r.basis.startswith("assumed")
        jt.add_row(label, fmt(r.value), fmt(r.low), fmt(r.high), Text(r.basis, style="yellow" if assumed else "dim"))

    row("output tokens / sample", pr.output_tokens_per_sample, lambda x: f"{x:,.0f}")
    row("tokens/s per worker", pr.tokens_per_s_per_worker, lambda x: f"{x:,.0f}")
    row("total output tokens", pr.total_output_tokens, _si)
    row("GPU-hours", pr.gpu_hours, _hours)
    row("wall time (hours)", pr.wall_hours, _hours)
    row("disk for the shards", pr.disk_bytes, _bytes)
    if pr.disk_headroom_bytes:  # only with a free-space figure
        h = pr.disk_headroom_bytes
        jt.add_row("disk left after the run", _bytes(h.value), _bytes(h.low), _bytes(h.high),
                   Text(f"free now {_bytes(pr.disk_free_bytes or 0)} at {pr.disk_free_path}",
                        style="bold red" if h.low < 0 else "dim"))
    files = pr.files
    row("part files per shard, until compacted", files.parts_per_shard, lambda x: f"{x:,.0f}")
    jt.add_row("files the run leaves", f"{files.shards:,}", "", "",
               Text(f"one per shard, ~{files.samples_per_shard:,.0f} samples (compacted)", style="dim"))
    console.print(jt)
    guard = d.runaway
    if guard:
        saved = guard.gpu_hours_saved
        assumed = guard.basis.startswith("assumed")
        head = ("runaway guard: on" if guard.enabled else "runaway guard: off") + f" ({guard.settings})"
        console.print(Text(head, style="bold"))
        console.print(Text(f"  expected to save {_hours(saved.value)} GPU-hours ({_hours(saved.low)}-"
                           f"{_hours(saved.high)}), {guard.tokens_saved_share:.1%} of the output tokens; "
                           f"loops {guard.loop_share:.1%} of answers  [{guard.basis}]",
                           style="yellow" if assumed else ""))
    if d.turns_after_cut:
        console.print(cut_policy_line(d.turns_after_cut))
    console.print(f"[dim]bytes per token: prompt {pr.bytes_per_prompt_token:.2f}, output "
                  f"{pr.bytes_per_output_token:.2f} ({pr.bytes_per_token_basis})[/dim]")
    if d.assumptions.used:
        console.print("[yellow]assumed[/yellow]: output tokens per sample "
                      f"{d.assumptions.output_tokens_per_sample:,.0f}, tokens/s per GPU "
                      f"{d.assumptions.tokens_per_s_per_gpu:,.0f} (set them in \\[plan] of the run config, "
                      "or measure with --pilot N)")
    if d.brake:
        console.print(brake_line(d.brake))
    if d.slurm:
        slurm_lines(d.slurm, console)
    for note in d.notes:
        console.print(f"[yellow]note:[/yellow] {note}")


def slurm_lines(s: SlurmPlan, console: Console) -> None:
    """The jobs regen submits, word for word, and how many allocations in a row each needs."""
    console.print(Text(f"slurm: {s.layout}", style="bold"), soft_wrap=True)
    limit = f"time limit {duration_text(s.time_limit_s)}, hand-over {s.handover_s} s before it"
    if s.allocations is None:
        console.print(f"  {limit}", soft_wrap=True)
    else:
        console.print(f"  {limit}: the run ({duration_text(s.projected_wall_s)} at the projection's high end) "
                      f"needs {s.allocations} allocation(s) per job in a row, {s.allocations * s.groups} "
                      "sbatch submissions in all (each next one queued before the last one's time is up)", soft_wrap=True)
    if s.time_min_s is not None:
        console.print(f"  time_min {duration_text(s.time_min_s)}: Slurm's backfill may start a job in a shorter idle "
                      f"window, with a limit down to it; such a job serves {duration_text(s.time_min_s - s.handover_s)}"
                      " before its hand-over", soft_wrap=True)
    console.print("  regen start submits, one job per server group:")
    for line in s.sbatch:
        console.print(Text("    " + line), soft_wrap=True)
    console.print("  each job's step (the --wrap above), on every node of its group:")
    for line in s.srun:
        console.print(Text("    " + line), soft_wrap=True)
    handover_lines(s, console)


def handover_lines(s: SlurmPlan, console: Console) -> None:
    """When each group hands over: its first --time staggered so no two groups drain together."""
    if not s.handovers:
        return
    console.print(f"  hand-overs, from the first submission (the groups' first limits {duration_text(s.spacing_s)} apart, "
                  f"so no two drain together; assuming a {duration_text(s.assumed_queue_wait_s)} queue wait and "
                  f"{duration_text(s.assumed_load_s)} load, which the run measures and uses instead):", soft_wrap=True)
    for g in range(s.groups):
        said = [f"job {h.job + 1} (--time {duration_text(h.time_limit_s)}): next job submitted at "
                f"{duration_text(h.submit_s)}, serving at {duration_text(h.switch_s)}, drain by {duration_text(h.drain_s)}"
                for h in s.handovers if h.group == g]
        if said:
            console.print(f"    group {g}: " + "; ".join(said), soft_wrap=True)


def cut_policy_line(c: CutPolicyProjection) -> Text:
    """turns_after_cut: the later turns "stop" does not generate after a cut turn, from the pilot."""
    stop = c.policy == "stop"
    head = f"turns after a cut turn: {c.policy} (turns_after_cut)"
    if c.cut_share is None:
        return Text(f"{head}: not estimated [{c.basis}]", style="dim" if not c.later_turns else "yellow")
    saved = c.gpu_hours_saved
    verb = "saves" if stop else "would save (with stop)"
    return Text(f"{head}: {verb} ~{c.skipped:,.0f} later turns ({c.skipped_share:.1%} of the samples), "
                f"{_hours(saved.value)} GPU-hours ({_hours(saved.low)}-{_hours(saved.high)}); "
                f"{c.cut_share:.1%} of the pilot's answers cut  [{c.basis}]")


def brake_line(b: BrakePlan) -> Text:
    """[brake]: when the run pauses itself on bad data."""
    if not b.enabled:
        return Text("data-quality brake: off ([brake] enabled = false): a run producing bad answers keeps running",
                    style="yellow")
    levels = []
    for lv in b.levels:
        name = lv.reason.replace("_", " ")
        if not lv.judged:
            levels.append(f"{name} not judged (enable_thinking = false)")
        elif lv.level >= 1:
            levels.append(f"{name} never")
        else:
            alert = f", alert at {lv.alert:.0%}" if lv.alert is not None else ""
            levels.append(f"{name} over {lv.level:.0%}{alert}")
    return Text(f"data-quality brake: dispatch pauses run-wide when, over the last {b.window:,} committed samples "
                f"(from {b.min_samples:,} on), {'; '.join(levels)}; `regen resume --all` continues ([brake])")
