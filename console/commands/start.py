"""regen start HOST --config run.toml: preflight the host(s) (--no-preflight skips it, and says so; any FAIL, ERROR
or unreached host starts nothing), deploy the engine into the run dir, start the supervisor and report the run
started only once its start checks pass (a death during its start: its recorded cause). Exit status: 0 started
(some workers may have been refused: a warning says which), 1 not started as configured (the cause is printed;
a supervisor that may live on is named), 2 the host could not be reached, 3 the run is already finished."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys

from console.host.deploy import (AlreadyFinished, AlreadyRunning, DeployError, EXIT_ERROR, EXIT_OK, EXIT_UNREACHABLE,
                                 StartFailed, start_run)
from console.host.hints import hint_from_args, run_dir_command, typed_again
from console.host.ssh_options import SshOptions, add_ssh_options
from console.host.start_record import StartRecord
from console.host.connect import open_for_command
from console.host.config_probe import config_failed_report, config_passed
from engine.config.load import ConfigError, load_config
from probes.render import render_report

EXIT_ALREADY_FINISHED = 3  # the run is done: the supervisor found nothing to generate and exited; nothing runs

# what must hold on every host of a multi-host run for its servers to start
PREFLIGHT = ("connection", "host.python", "ports", "disk.run_dir", "router.package", "prompts.paths",
             "run_dir.resume")


def add_arguments(parser) -> None:
    parser.add_argument("host", help="ssh alias, user@host[:port], or `local`")
    parser.add_argument("--config", required=True, help="run.toml")
    add_ssh_options(parser)
    parser.add_argument("--json", action="store_true", help="print the outcome as JSON (a refused preflight: the"
                        " probe report)")
    parser.add_argument("--preflight", default=None, metavar="ID,...",
                        help="the probes that must pass before the start (default: every probe of `regen probe"
                             f" HOST --config`; with [[hosts]]: {','.join(PREFLIGHT)} on every host)")
    parser.add_argument("--no-preflight", action="store_true", help="start without probing the host(s) first")
    parser.add_argument("--timeout", type=float, default=None, help="preflight: each probe's timeout")
    parser.epilog = ("exit status: 0 started (a warning names workers that did not launch); 1 not started as configured"
                     " (the cause is printed; when the supervisor lives on, e.g. none of its workers launched, it says"
                     " so and how to stop it); 2 host not reached; 3 the run is already finished (state done):"
                     " nothing started, no supervisor left running; the message says how to see and export it")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def run(args) -> int:
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        from rich.console import Console

        report = config_failed_report(args.host, exc)
        if args.json:
            print(json.dumps(report.to_dict(), indent=2))
        else:
            render_report(report, Console(stderr=True))
        print(f"regen start: {exc}\nnothing was started (check the file alone with `regen config check "
              f"{args.config}`)", file=sys.stderr)
        return EXIT_ERROR

    if args.no_preflight:
        print(f"regen start: --no-preflight: the host is not probed before the start (`"
              f"{hint_from_args(args, 'probe', '--config', args.config)}` runs the same checks)", file=sys.stderr)
    else:
        refused = preflight(args, cfg) if cfg.hosts else preflight_host(args, cfg)
        if refused is not None:
            return refused

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    async def main() -> int:
        transport = await open_for_command(args)
        if transport is None:
            return EXIT_UNREACHABLE
        try:
            started = await start_run(transport, cfg, progress=progress,
                                      record=StartRecord.of(["start", *args.argv[1:]]))
        except AlreadyFinished as exc:
            if args.json:
                print(json.dumps(exc.to_dict(), indent=2))
            print(f"regen start: {exc}. See it, check it, or export it with:\n  " + "\n  ".join(
                finished_hints(args, exc.run_dir)) + "\nto generate the data again, set run_dir in the config to a new"
                " directory", file=sys.stderr)
            return EXIT_ALREADY_FINISHED
        except AlreadyRunning as exc:
            print(f"regen start: {exc}; watch it, or stop it, with:\n  {watch_hints(args, exc.run_dir)[0]}\n"
                  f"  {hint_from_args(args, 'stop', '--run-dir', exc.run_dir)}", file=sys.stderr)
            return EXIT_ERROR
        except StartFailed as exc:
            if args.json:
                print(json.dumps(exc.to_dict(), indent=2))
            print(f"regen start: {exc}", file=sys.stderr)
            if exc.fatal:
                print(f"  after the fix, start again: {hint_from_args(args, 'start', '--config', args.config)}",
                      file=sys.stderr)
            return EXIT_ERROR
        except DeployError as exc:
            print(f"regen start: {exc}", file=sys.stderr)
            return EXIT_ERROR
        finally:
            await transport.close()
        if started.warning:
            print(f"regen start: warning: {started.warning}", file=sys.stderr)
        if args.json:
            print(json.dumps({"started": True, "run_dir": started.run_dir, "pid": started.pid,
                              "warning": started.warning, "status": started.status.to_dict()}, indent=2))
        else:
            print(f"started: supervisor pid {started.pid} on {args.host}:{started.run_dir} "
                  f"(state {started.status.state}); watch it with:")
            for hint in watch_hints(args, started.run_dir):
                print(f"  {hint}")
        return EXIT_OK

    return asyncio.run(main())


def watch_hints(args, run_dir: str) -> list[str]:
    """`regen status ...` and `regen tui ...` for the run, shell-quoted, with the SSH options given."""
    return [hint_from_args(args, "status", "--run-dir", run_dir), hint_from_args(args, "tui", "--run-dir", run_dir)]


def finished_hints(args, run_dir: str) -> list[str]:
    """`regen status`, `regen stats` and `regen export` for a finished run, shell-quoted, with the SSH options given."""
    ssh = SshOptions.from_args(args)
    return [hint_from_args(args, "status", "--run-dir", run_dir),
            run_dir_command("stats", args.host, run_dir, ssh=ssh),
            run_dir_command("export", args.host, run_dir, "--format", "tokens-jsonl", "--out", "OUT", ssh=ssh)]


def preflight_host(args, cfg) -> int | None:
    """Probe the one host as `regen probe HOST --config` does; None if nothing FAILed or ERRORed (SKIP and WARN
    pass), else the exit code, with the report printed."""
    from rich.console import Console

    from console.host.preflight import DISPATCH_PROBES, SLURM_PROBES, context_from_config, probe_host
    from probes.model import Status

    only = {p.strip() for p in args.preflight.split(",") if p.strip()} if args.preflight else None
    if cfg.slurm is not None and not only:
        only = DISPATCH_PROBES | SLURM_PROBES  # HOST is the login node; the GPU nodes are Slurm's
    report, reached = asyncio.run(probe_host(args.host, context_from_config(cfg), only, timeout_s=args.timeout,
                                             accept_new_command=typed_again(args, accept_new=True),
                                             **SshOptions.from_args(args).connect_kwargs()))
    report.results.insert(0, config_passed(cfg, report))
    live = next((r.data for r in report.results if r.id == "run_dir.resume" and r.data.get("supervisor_alive")), None)
    if live is not None:  # the cause first: never a ports FAIL whose remedy would stop the live run's servers
        if args.json:
            print(json.dumps(report.to_dict(), indent=2))
        hints = watch_hints(args, cfg.run_dir) + [hint_from_args(args, "stop", "--run-dir", cfg.run_dir)]
        print(f"regen start: a supervisor (pid {live.get('supervisor_pid')}) already runs this run dir "
              f"{args.host}:{cfg.run_dir}; nothing was started. Watch it, or stop it, with:\n  " + "\n  ".join(hints),
              file=sys.stderr)
        return EXIT_ERROR
    bad = [r.id for r in report.results if r.status in (Status.FAIL, Status.ERROR)]
    if reached and not bad:
        counts = ", ".join(f"{k} {v}" for k, v in report.summary().items() if v)
        print(f"preflight passed on {args.host} ({counts})", file=sys.stderr)
        for r in report.results:
            if r.status is Status.WARN:  # a warning is said, not only counted
                print(f"  WARN {r.id}: {r.summary}" + (f"\n    remedy: {r.remedy}" if r.remedy else ""), file=sys.stderr)
        print("  sampling: " + "; ".join(report.results[0].actual.splitlines()[:-1]), file=sys.stderr)
        return None
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        render_report(report, Console(stderr=True))
    what = "not reached" if not reached else "failed: " + ", ".join(bad)
    print(f"regen start: preflight on {args.host} {what}; nothing was started (fix it and start again, or"
          f" --no-preflight)", file=sys.stderr)
    return EXIT_ERROR


def preflight(args, cfg) -> int | None:
    """Probe every host of a multi-host run; None if all passed, else the exit code (report printed)."""
    from rich.console import Console

    from console.commands.probe import probe_fleet
    from probes.render import render_report

    wanted = {p.strip() for p in (args.preflight or ",".join(PREFLIGHT)).split(",") if p.strip()}
    sections = asyncio.run(probe_fleet(args, cfg, wanted, per_role=True))
    # the run config against what the hosts said (the sglang each GPU host runs judges [sampling])
    sections[0][2].results.insert(0, config_passed(cfg, sections[0][2], [rep for _, _, rep, _ in sections[1:]]))
    bad = [(name, address, report, reached) for name, address, report, reached in sections
           if not reached or report.exit_code()]
    if not bad:
        print(f"preflight passed on {len(sections)} hosts: " + ", ".join(n for n, *_ in sections), file=sys.stderr)
        return None
    if args.json:
        print(json.dumps({"schema": "regen.probe-fleet/1",
                          "hosts": [{"name": n, "address": a, "reached": r, "report": rep.to_dict()}
                                    for n, a, rep, r in sections]}, indent=2))
    else:
        console = Console(stderr=True)
        for name, address, report, reached in bad:
            console.rule(f"[bold]{name}[/] ({address})" + ("" if reached else " [red]not reached[/]"))
            render_report(report, console)
    print(f"regen start: preflight failed on {', '.join(n for n, *_ in bad)}; nothing was started"
          " (fix it, drop the host from [[hosts]], or --no-preflight)", file=sys.stderr)
    return EXIT_ERROR
