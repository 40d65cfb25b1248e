"""`regen export (DIR | HOST:DIR) --format F --out PATH`: the shards as the files a drafter trainer reads. DIR is
exported on this machine (engine.export); HOST:DIR runs `python -m engine.export` on the host, so the data never
crosses the network. `regen export --verify PATH` re-checks an export against its manifest.json."""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from console.commands.stats import missing_local_dir, split_target
from console.host.hints import cannot_reach
from console.host.run_client import RunClientError
from console.host.run_dir_lookup import locate_run_dir
from console.host.remote_engine import RemoteEngineError, engine_command, engine_report, recorded_python
from console.host.ssh_options import SshOptions, add_ssh_options
from console.host.transport import TransportError
from console.host.connect import open_transport
from console.view.wide_console import report_console
from engine.export.cli_args import add_export_arguments, options_from

EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2
REMOTE_TIMEOUT_S = 6 * 3600.0  # a 10^6-sample export takes minutes; never cut one short


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Export a run's committed samples in the format a drafter trainer reads: tokens-jsonl (SpecForge "
        "data.prompts_path, speculators prepare_data.py --data), conversations-jsonl (SpecForge data.train_data_path), "
        "messages-parquet (NeMo Automodel), messages-jsonl (ModelOpt), hf (HF datasets / TRL). Filters are printed "
        "with their counts; manifest.json is written beside the files. Exit status: 0 exported (--verify: matches), "
        "1 --verify found a mismatch, 2 nothing could be exported or verified.")
    p.add_argument("target", metavar="DIR|HOST:DIR", nargs="?", default=None,
                   help="a run dir here, or HOST:DIR (HOST: ssh alias, user@host, local)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (schema regen.export/1)")
    p.add_argument("--python", default=None,
                   help="python on the host (default: the one `regen start` recorded, else python3)")
    add_export_arguments(p)
    add_ssh_options(p)


class RemoteExportError(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    target = args.verify or args.target
    if not target:
        print("regen export: give the run dir (DIR or HOST:DIR) to export, or --verify PATH", file=sys.stderr)
        return EXIT_ERROR
    host, path = split_target(target)
    if not args.verify:
        try:
            options_from(args, path)  # the same checks the host makes, before connecting
        except ValueError as exc:
            print(f"regen export: {exc}", file=sys.stderr)
            return EXIT_ERROR
    try:
        if host is None:
            data = _local(args, path)
        elif args.json or not sys.stderr.isatty():
            data = asyncio.run(_remote(host, path, args))
        else:  # the host prints its summary at the end: a spinner meanwhile, so a long export shows it is alive
            with Console(stderr=True).status(f"{'verifying' if args.verify else 'exporting'} on {host} ..."):
                data = asyncio.run(_remote(host, path, args))
    except RemoteExportError as exc:
        print(f"regen export: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if "error" in data:
        print(f"regen export: {data['error']}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    elif args.verify:
        render_verify(data, report_console(highlight=False))
    else:
        render(data, report_console(highlight=False))
    if args.verify:
        return EXIT_OK if data.get("ok") else EXIT_MISMATCH
    return EXIT_OK


def _local(args: argparse.Namespace, path: str) -> dict[str, Any]:
    from engine.export.run import SCHEMA, export_run
    from engine.export.source import ExportError
    from engine.export.verify import SCHEMA as VERIFY_SCHEMA, verify_export
    from engine.store.manifest import ManifestError
    from pathlib import Path

    if args.verify:
        try:
            return verify_export(Path(path)).to_dict()
        except ManifestError as exc:
            return {"schema": VERIFY_SCHEMA, "error": str(exc)}
    missing = missing_local_dir(path)
    if missing:
        return {"schema": SCHEMA, "error": missing.replace("regen stats", "regen export")}
    opts = options_from(args, path)
    show = not args.json and sys.stderr.isatty()
    try:
        if not show:
            return export_run(opts).to_dict()
        with Progress(TextColumn("exporting"), BarColumn(), MofNCompleteColumn(), TextColumn("samples"),
                      TimeRemainingColumn(), console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("export", total=None)
            return export_run(opts, lambda done, total: bar.update(task, completed=done, total=total)).to_dict()
    except ExportError as exc:
        return {"schema": SCHEMA, "error": str(exc)}


async def _remote(host: str, path: str, args: argparse.Namespace) -> dict[str, Any]:
    try:
        transport = await open_transport(host, **SshOptions.from_args(args).connect_kwargs())
    except TransportError as exc:
        raise RemoteExportError(cannot_reach(host, exc, args)) from exc
    try:
        if args.verify:
            # the export's manifest names the run dir it came from, whose deployed engine can check it
            run_dir, argv_tail = await _manifest_run_dir(transport, path), ["--verify", path]
        else:
            try:
                run_dir = await locate_run_dir(transport, path)
            except RunClientError as exc:
                raise RemoteExportError(str(exc)) from exc
            argv_tail = [run_dir, *_export_argv(args)]
        python = args.python or (await recorded_python(transport, run_dir) if run_dir else None) or "python3"
        command = engine_command(python, ["-m", "engine.export", *argv_tail, "--json"], run_dir=run_dir)
        return await engine_report(
            transport, command, where=f"{host}:{path}", timeout=REMOTE_TIMEOUT_S,
            no_engine=f"{python} on {host} cannot import engine (ModuleNotFoundError): give a run dir started by "
                      "`regen start` (it deploys the engine there), or --python PY with regen installed")
    except RemoteEngineError as exc:
        raise RemoteExportError(str(exc)) from exc
    finally:
        await transport.close()


async def _manifest_run_dir(transport, path: str) -> str | None:
    """The run dir recorded in the export's manifest.json on the host, if there is one with a deployed engine."""
    manifest = path if path.endswith(".json") else f"{path.rstrip('/')}/manifest.json"
    result = await transport.run("cat -- " + shlex.quote(manifest), timeout=60)
    try:
        run_dir = json.loads(result.stdout).get("run_dir") if result.exit_status == 0 else None
    except (json.JSONDecodeError, AttributeError):
        return None  # the verify itself reports the unreadable manifest
    return run_dir if isinstance(run_dir, str) and run_dir else None


def _export_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--format", args.format, "--out", args.out, "--reasoning-key", args.reasoning_key,
            "--over-length", args.over_length, "--min-supervised", str(args.min_supervised)]
    if args.keep:
        argv += ["--keep", args.keep]
    if args.max_length is not None:
        argv += ["--max-length", str(args.max_length)]
    if args.last_turn_only:
        argv.append("--last-turn-only")
    if args.split_rows is not None:
        argv += ["--split-rows", str(args.split_rows)]
    return argv


# --- rendering -------------------------------------------------------------------------------


def render(d: dict[str, Any], console: Console) -> None:
    console.print(Text(f"regen export  {d['run_dir']} -> {d['out']}  ({d['format']})", style="bold"))
    console.print(f"{d['samples']:,} committed samples read from {d['parts']} parts (a snapshot: samples committed "
                  "after the export started are not in it)")
    for note in d.get("notes", []):
        console.print(f"[yellow]note:[/yellow] {note}")
    console.print(Text("filters", style="bold"))
    for line in d["filters"]:
        console.print(f"  {line}")
    t = Table(title="samples", header_style="bold")
    t.add_column("")
    t.add_column("count", justify="right")
    t.add_column("share", justify="right")
    total = d["samples"] or 1
    for reason, n in d["dropped"].items():
        t.add_row(f"dropped: {reason}", f"{n:,}", f"{n / total:.1%}")
    t.add_row("kept", f"{d['kept']:,}", f"{d['kept'] / total:.1%}", style="bold")
    console.print(t)
    tokens = d["tokens"]
    console.print(f"kept tokens: {tokens.get('prompt', 0):,} prompt, {tokens.get('supervised', 0):,} supervised")
    for w in d["warnings"]:
        console.print(f"[bold yellow]warning:[/bold yellow] {w}")
    for line in d.get("agreement_lines") or []:  # text formats: how close re-rendering comes to the stored ids
        console.print(line)
    for f in d["files"]:
        console.print(f"  {f['path']}  {f['rows']:,} rows  {f['bytes']:,} bytes  sha256 {f['sha256'][:16]}...")
    rate = d["samples"] / d["elapsed_s"] if d["elapsed_s"] else 0.0
    console.print(f"manifest: {d['manifest']}  ({d['elapsed_s']:.1f} s, {rate:,.0f} samples/s)")


def render_verify(d: dict[str, Any], console: Console) -> None:
    if d["ok"]:
        console.print(f"[green]OK[/green] {d['path']}: {d['files']} file(s), {d['rows']:,} rows match manifest.json")
        return
    console.print(f"[bold red]MISMATCH[/bold red] {d['path']}: {len(d['problems'])} problem(s) against manifest.json")
    for p in d["problems"]:
        console.print(f"  {p}")
