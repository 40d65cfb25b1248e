"""The words `regen status`, `status --follow` and the headless demo share: the exit status of a run's status, the
progress line, and for a run whose supervisor is gone why and how to start it again (from the run's start record)."""
from __future__ import annotations

from rich.text import Text

from console.host.deploy import EXIT_OK
from console.host.hints import hint_from_args
from console.host.start_record import StartRecord
from console.view.cause import NOT_RUNNING_STATES, not_running_lines
from engine.api.events import DispatchEvent
from engine.api.wire import RunState, duration_text
from engine.api.status import RunStatus

# exit codes of `regen status` (1 and 2 are every run command's: an error reply, nothing reachable there)
EXIT_RUN_FAILED = 3  # the supervisor is gone and recorded why (fatal.json): `failed: ...` is printed first
EXIT_NOT_RUNNING = 4  # the supervisor is gone without a fault recorded: stopped, drained, or killed (dead)
EXIT_CODES = """exit status:
  0  a supervisor runs this run dir (any state), or the run is done
  1  the host answered with an error
  2  nothing to reach: host unreachable, no such run dir, or a directory that is not a run dir
  3  the run failed: its supervisor recorded the cause (shown first; --json: "fatal")
  4  the run is not running and recorded no fault: stopped, drained, or killed (state "dead")
  130  --follow interrupted by Ctrl-C (the run goes on)"""


def exit_code_of(status: RunStatus) -> int:
    if status.running or status.state == RunState.DONE:
        return EXIT_OK
    return EXIT_RUN_FAILED if status.fatal else EXIT_NOT_RUNNING


def _na(value, fmt="{}") -> str:
    return "N/A" if value is None else fmt.format(value)


def eta_text(eta_s: float | None) -> str:
    """The engine's ETA (engine.observe.status: null until measurable and when the run is not running) or "-", in the
    one duration format the TUI uses too."""
    return "-" if eta_s is None or eta_s <= 0 else duration_text(eta_s)


def progress_line(d: DispatchEvent, state: str | None = None, running: bool = True) -> str:
    """Done/total and the rates; a run that is not running has no tok/s, in-flight count or ETA ("-")."""
    pct = 100.0 * d.done / d.total if d.total else 100.0
    state = state or d.state
    moving = running and state not in NOT_RUNNING_STATES
    tok_s = d.tokens_per_s
    rates = (f"{d.in_flight} in flight, {'-' if tok_s is None else f'{tok_s:.0f}'} tok/s" if moving
             else "- in flight, - tok/s")
    eta = eta_text(d.eta_s) if moving else "-"
    return (f"{state}: {d.done}/{d.total} samples ({pct:.1f}%), {rates}, failed {d.failed},"
            f" rejected samples {d.rejected}" + (f" ({d.after_cut} after a cut turn)" if d.after_cut else "")
            + f", retried {d.retried}, ETA {eta}")


def start_again(args, run_dir: str, record: tuple[StartRecord | None, str] | None = None) -> tuple[str, str]:
    """The `regen start` that resumes the run and a note. From the run's start record when there is one (`cd DIR &&
    regen start ...` as typed: the same --config, relative to where it was typed); else built from this command's
    host and SSH options, and the note says the record is missing: --config is read where regen runs, so for
    another host it names the copy the host keeps."""
    started, why = record if record is not None else (None, "")
    if started is not None:
        return started.resume_hint(), f"({started.where()})"
    local = args.host == "local"
    hint = hint_from_args(args, "start", "--config", f"{run_dir}/run.toml" if local else "run.toml")
    note = "" if local else (f"(run.toml: the config the run was started with; {args.host} keeps a copy at "
                             f"{run_dir}/run.toml)")
    if why:
        note = f"({why}; this line is built from the run dir's frozen config) {note}".strip()
    return hint, note


def cause_block(s: RunStatus, args, record: tuple[StartRecord | None, str] | None = None) -> Text:
    """For a run whose supervisor is gone: why (or that nothing was recorded), and how to start it again. Printed
    first and unwrapped (soft_wrap), so paths and the command stay whole when copied."""
    text = Text()
    if s.running:
        return text
    for line in not_running_lines(s, *start_again(args, s.run_dir or args.run_dir, record)):
        text.append(line + "\n", style="bold red" if line.startswith("failed:") else
                    ("bold yellow" if not line.startswith("  ") else ""))
    return text
