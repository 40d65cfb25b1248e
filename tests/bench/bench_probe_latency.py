"""Probe latency: all probe commands concurrently over one asyncssh connection, versus one
`ssh -F cfg alias 'cmd'` process per command run one after another (as a shell script would),
and versus the same sequence over an OpenSSH ControlMaster (connection reuse, no concurrency).

Starts its own throwaway sshd on loopback (tests.sshd_fixtures.start_sshd). Run:

    .venv/bin/python -m tests.bench.bench_probe_latency [--runs 5] [--out tests/bench/results/probe_latency.json]

The probe commands come from probes.catalog when it exists (any command strings it exposes);
otherwise from the built-in list below. Which one was used is printed and recorded.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncssh

from console.host.connect import open_transport
from tests.sshd_fixtures import start_sshd, stop_sshd

BUILTIN_PROBE_COMMANDS = [
    "uname -a",
    "python3 -c 'import sys; print(sys.version)'",
    "python3 -c 'import importlib.util as u; print(u.find_spec(\"sglang\") is not None)'",
    "nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv,noheader",
    "df -P /tmp",
    "free -b",
    "nproc",
    "head -5 /proc/meminfo",
    "cat /proc/loadavg",
    "ulimit -n",
    "command -v python3",
    "python3 -c 'import json, platform; print(json.dumps(platform.uname()._asdict()))'",
]
PER_COMMAND_TIMEOUT_S = 60.0


def catalog_commands() -> tuple[list[str], str]:
    """Command strings from probes.catalog if it is there, else the built-in list; and where from."""
    try:
        import probes.catalog as catalog
    except ModuleNotFoundError as exc:
        if exc.name != "probes.catalog":
            raise
        return BUILTIN_PROBE_COMMANDS, "built-in list (probes.catalog not found)"
    found: list[str] = []
    for attr in ("PROBES", "CATALOG", "probes", "catalog", "all_probes", "build_catalog", "default_probes"):
        obj = getattr(catalog, attr, None)
        if obj is None:
            continue
        if callable(obj):
            try:
                obj = obj()
            except TypeError as exc:
                print(f"probes.catalog.{attr}() needs arguments ({exc}); trying the next name", file=sys.stderr)
                continue
        items = obj.values() if isinstance(obj, dict) else obj
        for item in items:
            cmd = getattr(item, "command", None)
            if callable(cmd):
                try:
                    cmd = cmd()
                except TypeError:
                    cmd = None  # needs a context we cannot make up here
            if isinstance(cmd, str) and cmd.strip():
                found.append(cmd)
        if found:
            return found, f"probes.catalog.{attr} ({len(found)} commands)"
    print("probes.catalog exposes no probe command strings this benchmark recognises; "
          "using the built-in list", file=sys.stderr)
    return BUILTIN_PROBE_COMMANDS, "built-in list (probes.catalog had no recognisable command strings)"


async def run_asyncssh_once(alias: str, ssh_config: Path, commands: list[str]) -> tuple[float, float, list]:
    t0 = time.perf_counter()
    transport = await open_transport(alias, ssh_config=str(ssh_config))
    t1 = time.perf_counter()
    try:
        results = await asyncio.gather(*[transport.run(c, timeout=PER_COMMAND_TIMEOUT_S) for c in commands])
    finally:
        t2 = time.perf_counter()
        await transport.close()
    return t2 - t0, t2 - t1, results


def run_ssh_sequential_once(alias: str, ssh_config: Path, commands: list[str], extra: list[str]) -> tuple[float, list]:
    t0 = time.perf_counter()
    statuses = []
    for c in commands:
        p = subprocess.run(["ssh", "-F", str(ssh_config), *extra, alias, c], capture_output=True,
                           timeout=PER_COMMAND_TIMEOUT_S)
        if p.returncode == 255:  # ssh's own failure, not the command's: the figure would be meaningless
            raise RuntimeError(f"ssh failed for {c!r}: {p.stderr.decode(errors='replace')}")
        statuses.append(p.returncode)
    return time.perf_counter() - t0, statuses


def summarize(samples: list[float]) -> dict:
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
            "samples_s": samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "probe_latency.json")
    args = ap.parse_args(argv)
    commands, source = catalog_commands()
    print(f"{len(commands)} probe commands from {source}")
    os.environ.pop("SSH_AUTH_SOCK", None)

    with tempfile.TemporaryDirectory(prefix="regen-bench-sshd-") as tmp:
        server = start_sshd(Path(tmp) / "sshd")
        control = ["-o", "ControlMaster=auto", "-o", f"ControlPath={tmp}/cm-%C", "-o", "ControlPersist=120"]
        try:
            # warm-up (page cache, first-connection costs), not measured
            asyncio.run(run_asyncssh_once(server.alias, server.ssh_config_path, commands))
            run_ssh_sequential_once(server.alias, server.ssh_config_path, commands[:1], [])
            total, run_only, ssh_seq, ssh_cm = [], [], [], []
            exit_statuses = None
            for _ in range(args.runs):
                a_total, a_run, results = asyncio.run(run_asyncssh_once(server.alias, server.ssh_config_path, commands))
                total.append(a_total)
                run_only.append(a_run)
                exit_statuses = [r.exit_status for r in results]
                errors = [(r.command, r.error) for r in results if r.error]
                if errors:
                    raise RuntimeError(f"asyncssh runs failed: {errors}")
                s_total, _ = run_ssh_sequential_once(server.alias, server.ssh_config_path, commands, [])
                ssh_seq.append(s_total)
            # ControlMaster: the first call opens the master; measure once it exists
            run_ssh_sequential_once(server.alias, server.ssh_config_path, commands[:1], control)
            for _ in range(args.runs):
                c_total, _ = run_ssh_sequential_once(server.alias, server.ssh_config_path, commands, control)
                ssh_cm.append(c_total)
            subprocess.run(["ssh", "-F", str(server.ssh_config_path), *control, "-O", "exit", server.alias],
                           capture_output=True, timeout=10)
        finally:
            stop_sshd(server)

    ssh_version = subprocess.run(["ssh", "-V"], capture_output=True, text=True).stderr.strip()
    report = {
        "benchmark": "probe_latency",
        "commands": commands,
        "command_source": source,
        "exit_statuses": exit_statuses,
        "runs": args.runs,
        "asyncssh_one_connection_concurrent": {
            "connect_and_run": summarize(total),
            "run_only": summarize(run_only),
        },
        "ssh_process_per_command_sequential": summarize(ssh_seq),
        "ssh_controlmaster_sequential": summarize(ssh_cm),
        "speedup_vs_ssh_sequential": statistics.median(ssh_seq) / statistics.median(total),
        "speedup_vs_controlmaster": statistics.median(ssh_cm) / statistics.median(total),
        "host": "127.0.0.1 (loopback sshd: no network latency; a real host adds one RTT per round trip)",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "openssh": ssh_version,
        "asyncssh": asyncssh.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    rows = [
        ("asyncssh, 1 connection, concurrent (connect+run)", total),
        ("asyncssh, 1 connection, concurrent (run only)", run_only),
        ("ssh process per command, sequential", ssh_seq),
        ("ssh + ControlMaster, sequential", ssh_cm),
    ]
    print(f"\n{'method':<52} {'median s':>9} {'min s':>8} {'max s':>8}")
    for label, samples in rows:
        print(f"{label:<52} {statistics.median(samples):>9.3f} {min(samples):>8.3f} {max(samples):>8.3f}")
    print(f"\nspeedup (median, connect+run) vs ssh per command: {report['speedup_vs_ssh_sequential']:.1f}x; "
          f"vs ControlMaster: {report['speedup_vs_controlmaster']:.1f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
