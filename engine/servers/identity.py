"""Proving that the server answering a worker's port is the one regen launched for this run.

Each launch carries a fresh token in its served model name, reported in `/v1/models` (and 0.5.23+ `/model_info`);
where psutil shows it, the listening socket must belong to the launched process tree (a foreign proxy answering with
this launch's token is accepted, with a warning). `judge()` is pure: proven / foreign / own mismatch / pending."""
from __future__ import annotations

import asyncio
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from engine.servers.port_holder import PortHolder, describe_pid, listening_pids, process_tree

SERVED_NAME_FLAG = "--served-model-name"
NAME_PATHS = ("/v1/models", "/model_info", "/get_model_info")


class Verdict:
    PROVEN = "proven"
    FOREIGN = "foreign"  # another process's server answers the port: refuse, nothing is sent to it
    OWN_MISMATCH = "own_mismatch"  # the launched tree serves the port but does not identify: a launch-line problem
    PENDING = "pending"  # nothing conclusive yet (not listening, endpoints not answering): ask again


@dataclass(frozen=True)
class Expected:
    """What the server regen launched must show."""
    served_model_name: str
    token_is_ours: bool  # False when the operator's launch line sets --served-model-name (the name then proves little)
    pid: int
    host: str
    port: int


@dataclass(frozen=True)
class SocketOwner:
    """Who listens on the port, as far as this user can see."""
    ours: tuple[int, ...] = ()  # listening pids inside the launched process tree
    foreign: tuple[PortHolder, ...] = ()  # visible listeners outside it
    hidden: tuple[PortHolder, ...] = ()  # listeners whose pid this user cannot see
    note: str = ""  # why the socket table could not be read

    @property
    def listening(self) -> bool:
        return bool(self.ours or self.foreign or self.hidden)


@dataclass(frozen=True)
class ServedNames:
    """The names the server reports; `error` says why none could be read."""
    names: tuple[str, ...] = ()
    error: str = ""
    reachable: bool = True  # False: no HTTP answer at all (connection refused, timeout)


@dataclass(frozen=True)
class IdentityCheck:
    verdict: str
    reason: str  # the sentence the operator reads
    holders: tuple[PortHolder, ...] = ()
    names: tuple[str, ...] = ()
    warning: str = ""  # proven, with something worth telling (a proxy listens in front of the server)


def launch_token() -> str:
    return secrets.token_hex(6)


def served_name(run_dir: str, worker: str, token: str) -> str:
    run = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(run_dir).name)[:40] or "run"
    return f"regen-{run}-{worker}-{token}"


def operator_served_name(argv: list[str]) -> str | None:
    """The --served-model-name the operator's launch line or extra_args already set, if any."""
    for i, word in enumerate(argv):
        if word == SERVED_NAME_FLAG and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(SERVED_NAME_FLAG + "="):
            return word.split("=", 1)[1]
    return None


def socket_owner(host: str, port: int, launched_pid: int) -> SocketOwner:
    pids, note = listening_pids(host, port)
    tree = process_tree(launched_pid)
    ours = tuple(p for p in pids if p is not None and p in tree)
    foreign = tuple(describe_pid(p) for p in pids if p is not None and p not in tree)
    hidden = tuple(describe_pid(None) for p in pids if p is None)
    return SocketOwner(ours=ours, foreign=foreign, hidden=hidden, note=note)


def names_in(path: str, body: object) -> tuple[str, ...]:
    """The served names in a /v1/models or /model_info answer (empty when the field is absent)."""
    if not isinstance(body, dict):
        return ()
    if path == "/v1/models":
        return tuple(str(m["id"]) for m in body.get("data") or [] if isinstance(m, dict) and "id" in m)
    name = body.get("served_model_name")
    return (str(name),) if name else ()


async def read_served_names(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                            timeout_s: float = 5.0) -> ServedNames:
    """Ask /v1/models (every version), then /model_info and /get_model_info (0.5.23+ carry the name)."""
    errors: list[str] = []
    reachable = False
    for path in NAME_PATHS:
        try:
            async with session.get(url + path, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                reachable = True
                if resp.status != 200:
                    errors.append(f"GET {path} -> HTTP {resp.status} {(await resp.text())[:120]}".strip())
                    continue
                found = names_in(path, await resp.json(content_type=None))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            errors.append(f"GET {path}: {type(exc).__name__}: {exc}")
            continue
        except ValueError as exc:
            errors.append(f"GET {path}: not JSON ({exc})")
            continue
        if found:
            return ServedNames(names=found)
        errors.append(f"GET {path}: no served model name in the answer")
    return ServedNames(error="; ".join(errors), reachable=reachable)


def _quoted(names: tuple[str, ...]) -> str:
    return ", ".join(repr(n) for n in names)


def judge(expected: Expected, owner: SocketOwner, answer: ServedNames) -> IdentityCheck:
    """Whether the server on the port is the one launched (see the module doc for the rules)."""
    where = f"port {expected.port} on {expected.host}"
    name_ok = expected.served_model_name in answer.names
    said = (f"it answers as {_quoted(answer.names)}" if answer.names else f"it does not say its name ({answer.error})")
    said += f", expected {expected.served_model_name!r}"
    if name_ok and expected.token_is_ours:
        warning = ""
        if owner.foreign:
            warning = (f"{where} is listened on by {', '.join(h.describe() for h in owner.foreign)}, outside the "
                       f"process tree regen launched (pid {expected.pid}); accepted because it answers with this "
                       "launch's own served-model-name (a container or proxy in front of the server)")
        return IdentityCheck(Verdict.PROVEN, f"{where}: served-model-name {expected.served_model_name!r} matches",
                             names=answer.names, warning=warning)
    if owner.foreign:
        return IdentityCheck(Verdict.FOREIGN, f"{where} is served by {', '.join(h.describe() for h in owner.foreign)},"
                             f" not by the server regen launched (pid {expected.pid}): {said}",
                             holders=owner.foreign, names=answer.names)
    if owner.ours:
        if name_ok:
            return IdentityCheck(Verdict.PROVEN, f"{where}: listened on by the launched pid(s) "
                                 f"{', '.join(map(str, owner.ours))}", names=answer.names)
        if not answer.names and not answer.reachable:
            return IdentityCheck(Verdict.PENDING, f"{where}: not answering yet ({answer.error})")
        return IdentityCheck(Verdict.OWN_MISMATCH, f"the server regen launched (pid {expected.pid}) serves {where} "
                             f"but {said[3:]}: the launch command (workers.launch) must pass regen's "
                             f"{SERVED_NAME_FLAG} on to SGLang", names=answer.names)
    if not owner.listening and not owner.note:
        return IdentityCheck(Verdict.PENDING, f"{where}: nobody listens (yet)")
    if not answer.names and not answer.reachable:
        return IdentityCheck(Verdict.PENDING, f"{where}: not answering ({answer.error})")
    holder = (", ".join(h.describe() for h in owner.hidden) if owner.hidden
              else f"a process regen cannot see ({owner.note})")
    if name_ok:  # the operator's own name, and no socket owner to tie it to this launch
        return IdentityCheck(Verdict.FOREIGN, f"{where} is served by {holder}; it answers with the configured "
                             f"served-model-name {expected.served_model_name!r}, but so could any server: remove "
                             f"{SERVED_NAME_FLAG} from workers.launch/extra_args so regen sets a per-launch name",
                             holders=owner.hidden, names=answer.names)
    return IdentityCheck(Verdict.FOREIGN, f"{where} is served by {holder}, not by the server regen launched "
                         f"(pid {expected.pid}): {said}", holders=owner.hidden, names=answer.names)


def judge_health_only(expected: Expected, owner: SocketOwner) -> IdentityCheck:
    """A rank > 0 of a server across nodes serves only SGLang's dummy /health, which says no name: it is the launch
    when the launched process tree listens on its port, and nothing of another process may answer there."""
    where = f"port {expected.port} on {expected.host}"
    if owner.foreign or owner.hidden:
        holders = owner.foreign + owner.hidden
        return IdentityCheck(Verdict.FOREIGN, f"{where} is listened on by {', '.join(h.describe() for h in holders)}, "
                             f"not only by the server rank regen launched (pid {expected.pid})", holders=holders)
    if owner.ours:
        return IdentityCheck(Verdict.PROVEN, f"{where}: the rank's health server, listened on by the launched pid(s) "
                             f"{', '.join(map(str, owner.ours))}")
    return IdentityCheck(Verdict.PENDING, f"{where}: nobody listens (yet)" + (f" ({owner.note})" if owner.note else ""))


async def check_identity(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                         expected: Expected) -> IdentityCheck:
    answer = await read_served_names(session, url, headers)
    owner = await asyncio.to_thread(socket_owner, expected.host, expected.port, expected.pid)
    return judge(expected, owner, answer)
