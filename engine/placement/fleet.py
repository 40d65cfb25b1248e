"""A multi-host run's servers: the dispatch host's own (if it is one of [[hosts]]), each remote host's through its
HostLink, and the router in front of them; the router's members are kept equal to the ready servers, and the
dispatcher sees only the router.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import aiohttp

import engine
from engine.config.load import RunConfig, host_workers
from engine.placement.hosts.deploy import named_specs
from engine.placement.hosts.link import HostLink
from engine.placement.router import RouterEndpoint, RouterError, RouterProcess
from engine.api.status import HostStatus, RouterStatus, SlurmGroups
from engine.fatal import HostsFailed
from engine.api.events import AlertEvent, Event
from engine.api.wire import AlertKind, HostState, Severity
from engine.servers.tuning import RunTuning
from engine.servers.workers import Worker
from engine.api.wire import WorkerState

if TYPE_CHECKING:
    from engine.placement.slurm.groups import GroupWatch

log = logging.getLogger("regen.fleet")


def host_last_words(host: str, servers: list, log_of: Callable[[object], str]) -> str:
    """What a failed host's servers said: each one's error, fatal lines and log, one per line under the host."""
    lines = [f"host {host}:"]
    for w in servers:
        lines.append(f"{w.name}: {w.error or 'no error text'}")
        lines += [f"  {line}" for line in w.last_error_lines[-4:]]
        lines.append(f"  log: {log_of(w)}")
    return "\n".join(lines)


class Fleet:
    def __init__(self, cfg: RunConfig, run_dir: Path, session: aiohttp.ClientSession, emit: Callable[[Event], None]):
        self.cfg = cfg
        self.emit = emit
        self.router = RouterProcess(cfg, run_dir, session, emit)
        self.endpoint = RouterEndpoint(self.router)
        self.router.on_change = self._routed_changed  # the servers the router routes to changed (its own list)
        engine_root = Path(engine.__file__).resolve().parent.parent
        # each server's --schedule-conservativeness: the pilot's choice or where its last restart left it, from the run
        # dir's record; this host's servers are tuned here, every other host's agent is given its servers' part
        self.tuning = RunTuning(cfg, run_dir)
        emit(self.tuning.start_alert())
        self.local_workers: list[Worker] = []
        self.links: list[HostLink] = []
        forward = cfg.router.forward_base_port
        for host in cfg.hosts:
            if host.is_local:
                local_cfg = cfg.model_copy(update={"workers": host_workers(cfg, host)})
                for spec in named_specs(local_cfg.workers, host.name):
                    self.local_workers.append(Worker(spec=spec, cfg=local_cfg, run_dir=run_dir, session=session,
                                                     emit=emit, python=host.host_python, host_name=host.name,
                                                     tuner=self.tuning.for_server(spec.name)))
            else:
                link = HostLink(cfg, host, engine_root=engine_root, session=session, emit=emit, forward_base=forward,
                                tuning=self.tuning)
                forward += len(link.specs)
                self.links.append(link)
        self.groups: GroupWatch | None = None
        if cfg.slurm is not None:
            from engine.placement.slurm.groups import GroupWatch
            from engine.placement.slurm.link import SlurmLink
            from engine.placement.slurm.plan import layout_of
            from engine.placement.slurm.schedule import Schedule

            schedule = Schedule()  # the groups' measured hand-over timings and job ends, shared: staggered limits
            slurm_links = [SlurmLink(cfg, g, engine_root=engine_root, session=session, emit=emit, schedule=schedule,
                                     tuning=self.tuning) for g in range(layout_of(cfg).groups)]
            self.links += slurm_links
            self.groups = GroupWatch(cfg, slurm_links, emit)
        self._groups_task: asyncio.Task | None = None
        self.workers = list(self.local_workers) + [m for link in self.links for m in link.members]
        self.endpoint.members = self.workers
        for w in self.workers:
            w.listeners.append(self._member_state)
        self._changes: set[asyncio.Task] = set()
        self._stopped = False
        self.on_change: Callable[[], None] = lambda: None  # the router's membership changed
        self.on_failed: Callable[[HostsFailed], None] = lambda exc: None  # every host's servers failed: the run ends
        self.failed_hosts: dict[str, str] = {}  # host -> what its servers said when the last of them failed
        self._served: set[str] = set()  # hosts and servers seen serving by this process (the first time clears
        # what an earlier supervisor of the run raised for them and is still raised: telemetry drops it otherwise)
        self._ended = False

    async def start(self) -> None:
        try:
            await self.router.start()
        except RouterError as exc:
            self.emit(AlertEvent(severity=Severity.CRITICAL, text="the router could not be started", evidence=str(exc),
                                 key="router-start"))
            raise
        if self.cfg.slurm is not None:
            await self._cancel_leftover_jobs()
        for w in self.local_workers:
            w.start()
        for link in self.links:
            link.start()
        if self.groups is not None:
            self._groups_task = asyncio.create_task(self.groups.run(), name="slurm-groups")

    async def _cancel_leftover_jobs(self) -> None:
        from engine.placement.slurm import jobs as slurm_jobs
        from engine.placement.slurm.plan import jobs_file

        try:
            ids, said = await slurm_jobs.cancel_leftovers(jobs_file(self.cfg))
        except slurm_jobs.SlurmError as exc:
            ids, said = [], str(exc)
        if ids or said:
            self.emit(AlertEvent(severity=Severity.WARNING, text=f"cancelled {len(ids)} slurm job(s) an earlier supervisor of "
                                 f"this run left running: {', '.join(ids) or '-'}", evidence=said or "scancel " +
                                 " ".join(ids), key="slurm-leftovers"))

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.router.closing()
        for task in list(self._changes) + ([self._groups_task] if self._groups_task else []):
            task.cancel()
        await asyncio.gather(*(link.stop() for link in self.links), *(w.stop() for w in self.local_workers),
                             return_exceptions=True)
        await self.router.stop()

    def _member_state(self, w, state: str) -> None:
        # the URL as of this change: a [slurm] hand-over moves a member to the next job's URL right after its drain
        task = asyncio.get_running_loop().create_task(self._sync(w, state, w.url), name=f"router-sync-{w.name}")
        self._changes.add(task)
        task.add_done_callback(self._changes.discard)
        if not self._stopped:
            self._judge_hosts()

    def _routed_changed(self) -> None:
        self.endpoint.refresh()
        self.on_change()

    def servers_by_host(self) -> dict[str, list]:
        by_host: dict[str, list] = {h.name: [] for h in self.cfg.hosts}
        for w in self.local_workers:
            by_host[w.host_name].append(w)
        for link in self.links:
            by_host[link.host.name] = list(link.members)
        return by_host

    def _judge_hosts(self) -> None:
        """A host whose every server failed (crashed past workers.max_restarts, on the agent's word for a remote
        one) is a critical alert with their last words, and the run goes on with the others; when no host is left
        to serve, the run ends with them (on_failed)."""
        by_host = self.servers_by_host()
        for w in (w for servers in by_host.values() for w in servers):
            if w.state == WorkerState.READY and w.name not in self._served:
                self._served.add(w.name)
                self.emit(AlertEvent(severity=Severity.INFO, key=f"worker:{w.name}:refused", kind=AlertKind.CLEARED,
                                     text=f"worker {w.name}: its own server is ready", evidence=w.url))
        for name, servers in by_host.items():
            failed = bool(servers) and all(w.state == WorkerState.FAILED for w in servers)
            if failed and name not in self.failed_hosts:
                self.failed_hosts[name] = host_last_words(name, servers, self._log_of)
                others = [h for h in by_host if h != name and h not in self.failed_hosts]
                self.emit(AlertEvent(
                    severity=Severity.CRITICAL, key=f"host-failed:{name}", kind=AlertKind.RAISED,
                    text=f"host {name}: every server failed, not restarted again; " + (
                        f"the run goes on with {', '.join(others)}" if others else "no host is left to serve"),
                    evidence=self.failed_hosts[name]))
            elif (not failed and (name in self.failed_hosts or f"host:{name}" not in self._served)
                  and any(w.state == WorkerState.READY for w in servers)):
                # serves again; or serves for the first time in this process: a `host-failed` an earlier supervisor
                # raised is cleared (telemetry says nothing when none is raised)
                self.failed_hosts.pop(name, None)
                self._served.add(f"host:{name}")
                self.emit(AlertEvent(severity=Severity.INFO, key=f"host-failed:{name}", kind=AlertKind.CLEARED,
                                     text=f"host {name} serves again", evidence="a server of it is ready"))
        if by_host and set(self.failed_hosts) >= set(by_host) and not self._ended:
            self._ended = True
            self.on_failed(HostsFailed("every server of every host failed: " + " | ".join(
                f"host {h}: " + "; ".join(f"{w.name}: {w.error or 'no error text'} (log {self._log_of(w)})"
                                          for w in servers) for h, servers in by_host.items()),
                self._workers_dir(next(iter(by_host)))))

    def link_of(self, w):
        """The link whose host runs server `w`; None for a server of this machine."""
        return next((x for x in self.links if any(m is w for m in x.members)), None)

    def _log_of(self, w) -> str:
        link = self.link_of(w)
        return f"{link.host.name}:{link.server_log(w)}" if link else str(w.log_path)

    def _workers_dir(self, host_name: str) -> str:
        link = next((x for x in self.links if x.host.name == host_name), None)
        return f"{link.host.address}:{link.host.work_dir}/workers" if link else str(Path(self.cfg.run_dir) / "workers")

    async def _sync(self, w, state: str, url: str) -> None:
        try:
            if state == WorkerState.READY:
                await self.router.add(url)
            else:
                await self.router.remove(url)
        except RouterError as exc:
            self.emit(AlertEvent(severity=Severity.ERROR, text=f"router membership of {w.name} not updated",
                                 evidence=str(exc), key=f"router-sync:{w.name}"))
        self.endpoint.refresh()
        self.on_change()

    def set_drained(self, name: str, drained: bool) -> HostStatus:
        """Drain: the host's servers leave the router (requests already on them finish and are
        committed); it stays out, also across a reconnect, until undrained."""
        link = next((link for link in self.links if link.host.name == name), None)
        if link is None:
            raise KeyError(f"unknown remote host {name!r}; hosts: {', '.join(x.host.name for x in self.links)}")
        link.set_drained(drained)
        log.info("host %s %s", name, "drained" if drained else "undrained")
        self.emit(AlertEvent(severity=Severity.INFO, text=f"host {name} {'drained: no new work' if drained else 'undrained'}",
                             key=f"host-drain:{name}"))
        return link.status()

    def host_statuses(self) -> list[HostStatus]:
        hosts = [link.status() for link in self.links]
        for h in self.cfg.hosts:
            if h.is_local:
                failed = h.name in self.failed_hosts
                error = "every server failed: " + "; ".join(f"{w.name}: {w.error}" for w in self.local_workers)
                hosts.insert(0, HostStatus(name=h.name, address="local", state=HostState.FAILED if failed else "up",
                                           error=error if failed else None,
                                           workers=[w.name for w in self.local_workers], work_dir=self.cfg.run_dir))
        return hosts

    def slurm_groups(self) -> SlurmGroups | None:
        """A [slurm] run's groups granted / serving / pending of those wanted; None for any other run."""
        return self.groups.figures() if self.groups is not None else None

    def router_status(self) -> RouterStatus:
        return RouterStatus(url=self.router.url, up=self.router.up, policy=self.cfg.router.policy,
                            members=sorted(self.router.members), restarts=self.router.restarts, error=self.router.error,
                            routed=sorted(m.url for m in self.endpoint.routed()), in_flight=self.endpoint.in_flight or 0,
                            capacity=self.endpoint.capacity)


if TYPE_CHECKING:
    # each kind of dispatch target meets engine.servers.target.DispatchTarget: checked by the type checker here, where
    # all three are known (the Protocol's own module sits below placement), nothing at run time
    from engine.placement.hosts.remote_worker import RemoteWorker
    from engine.servers.target import DispatchTarget

    def _targets(worker: Worker, remote: RemoteWorker, router: RouterEndpoint) -> list[DispatchTarget]:
        return [worker, remote, router]
