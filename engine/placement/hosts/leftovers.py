"""`regen stop` on a [[hosts]] run whose supervisor is gone: each host's agent is stopped over SSH, its servers with
it. Agents outlive their supervisor on purpose (a resumed run finds its servers warm); a stop means the GPUs go.
(engine/placement/leftovers.py reads the run's config and tells the result.)"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine.config.load import Host, RunConfig
from engine.placement.hosts.ssh import AGENT_STOP_WAIT_S, HostError, agent_stop_command, run_ssh
from engine.api.events import AlertEvent
from engine.api.wire import Severity

STOPPED = "stopped agent"  # the agent's --stop line when it stopped one (engine.placement.hosts.agent.stop_holder)


@dataclass(frozen=True)
class HostStop:
    host: str
    ok: bool
    said: str  # the agent's line, or what ssh said

    @property
    def stopped(self) -> bool:
        return self.ok and self.said.startswith(STOPPED)


@dataclass(frozen=True)
class LeftAgents:
    hosts: tuple[HostStop, ...]  # the hosts where an agent was stopped or could not be

    @property
    def failed(self) -> bool:
        return any(not h.ok for h in self.hosts)

    def text(self) -> str:
        stopped = [h.host for h in self.hosts if h.stopped]
        parts = []
        if stopped:
            parts.append(f"stopped the host agent(s) its supervisor left running, and their servers, on {len(stopped)}"
                         f" host(s): {', '.join(stopped)}")
        parts += [f"stopping the agent on {h.host} failed: {h.said}" for h in self.hosts if not h.ok]
        return "; ".join(parts)

    def alert(self) -> AlertEvent:
        return AlertEvent(severity=Severity.ERROR if self.failed else Severity.WARNING, text=f"regen stop: {self.text()}",
                          evidence="\n".join(f"{h.host}: {h.said}" for h in self.hosts), key="hosts-leftovers")


async def _stop(host: Host) -> HostStop:
    try:
        rc, out, err = await run_ssh(host, agent_stop_command(host), timeout=AGENT_STOP_WAIT_S + 15)
    except HostError as exc:
        return HostStop(host.name, False, str(exc))
    said = (out.strip().splitlines() or [""])[-1] if rc == 0 else (err.strip() or out.strip() or f"exit {rc}")
    return HostStop(host.name, rc == 0, said)


def stop_left_agents(cfg: RunConfig) -> LeftAgents | None:
    """None where no agent runs on the run's hosts."""

    async def stop_all() -> list[HostStop]:
        return list(await asyncio.gather(*(_stop(h) for h in cfg.hosts)))

    told = tuple(h for h in asyncio.run(stop_all()) if h.stopped or not h.ok)
    return LeftAgents(told) if told else None
