"""`regen stats (DIR | HOST:DIR)`: data-quality statistics of a run's shards.
DIR is read on this machine (engine.store.stats.compute_stats); HOST:DIR runs `python -m engine.store.stats DIR --json`
on the host and decodes its JSON as engine.api.reports.RunStats.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from console.host.hints import cannot_reach
from console.host.run_client import RunClientError
from console.host.run_dir_lookup import locate_run_dir
from console.host.remote_engine import (RemoteEngineError, deployed_engine, engine_command, engine_report,
                                        recorded_python)
from console.host.ssh_options import SshOptions, add_ssh_options
from console.host.transport import TransportError
from console.host.connect import open_transport
from console.view.wide_console import report_console
from engine.api.reports import Count, GroupStats, LossMaskStats, RunStats, ShardStats
from engine.api.wire import WireError

EXIT_OK, EXIT_FLAGGED, EXIT_UNREADABLE = 0, 1, 2
REMOTE_TIMEOUT_S = 1800.0
BAR_WIDTH = 40
REPETITION_THRESHOLD = 0.05  # engine.store.stats' default (runaway.alert_share's)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Data-quality statistics of a run's shards (committed parts only): loss-mask sum histogram, empty and "
        "truncated answers, answers stopped as runaway repetition, reasoning present/missing/unterminated, token lengths, supervised tokens kept by a "
        "training cut, by source / worker / shard. Exit status: 0 no quality flag, 1 a quality flag was raised "
        "(empty, truncated or repetition share above its threshold, or an integrity error), 2 the run dir could not be read.")
    p.add_argument("target", metavar="DIR|HOST:DIR", help="a run dir here, or HOST:DIR (HOST: ssh alias, user@host, local)")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON (schema regen.stats/1)")
    p.add_argument("--train-max-length", type=int, default=4096, metavar="N",
                   help="training max length for the cut figures (default 4096)")
    p.add_argument("--empty-threshold", type=float, default=0.05, metavar="SHARE",
                   help="flag when the empty-answer share is above this (default 0.05)")
    p.add_argument("--truncated-threshold", type=float, default=0.10, metavar="SHARE",
                   help="flag when the truncated share is above this (default 0.10)")
    p.add_argument("--repetition-threshold", type=float, default=REPETITION_THRESHOLD, metavar="SHARE",
                   help="flag when the share of answers stopped as runaway repetition is above this (default "
                        f"{REPETITION_THRESHOLD})")
    p.add_argument("--mask-check", choices=("auto", "full", "sample", "off"), default="auto",
                   help="which parts have their loss_mask checked against prompt_len/output_len (default auto: "
                        "all up to 100k samples, else a spread sample of the parts)")
    p.add_argument("--python", default=None, help="python on the host (default: the one `regen start` recorded, else python3)")
    add_ssh_options(p)


def split_target(target: str) -> tuple[str | None, str]:
    """(host, dir): host None for a local path. A path that exists here is always local."""
    if os.path.exists(target):
        return None, target
    m = re.match(r"^(\[[^\]]+\](?::\d+)?|[^/:]+(?::\d+)?|[^/:@]+@[^/:]+):(.+)$", target)
    if m and not target.startswith(("/", ".", "~")):
        return m.group(1), m.group(2)
    return None, target


def run(args: argparse.Namespace) -> int:
    host, run_dir = split_target(args.target)
    if host is None:
        from engine.store.stats import compute_stats
        from engine.store.stats_parts import StatsReadError

        missing = missing_local_dir(run_dir)
        if missing:
            print(f"regen stats: {missing}", file=sys.stderr)
            return EXIT_UNREADABLE
        try:
            stats = compute_stats(Path(run_dir), train_max_length=args.train_max_length,
                                  empty_threshold=args.empty_threshold, truncated_threshold=args.truncated_threshold,
                                  repetition_threshold=args.repetition_threshold, mask_check=args.mask_check)
        except StatsReadError as exc:
            print(f"regen stats: {exc}", file=sys.stderr)  # plain: a wrapped path cannot be copied
            return EXIT_UNREADABLE
        data = stats.to_dict()
    else:
        try:
            data = asyncio.run(_remote_stats(host, run_dir, args))
            stats = RunStats.from_dict(data, f"{host}:{run_dir}: the stats report")
        except (RemoteStatsError, WireError) as exc:
            print(f"regen stats: {exc}", file=sys.stderr)  # plain: a wrapped path cannot be copied
            return EXIT_UNREADABLE
    if args.json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        render(stats, report_console(highlight=False))
    return EXIT_FLAGGED if stats.flags else EXIT_OK


class RemoteStatsError(Exception):
    pass


def missing_local_dir(run_dir: str) -> str | None:
    """Why `run_dir` (on this machine) is not there, with the path looked for; None if it is a directory."""
    path = Path(run_dir).expanduser()
    try:
        if path.is_dir():
            return None
        path.stat()
        return f"{run_dir}: not a run dir (NotADirectoryError: it is a file); looked at {path.absolute()} on this machine"
    except OSError as exc:
        if not isinstance(exc, FileNotFoundError):
            return None  # e.g. a permission error: compute_stats says it with the path
        return (f"{run_dir}: no such run dir ({type(exc).__name__}: {exc.strerror}); looked for {path.absolute()} on "
                f"this machine. For a run on a host give HOST:DIR (e.g. `regen stats gpu1:{run_dir}`)")


async def _remote_stats(host: str, run_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    try:
        transport = await open_transport(host, **SshOptions.from_args(args).connect_kwargs())
    except TransportError as exc:
        raise RemoteStatsError(cannot_reach(host, exc, args)) from exc
    try:
        try:
            run_dir = await locate_run_dir(transport, run_dir)  # absolute; NoSuchRunDir names what it looked for
        except RunClientError as exc:
            raise RemoteStatsError(str(exc)) from exc
        python = args.python or await recorded_python(transport, run_dir) or "python3"
        argv = ["-m", "engine.store.stats", run_dir, "--json", "--train-max-length", str(args.train_max_length),
                "--empty-threshold", str(args.empty_threshold), "--truncated-threshold", str(args.truncated_threshold),
                "--mask-check", args.mask_check]
        if args.repetition_threshold != REPETITION_THRESHOLD:  # an engine deployed before the flag lacks it
            argv += ["--repetition-threshold", str(args.repetition_threshold)]
        data = await engine_report(
            transport, engine_command(python, argv, run_dir=run_dir), where=f"{host}:{run_dir}", timeout=REMOTE_TIMEOUT_S,
            no_engine=f"not a run dir started by `regen start` (checked {deployed_engine(run_dir)}: no engine deployed "
                      f"there) and {python} on {host} cannot import engine (ModuleNotFoundError). Check the run dir "
                      f"(`regen start` printed it: started: ... on HOST:DIR), or pass --python PY, a python on {host} "
                      "with regen installed")
    except RemoteEngineError as exc:
        raise RemoteStatsError(str(exc)) from exc
    finally:
        await transport.close()
    if "error" in data:
        raise RemoteStatsError(f"{host}:{run_dir}: {data['error']}")
    return data



# --- rendering -------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x: float | int | None, digits: int = 0) -> str:
    if x is None:
        return "-"
    if isinstance(x, int) or digits == 0:
        return f"{int(round(x)):,}"
    return f"{x:,.{digits}f}"


def render(d: RunStats, console: Console) -> None:
    flagged_keys = {f.key for f in d.flags}
    parts = d.parts
    console.print(Text(f"regen stats  {d.run_dir}", style="bold"))
    console.print(f"{parts.read} of {parts.committed} committed parts read (listed from {parts.listed_from}), "
                  f"{d.samples:,} samples, {d.elapsed_s:.2f} s")
    for note in d.notes:
        console.print(f"[yellow]note:[/yellow] {note}")

    t = Table(title="overview", show_header=True, header_style="bold")
    t.add_column("measure")
    t.add_column("count", justify="right")
    t.add_column("share", justify="right")
    t.add_column("threshold", justify="right")

    def row(label: str, count: Count, key: str | None = None, threshold: float | None = None) -> None:
        style = "bold red" if key in flagged_keys else None
        t.add_row(label, _num(count.count), _pct(count.share), _pct(threshold) if threshold is not None else "",
                  style=style)

    row("empty answers", d.empty, "empty_share", d.thresholds.empty_share)
    row("truncated (finish=length)", d.truncated, "truncated_share", d.thresholds.truncated_share)
    row("repetition (stopped runaway)", d.repetition, "repetition_share", d.thresholds.repetition_share)
    row("aborted", d.aborted)
    for name in ("present", "missing", "unterminated"):
        row(f"reasoning {name}", d.reasoning[name])
    console.print(t)
    if d.not_generated:  # planned samples settled without a row (state.sqlite): not in the shards, counted here
        gone = d.not_generated_counts()
        console.print(f"not generated: {gone.rejected:,} rejected"
                      + (f" (of which {gone.after_cut:,} later turns after a cut turn, turns_after_cut = stop)"
                         if gone.after_cut else "")
                      + f", {gone.failed:,} failed")

    _render_histogram(d.loss_mask, console)

    lt = Table(title="token lengths", header_style="bold")
    for col in ("", "mean", "p50", "p90", "p99", "max"):
        lt.add_column(col, justify="right" if col else "left")
    dist = d.loss_mask.distribution
    lt.add_row("loss-mask sum", _num(dist.mean, 1), _num(dist.p50, 1), _num(dist.p90, 1), _num(dist.p99, 1),
               _num(dist.max))
    for name, label in (("output", "response (output_len)"), ("reasoning", "reasoning_tokens"), ("prompt", "prompt_len")):
        x = d.lengths[name]
        lt.add_row(label, _num(x.mean, 1), _num(x.p50, 1), _num(x.p90, 1), _num(x.p99, 1), _num(x.max))
    console.print(lt)

    c = d.cut
    console.print(Text(f"training cut at {c.train_max_length:,} tokens", style="bold"))
    console.print(f"  supervised tokens: {c.supervised_tokens_total:,} total, {c.supervised_tokens_kept:,} kept, "
                  f"{c.supervised_tokens_cut:,} thrown away ({_pct(c.cut_share)})")
    console.print(f"  samples cut: {c.samples_cut:,} ({_pct(c.samples_cut_share)}); losing all supervision "
                  f"(prompt_len >= {c.train_max_length:,}): {c.samples_unsupervised:,} "
                  f"({_pct(c.samples_unsupervised_share)})")

    _render_groups("by source", d.by_source, console)
    _render_groups("by worker", d.by_worker, console)
    _render_groups("per shard", d.by_shard, console)

    mc = d.mask_check
    console.print(f"loss_mask check ({mc.mode}): {mc.rows_checked:,} samples in {mc.parts_checked} parts, "
                  f"{mc.mismatches} mismatch(es)")
    if d.integrity_errors:
        console.print(f"[bold red]integrity errors: {d.integrity_error_count}[/bold red]")
        for e in d.integrity_errors:
            console.print(f"  [red]{e.kind}[/red] {e.path}: {e.detail}")
    if d.flags:
        console.print(Text("flags", style="bold red"))
        for f in d.flags:
            console.print(f"  [bold red]FLAG[/bold red] {f.text}")
    else:
        console.print("[green]no quality flag raised[/green]")


def _render_histogram(lm: LossMaskStats, console: Console) -> None:
    bins = lm.histogram
    console.print(Text("loss-mask sum histogram (supervised tokens per sample, log2 bins)", style="bold"))
    if not bins:
        console.print("  (no samples)")
        return
    peak = max(b.count for b in bins) or 1
    width = max(len(b.label) for b in bins)
    for b in bins:
        n = round(BAR_WIDTH * b.count / peak)
        bar = "█" * n if n or not b.count else "▏"
        console.print(f"  {b.label:>{width}} │ [cyan]{bar:<{BAR_WIDTH}}[/cyan] {b.count:>10,} {b.share:>7.1%}")


def _render_groups(title: str, groups: Sequence[GroupStats], console: Console) -> None:
    shard = title == "per shard"
    t = Table(title=title, header_style="bold")
    t.add_column("shard" if shard else title.split()[-1])
    if shard:
        t.add_column("parts", justify="right")
        t.add_column("conversations", justify="right")
    for col in ("samples", "empty", "truncated", "repetition", "aborted", "mean output"):
        t.add_column(col, justify="right")
    for g in groups:
        cells = [g.name]
        if isinstance(g, ShardStats):
            total = g.total_conversations
            cells += [str(g.parts), "-" if total is None else f"{total:,}" + (" (paused)" if g.paused else "")]
        empty = Text(_pct(g.empty.share), style="bold red" if "empty" in g.flagged else "")
        trunc = Text(_pct(g.truncated.share), style="bold red" if "truncated" in g.flagged else "")
        rep = Text(_pct(g.repetition.share), style="bold red" if "repetition" in g.flagged else "")
        t.add_row(*cells, f"{g.samples:,}", empty, trunc, rep, _pct(g.aborted.share), _num(g.mean_output, 1))
    console.print(t)
