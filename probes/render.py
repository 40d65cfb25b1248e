"""The probe report for a person: a table of verdicts, then the evidence for every probe that did not pass."""
from __future__ import annotations

import shlex

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from probes.host import script as host_script
from probes.context import REHEARSAL
from probes.model import ProbeReport, ProbeResult, Status

STYLE = {
    Status.PASS: "bold green",
    Status.WARN: "bold yellow",
    Status.FAIL: "bold red",
    Status.ERROR: "bold magenta",
    Status.SKIP: "dim",
}
MAX_OUTPUT_LINES = 40
REHEARSAL_HEADER = ("rehearsal: workers.launch runs the SGLang simulator (-m engine.simulator); the GPU, CUDA, "
                    "sglang and weights probes are SKIP (simulated GPUs)")


def display_command(r: ProbeResult) -> str:
    """The command with an embedded host script shown as <probes/host/NAME.py> (the JSON report has it whole)."""
    if r.script:
        quoted = shlex.quote(host_script(r.script))
        if quoted in r.command:
            return r.command.replace(quoted, f"<probes/host/{r.script}.py>")
    return r.command


def _tail(text: str) -> Text:
    lines = text.rstrip("\n").splitlines()
    if len(lines) > MAX_OUTPUT_LINES:
        cut = len(lines) - MAX_OUTPUT_LINES
        return Text(f"({cut} earlier lines not shown; --json has all)\n", style="dim") + Text("\n".join(lines[-MAX_OUTPUT_LINES:]))
    return Text("\n".join(lines)) if lines else Text("(empty)", style="dim")


def _field(label: str, value: Text | str) -> Text:
    body = value if isinstance(value, Text) else Text(value)
    return Text(f"{label}: ", style="bold") + body


def detail(r: ProbeResult) -> Panel:
    parts: list[Text] = [_field("summary", r.summary)]
    if r.status is not Status.SKIP or r.command:
        if r.command:
            parts.append(_field("command", display_command(r)))
        parts.append(_field("exit status", "none" if r.exit_status is None else str(r.exit_status)))
        parts.append(Text("stdout:", style="bold"))
        parts.append(_tail(r.stdout))
        parts.append(Text("stderr:", style="bold"))
        parts.append(_tail(r.stderr))
    if r.expected:
        parts.append(_field("expected", r.expected))
    if r.actual:
        parts.append(_field("actual", r.actual))
    if r.remedy:
        parts.append(_field("remedy", Text(r.remedy, style="cyan")))
    title = Text.assemble((r.status.value, STYLE[r.status]), " ", (r.id, "bold"), f"  {r.title}")
    return Panel(Group(*parts), title=title, title_align="left", border_style=STYLE[r.status].replace("bold ", ""))


def is_rehearsal_skip(r: ProbeResult) -> bool:
    return r.status is Status.SKIP and r.summary == REHEARSAL


def render_report(report: ProbeReport, console: Console) -> None:
    if report.rehearsal:
        console.print(Text(REHEARSAL_HEADER, style="bold cyan"))
    title = f"regen probe {report.host}" + (" (rehearsal)" if report.rehearsal else "")
    table = Table(title=title, title_justify="left", show_lines=False)
    table.add_column("status", no_wrap=True)
    table.add_column("probe", no_wrap=True)
    table.add_column("summary", overflow="fold")
    table.add_column("time", justify="right", no_wrap=True)
    for r in report.results:
        table.add_row(Text(r.status.value, style=STYLE[r.status]), r.id, Text(r.summary), f"{r.duration_s:.1f}s")
    console.print(table)
    for r in report.results:
        if r.status is not Status.PASS and not is_rehearsal_skip(r):  # the header says why those are skipped
            console.print(detail(r))
    counts = report.summary()
    line = Text("  ".join(f"{k} {v}" for k, v in counts.items() if v), style="bold")
    console.print(Text(f"{report.timing_text()}: ") + line)
