"""Run the probes concurrently over one CommandRunner; every outcome becomes a ProbeResult.

A hung command is ERROR ("timed out after N s"), a probe whose `needs` did not PASS/WARN is SKIP naming them, a
judge that raises is ERROR with its text: nothing here ever turns a failure into a PASS.
"""
from __future__ import annotations

import asyncio
import time
import traceback
from dataclasses import dataclass

from probes.catalog import probes_for
from probes.catalog.probe import JudgeInput, Probe, Verdict
from probes.context import REHEARSAL, ProbeContext
from probes.model import CommandResult, CommandRunner, ConnectErrorKind, ProbeReport, ProbeResult, Status

# The transport enforces each command's timeout itself; this is a backstop for a runner that does not return.
RUNNER_GRACE_S = 10.0

REMEDY_BY_KIND = {
    ConnectErrorKind.UNREACHABLE:
        "check the host name / address and port (ssh -v HOST), that the host is up and sshd listens",
    ConnectErrorKind.TIMEOUT: "check the host is up, the port is the SSH port, and no firewall drops the connection",
    ConnectErrorKind.AUTH:
        "check the user and key (IdentityFile in ~/.ssh/config, ssh-add -l) and the host's authorized_keys",
    ConnectErrorKind.HOST_KEY: "verify the host's key fingerprint; for a new host pass --accept-new; a CHANGED key "
                               "needs ssh-keygen -R HOST after checking why it changed",
    ConnectErrorKind.CLOSED:
        "the host closed the connection during the handshake: check sshd's log (MaxStartups, AllowUsers)",
    ConnectErrorKind.ERROR: "run `ssh -v HOST` to see the SSH error",
}
CONNECT_SUMMARY = {
    ConnectErrorKind.UNREACHABLE: "unreachable",
    ConnectErrorKind.TIMEOUT: "unreachable (timed out)",
    ConnectErrorKind.AUTH: "authentication failed",
    ConnectErrorKind.HOST_KEY: "host key not verified",
    ConnectErrorKind.CLOSED: "connection closed during the handshake",
    ConnectErrorKind.ERROR: "SSH connection failed",
}


@dataclass(frozen=True)
class ConnectFailure:
    """Why the transport could not be opened (console.host.transport.TransportError's kind and text)."""

    kind: ConnectErrorKind
    message: str
    duration_s: float = 0.0


def connect_failure_result(probe: Probe, failure: ConnectFailure) -> ProbeResult:
    # Refusals (auth, host key) are FAIL: we reached the host and it is not fit for us. Not reaching it is ERROR.
    status = Status.FAIL if failure.kind in (ConnectErrorKind.AUTH, ConnectErrorKind.HOST_KEY) else Status.ERROR
    label = CONNECT_SUMMARY.get(failure.kind, "SSH connection failed")
    return ProbeResult(
        id=probe.id, title=probe.title, status=status, summary=f"{label}: {failure.message}",
        expected="an SSH connection with a verified host key and a working login",
        actual=failure.message, command="(open the SSH connection)", duration_s=failure.duration_s,
        remedy=REMEDY_BY_KIND.get(failure.kind, REMEDY_BY_KIND[ConnectErrorKind.ERROR]),
        data={"kind": failure.kind,
              "reachable": failure.kind not in (ConnectErrorKind.UNREACHABLE, ConnectErrorKind.TIMEOUT)},
    )


def rehearsal_result(probe: Probe) -> ProbeResult:
    return ProbeResult(probe.id, probe.title, Status.SKIP, REHEARSAL,
                       expected="not needed: workers.launch runs the SGLang simulator (-m engine.simulator), which "
                                "needs no GPU, CUDA, sglang or weights",
                       script=probe.script or "", data={"rehearsal": True})


def _from_command(probe: Probe, res: CommandResult, verdict: Verdict) -> ProbeResult:
    return ProbeResult(
        id=probe.id, title=probe.title, status=verdict.status, summary=verdict.summary, expected=verdict.expected,
        actual=verdict.actual, command=res.command, exit_status=res.exit_status, stdout=res.stdout, stderr=res.stderr,
        duration_s=res.duration_s, remedy=verdict.remedy, data=verdict.data, script=probe.script or "",
    )


async def run_one(probe: Probe, runner: CommandRunner, ctx: ProbeContext, deps: dict[str, ProbeResult],
                  timeout_s: float) -> ProbeResult:
    try:
        command = probe.command(ctx)
    except Exception as exc:  # a catalog bug must show, not vanish
        return ProbeResult(probe.id, probe.title, Status.ERROR, f"could not build the command: {type(exc).__name__}: {exc}",
                           data={"traceback": traceback.format_exc()})
    started = time.monotonic()
    try:
        res = await asyncio.wait_for(runner.run(command, timeout=timeout_s), timeout_s + RUNNER_GRACE_S)
    except asyncio.TimeoutError:
        res = CommandResult(command, None, "", "", time.monotonic() - started, timed_out=True,
                            error=f"the transport did not return within {timeout_s + RUNNER_GRACE_S:g} s")
    except Exception as exc:  # e.g. TransportError: the connection dropped mid-run
        kind = getattr(exc, "kind", None)
        text = f"{type(exc).__name__}{f' ({kind})' if kind else ''}: {exc}"
        return ProbeResult(probe.id, probe.title, Status.ERROR, f"could not run the command: {text}", command=command,
                           duration_s=time.monotonic() - started, script=probe.script or "",
                           remedy="check the connection to the host and run the probe again")
    if res.timed_out:
        where = None
        if probe.on_timeout is not None:
            try:
                where = probe.on_timeout(res)
            except Exception as exc:  # the timeout is the news; a failing explanation is noted, not raised
                where = f"(could not read the partial output: {type(exc).__name__}: {exc})"
        v = Verdict(Status.ERROR, f"timed out after {timeout_s:g}s" + (f" {where}" if where else "")
                    + (f" ({res.error})" if res.error else ""),
                    expected=f"the command finishes within {timeout_s:g} s",
                    remedy="run the command by hand on the host to see where it hangs (or raise --timeout)")
        return _from_command(probe, res, v)
    if res.exit_status is None:
        v = Verdict(Status.ERROR, f"the command did not exit normally: {res.error or 'no exit status'}",
                    remedy="run the command by hand on the host")
        return _from_command(probe, res, v)
    try:
        verdict = probe.judge(res, JudgeInput(ctx, deps))
    except Exception as exc:
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        verdict = Verdict(Status.ERROR, f"the judge of {probe.id} raised: {last}",
                          remedy="a bug in regen's probe: report it with the command output below",
                          data={"traceback": traceback.format_exc()})
    if not isinstance(verdict, Verdict):
        verdict = Verdict(Status.ERROR, f"the judge of {probe.id} returned {type(verdict).__name__}, not a Verdict")
    return _from_command(probe, res, verdict)


async def run_probes(
    runner: CommandRunner | None,
    host: str,
    cfg_context: ProbeContext,
    only: set[str] | None = None,
    *,
    connect_failure: ConnectFailure | None = None,
    timeout_s: float | None = None,
    catalog: list[Probe] | None = None,
) -> ProbeReport:
    """Run the selected probes concurrently. `runner` is None when the connection failed (`connect_failure`
    says why): the connection probe reports it and every other probe is SKIP. `timeout_s` overrides each
    probe's own timeout."""
    probes = probes_for(cfg_context, only, catalog)
    started_at, t0 = time.time(), time.monotonic()
    futures: dict[str, asyncio.Future[ProbeResult]] = {p.id: asyncio.get_running_loop().create_future() for p in probes}

    async def task(probe: Probe) -> None:
        try:
            result = await guarded(probe)
        except BaseException as exc:  # cancellation: dependants must not wait forever
            if not futures[probe.id].done():
                futures[probe.id].set_exception(exc)
            raise
        futures[probe.id].set_result(result)

    async def guarded(probe: Probe) -> ProbeResult:
        if probe.id == "connection" and (connect_failure is not None or runner is None):
            failure = connect_failure or ConnectFailure(ConnectErrorKind.ERROR, "no transport")
            return connect_failure_result(probe, failure)
        if probe.real_gpus and cfg_context.rehearsal:
            return rehearsal_result(probe)
        deps: dict[str, ProbeResult] = {}
        blocked = []
        for dep in probe.needs:
            if dep in futures:
                r = await futures[dep]
                deps[dep] = r
                if r.status not in (Status.PASS, Status.WARN):
                    blocked.append(f"{dep}, which is {r.status.value}")
        if blocked:
            return ProbeResult(probe.id, probe.title, Status.SKIP, "needs " + "; ".join(blocked),
                               expected="its dependencies PASS or WARN", script=probe.script or "")
        for dep in probe.uses:
            if dep in futures:
                deps[dep] = await futures[dep]
        assert runner is not None
        return await run_one(probe, runner, cfg_context, deps, timeout_s or probe.timeout_s)

    await asyncio.gather(*(task(p) for p in probes))
    results = [futures[p.id].result() for p in probes]
    return ProbeReport(host=host, results=results, started_at=started_at, duration_s=time.monotonic() - t0,
                       rehearsal=cfg_context.rehearsal)
