"""regen status HOST --run-dir DIR [--json]: state, tok/s, done/total, ETA, workers, shards, alerts.

A run whose supervisor is gone is shown from what its run dir recorded, the cause first: a failed
run's `failed: <type>: <message>` with the path, the remedy and the log; a stopped run's command to
resume it; a supervisor that died without a word (killed) with the last lines of its log.
"""
from __future__ import annotations

import argparse
import json
import time

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from console.view.batch_text import batch_text, queued_text
from console.view.cache_text import cache_text
from console.view.tuning_text import conservativeness_text, retracted_text
from console.host import start_record
from console.host.deploy import add_host_args, run_with_client
from console.view.fit_table import Col, fitted_table
from console.view.wide_console import WIDE, report_console
from console.commands.status_hardware import hardware_parts
from console.host.run_client import ClientErrorKind, RunClientError
from engine.api.wire import AlertKind, HostState, RunState, ShardState, in_flight_text, pid_text
from engine.api.brake import BrakeStatus
from engine.api.status import CheckState, HostStatus, RunStatus
from console.commands.status_text import (EXIT_CODES, _na, cause_block, exit_code_of, progress_line)

def add_arguments(parser) -> None:
    add_host_args(parser)
    parser.add_argument("--json", action="store_true", help="print the status as JSON (with `running` and `fatal`)")
    parser.add_argument("--wide", action="store_true",
                        help="every column whole, whatever the terminal's width (the default when piped)")
    parser.add_argument("--follow", action="store_true",
                        help="print a progress line per update until the run ends (Ctrl-C stops following, not the"
                             " run); reconnects and backfills when the connection is lost")
    parser.epilog = EXIT_CODES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def run(args) -> int:
    if args.follow:
        from console.commands.status_follow import run_follow

        return run_follow(args)

    async def call(client) -> int:
        try:
            status = await client.status()
        except RunClientError as exc:
            if exc.kind != ClientErrorKind.UNREACHABLE or "no supervisor" not in str(exc):
                raise
            try:
                status = await client.last_status()  # finished, failed or killed: what the run dir recorded
            except RunClientError:
                raise exc from None
        if args.json:
            print(json.dumps(status.to_dict(), indent=2))
        else:
            console = status_console(args.wide)
            record = None if status.running else await start_record.read(client.transport, client.run_dir)
            console.print(cause_block(status, args, record), soft_wrap=True)
            console.print(render_status(status, console, host=args.host))
        return exit_code_of(status)

    return run_with_client(args, call)


# the text columns wrap, then go (error first) before a number, a state or a pid is cut
WORKER_COLUMNS = [Col("name"), Col("state"), Col("gpus", short="gpu"), Col("pid"), Col("restarts", short="rst"),
                  Col("in flight/cap", short="infl"), Col("batch (source)", drop=2), Col("running", short="run"),
                  Col("queued", short="q"), Col("gen tok/s", short="tok/s"), Col("KV usage", short="KV"),
                  Col("retracted", short="retr"), Col("cache hit", drop=3), Col("error", drop=1)]
HOST_COLUMNS = [Col("host"), Col("address", drop=2), Col("state"), Col("servers"), Col("joins"), Col("lost"),
                Col("error", drop=1)]
ALERTS_SHOWN = 20  # raised now: the first ones (oldest), and how many more
EVENTS_SHOWN = 5  # one-shot alert events: the latest


def status_console(wide: bool) -> Console:
    """The terminal's width; full width when asked (--wide) or when the output is not a terminal (piped)."""
    return report_console(wide)


def render_status(s: RunStatus, console: Console | None = None, host: str = "") -> Group:
    """The status as printed on `console` (its width decides which text columns fit; default: every column)."""
    console = console or Console(width=WIDE)
    d = s.dispatch
    head = Text()
    head.append(f"{s.host}:{s.run_dir}  ", style="bold")
    state = s.state
    good, bad = (RunState.RUNNING, RunState.FINISHING, RunState.DONE), (RunState.FAILED, RunState.DEAD)
    head.append(f"state {state}",
                style="bold green" if state in good else "bold red" if state in bad else "bold yellow")
    if not s.running:
        was = f" (its last recorded state: {s.last_state})" if s.last_state and s.last_state != state else ""
        head.append(f"  supervisor not running: the last state recorded in the run dir{was}\n", style="yellow")
    else:
        up = time.time() - (s.started_at if s.started_at is not None else time.time())
        head.append(f"  pid {s.pid}  up {up:.0f} s\n")
    head.append(progress_line(d, state, s.running) if d is not None else "no dispatch yet")
    if s.brake is not None:
        head.append_text(brake_text(s.brake, host))
    if s.metrics is not None:  # where the run's Prometheus metrics are served, or why not
        head.append("\n" + s.metrics.text(), style="dim" if s.metrics.url or not s.metrics.enabled else "yellow")
    pending = [c for c in s.startup if c.state != CheckState.OK]
    if s.running and pending:  # still starting (or a start check failed): which ones, and why
        head.append("\nstart checks not passed: " + "; ".join(
            f"{c.title or c.check} {c.state}" + (f" ({c.detail})" if c.detail else "") for c in pending),
            style="bold red" if any(c.state == CheckState.FAILED for c in pending) else "yellow")
    tuning = tuning_line(s)
    if tuning:
        head.append("\n" + tuning, style="dim")
    for problem in s.write_errors:
        head.append(f"\ncannot write {problem}", style="bold red")
    for problem in s.read_errors:
        head.append(f"\ncannot read the run dir's {problem}", style="bold red")
    multi = any(w.host for w in s.workers)
    worker_rows = []
    for w in sorted(s.workers, key=lambda w: (w.host or "", w.name)):
        batch = batch_text(w.batch_size, w.batch_source, w.discovered_batch, w.discovered_source)
        worker_rows.append([*([w.host or ""] if multi else []), w.name, w.state, ",".join(map(str, w.gpus)),
                            pid_text(w.pid, w.node, w.job_id), str(w.restarts),
                            in_flight_text(w.in_flight, w.capacity, w.in_flight_source,
                                           s.router.in_flight if s.router is not None else None), batch,
                            _na(w.running_reqs, "{:.0f}"), queued_text(w.queued_reqs, w.held),
                            _na(w.gen_throughput, "{:.0f}"), _na(w.token_usage, "{:.0%}"),
                            retracted_text(w.retracted), cache_text(w.prompt_tokens, w.cached_tokens), w.error or ""])
    workers = fitted_table(console, ([Col("host", drop=4)] if multi else []) + WORKER_COLUMNS, worker_rows,
                           title="workers" + (" (by host)" if multi else ""))
    by_state: dict[str, int] = {}
    for sh in s.shards:
        by_state[sh.state] = by_state.get(sh.state, 0) + 1
    shard_table = Table(title=f"shards ({', '.join(f'{n} {k}' for k, n in sorted(by_state.items())) or 'none'})")
    for col in ("shard", "state", "done/total", "output tokens", "empty", "truncated"):
        shard_table.add_column(col)
    interesting = [sh for sh in s.shards if sh.state in (ShardState.RUNNING, ShardState.PAUSED)] or s.shards
    for sh in interesting[:20]:
        shard_table.add_row(sh.id, sh.state, f"{sh.done}/{sh.total}", str(sh.output_tokens), str(sh.empty),
                            str(sh.truncated))
    if len(interesting) > 20:
        shard_table.add_row(f"... {len(interesting) - 20} more", "", "", "", "", "")
    parts: list[RenderableType] = [head]
    if s.slurm_groups is not None:  # granted / pending of the groups wanted, against the plan's min_groups
        g = s.slurm_groups
        parts.append(Text(g.text(live=s.running), style="yellow" if s.running and g.granted < g.counted else ""))
    if s.hosts:
        parts.append(hosts_table(s, console))
    if not s.workers and not s.running:  # no server is live without its supervisor: no empty table that looks live
        parts += [Text("workers: none live (the supervisor is not running; its servers stopped with it)"), shard_table]
    else:
        parts += [workers, shard_table]
    parts += hardware_parts(s, console)  # GPUs and disks, by host in a multi-host run
    # every row of rejects.jsonl, with its parts (input rows refused when read, samples rejected or failed; the TUI's
    # header says the same words) and by its reason
    parts.append(Text(f"rejects {s.rejects.text()}; rejects.jsonl rows by reason: "
                      + (", ".join(f"{k} {v}" for k, v in sorted(s.rejects.by_reason.items())) or "none")))
    parts += alert_parts(s)
    return Group(*parts)


def tuning_line(s: RunStatus) -> str:
    """Each server's --schedule-conservativeness and its source, servers of one value together (the workers table
    keeps its width for the figures that move)."""
    by_value: dict[str, list[str]] = {}
    for w in sorted(s.workers, key=lambda w: (w.host or "", w.name)):
        by_value.setdefault(conservativeness_text(w.conservativeness, w.conservativeness_source), []).append(w.name)
    if not by_value or set(by_value) == {"N/A"}:
        return ""
    return "--schedule-conservativeness: " + "; ".join(
        f"{value} on {', '.join(names)}" if len(by_value) > 1 else f"{value} on every server"
        for value, names in by_value.items())


def alert_parts(s: RunStatus) -> list[Table]:
    """The alerts raised now (each condition that still holds, from the run's record), then the latest one-shot alert
    events (history: a crash, a submitted job); a condition's raised / cleared lines are not repeated there."""
    parts = []
    if s.alerts:
        a = Table(title=f"alerts raised now ({len(s.alerts)}: each until its condition ends; oldest first)")
        for col in ("since", "severity", "text"):
            a.add_column(col)
        for al in s.alerts[:ALERTS_SHOWN]:
            a.add_row(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(al.ts)), al.severity, al.text)
        if len(s.alerts) > ALERTS_SHOWN:
            a.add_row("", "", f"... {len(s.alerts) - ALERTS_SHOWN} more (--json lists every one)")
        parts.append(a)
    said = [e for e in s.alert_events if e.kind == AlertKind.EVENT][-EVENTS_SHOWN:]
    if said:
        h = Table(title="recent alert events (history, latest last)")
        for col in ("time", "severity", "text"):
            h.add_column(col)
        for al in said:
            h.add_row(time.strftime("%H:%M:%S", time.localtime(al.ts)), al.severity, al.text)
        parts.append(h)
    return parts


def brake_text(b: BrakeStatus, host: str = "") -> Text:
    """The data-quality brake: engaged, with the numbers, the likely causes and the remedy; else its window now."""
    text = Text()
    if b.engaged:
        since = time.strftime("%H:%M:%S", time.localtime(b.since)) if b.since else "?"
        text.append(f"\nBRAKED (data-quality brake, since {since}): dispatch paused run-wide: {b.text}",
                    style="bold red")
        for share in b.crossed[1:]:
            text.append(f"\n  also {share.text()}", style="red")
        text.append("\n  likely causes:")
        for cause in b.causes:
            text.append(f"\n    - {cause}")
        text.append(f"\n  {b.remedy_for(host)}", style="bold")
        return text
    if not b.enabled:
        return text.append("\nbrake: off ([brake] enabled = false)", style="dim")
    shares = ", ".join(f"{sh.reason.replace('_', ' ')} {sh.share:.1%} (level {sh.level:.0%})" for sh in b.window)
    judged = "judged" if b.samples >= b.min_samples else f"judged from {b.min_samples}"
    return text.append(f"\nbrake: armed, last {b.samples}/{b.window_size} samples ({judged}): {shares}", style="dim")


def job_text(h: HostStatus, as_of: float | None = None) -> str:
    """A [slurm] group's job as squeue says it: `job 12 RUNNING on n1, 9:41 left` / `job 13 PENDING (Resources)`;
    as_of (the status's time): a job not started says how long it has waited, `job 13 PENDING 12m34s (Resources)`."""
    j = h.job
    if j is None:
        return ""
    reason = f" ({j.reason_text})" if j.reason_text else ""
    nodes = f" on {j.nodes}" if j.nodes and j.nodes != "(null)" and (j.state == "RUNNING" or j.ended) else ""
    left = f", {j.left_text()}" if j.left_text() else ""
    nxt = f", next job {j.next_job} queued" if j.next_job else ""
    return f"job {j.job_id} {j.state_text(as_of)}{reason}{nodes}{left}{nxt}"


def hosts_table(s: RunStatus, console: Console) -> Table:
    r = s.router
    title = ("hosts (no supervisor: each job's last state, as Slurm says it now)" if r is None and not s.running
             else "hosts (no router)" if r is None else
             f"hosts (router {r.url} {r.policy}, {'up' if r.up else 'DOWN'}, {len(r.members)} servers in it"
             + (f", {len(r.routed)} listed by it" if len(r.routed) != len(r.members) else "")
             + f", {r.in_flight} in flight" + (f", restarts {r.restarts}" if r.restarts else "")
             + (f": {r.error}" if r.error else "") + ")")
    rows: list[list[RenderableType]] = [
        [h.name, job_text(h, s.checked_at) or h.address,
         Text(h.state, style="green" if h.state == HostState.UP else
              "dim" if h.state in (HostState.ENDED, HostState.STOPPED) else "bold red"),
         str(len(h.workers)), "" if h.joins is None else str(h.joins), "" if h.lost is None else str(h.lost),
         (h.error or "")[:80]]
        for h in s.hosts or []]
    return fitted_table(console, HOST_COLUMNS, rows, title=title)
