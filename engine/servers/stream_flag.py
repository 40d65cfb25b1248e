"""Which launch flag makes an SGLang server stream deltas, so a streamed answer costs O(n) on both ends.

0.5.10+ streams every id so far in each chunk unless launched with --incremental-streaming-output; 0.5.5 streams
deltas, --stream-output also making the text a delta (contract 1.1, 2.4, 7.6). The version is read from the launch's
python (or the simulator's --sim-sglang-version); none read: no flag, and the client reads cumulative streams too."""
from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass

log = logging.getLogger("regen.workers")

INCREMENTAL = "--incremental-streaming-output"
LEGACY = "--stream-output"
FLAGS = (INCREMENTAL, LEGACY)
INCREMENTAL_FROM = (0, 5, 10)
VERSION_CODE = "import importlib.metadata as m; print(m.version('sglang'))"


@dataclass(frozen=True)
class StreamFlag:
    """The flag added to a launch (None: none), the SGLang version it was chosen for, and how that was found."""
    flag: str | None
    version: str | None
    how: str


def flag_for(version: str) -> str | None:
    """The delta-streaming flag of an SGLang version, or None when the version cannot be parsed."""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if m is None:
        return None
    return INCREMENTAL if tuple(int(x) for x in m.groups()) >= INCREMENTAL_FROM else LEGACY


def simulated_version(argv: list[str]) -> str | None:
    """The SGLang version a simulator launch speaks (its --sim-sglang-version, else its default), or None when
    the launch is not the simulator's: one that runs engine.simulator, or passes --sim-* flags (SGLang has none)."""
    from engine.config.schema import simulated_sglang_version

    return simulated_sglang_version(argv)


async def choose(argv: list[str], python: str, timeout: float = 60.0) -> StreamFlag:
    """The flag for this launch: none when the operator's line has one already; else by the version."""
    given = next((w for w in argv if w in FLAGS), None)
    if given is not None:
        return StreamFlag(None, None, f"the launch line has {given} already")
    version = simulated_version(argv)
    how = "the simulator's --sim-sglang-version"
    if version is None:
        version, how = await _installed_version(python, timeout)
    if version is None:
        return StreamFlag(None, None, how)
    flag = flag_for(version)
    if flag is None:
        return StreamFlag(None, version, f"SGLang {version} ({how}): not a version regen can compare")
    return StreamFlag(flag, version, how)


async def _installed_version(python: str, timeout: float) -> tuple[str | None, str]:
    """(the sglang version the python has, how it was read) or (None, why not)."""
    shown = f"{python} -c {VERSION_CODE!r}"
    try:
        proc = await asyncio.create_subprocess_exec(python, "-c", VERSION_CODE, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)
    except OSError as exc:
        return None, f"cannot read the SGLang version ({shown}: {type(exc).__name__}: {exc})"
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return None, f"cannot read the SGLang version ({shown}: no answer in {timeout:g} s)"
    if proc.returncode != 0:
        last = (err.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        return None, f"cannot read the SGLang version ({shown} exited {proc.returncode}: {last})"
    return out.decode().strip(), f"{shown}"


async def choose_logged(argv: list[str], python: str, name: str) -> StreamFlag:
    """choose(), and what it chose said in the log of worker `name`."""
    chosen = await choose(argv, python)
    if chosen.flag:
        log.info("worker %s: launched with %s (SGLang %s, from %s): streams carry only the new ids",
                 name, chosen.flag, chosen.version, chosen.how)
    elif "already" not in chosen.how:
        log.warning("worker %s: no delta-streaming flag added (%s): if the server streams every id "
                    "so far in each chunk, regen reads that too, at a client CPU cost growing with the "
                    "square of the answer's length", name, chosen.how)
    return chosen
