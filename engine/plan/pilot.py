"""`regen plan --pilot N`: measure throughput and output lengths on live servers at the batch the run will give them.
Servers are launched as the supervisor launches them and each is kept at its batch plus the dispatcher's queue margin;
throughput is measured only over the window it ran full (engine.plan.pilot_window). N is raised to what fills the
batches (known only once the servers are up), and the plan says so; outputs never go into the run's shards.
"""
from __future__ import annotations

import asyncio
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from engine.servers.capacity import BatchSource
from engine.api.reports import PilotResult, PilotWorker
from engine.api.wire import Severity
from engine.config.load import RunConfig
from engine.servers.metrics_client import parse_metrics
from engine.plan.pilot_window import Completed, Reading, full_batch
from engine.servers.tuning import RunTuning
from engine.servers.tuning_rule import EvidenceWindow, answer_tail, clip_tails
from engine.http_client import KEEPALIVE_S
from engine.run.batch_feedback import margin_for
from engine.run.prompt_limit import from_context, tightest
from engine.store.names import REPETITION

BOOTSTRAP_ROUNDS = 2000
ROUNDS = 2  # requests per in-flight slot: the first round fills the batch, the second keeps it full
# requests the pilot has open on one server at once: a burst of connects stays under uvicorn's listen backlog (2,048, as
# Linux's default tcp_max_syn_backlog; 2,500 at once were dropped: "Server disconnected"), and is still more than a
# server admits on an H200-sized pool (~400-900), so a queue forms where admission is the limit
CONNECTIONS_PER_SERVER = 1024
READ_INTERVAL_S = 0.25  # /metrics readings of each pilot server
METRICS_TIMEOUT_S = 5.0
METRICS_MISSES = 3  # late /metrics answers in a row before a server's window is reconstructed from completions
# the scheduler's batch lines (shared/reference/sglang_contract.md 1.3): a decode line's running count, and a prefill
# line's running count before the new requests joined plus the requests that joined
BATCH_LINE = re.compile(r"(?:Prefill batch, #new-seq: (\d+),.*?|Decode batch, )#running-req: (\d+),")


class PilotError(Exception):
    """The pilot could not measure (a server failed, a request failed, no prompts); the message says why."""


@dataclass(frozen=True)
class PilotSize:
    """How full the pilot keeps one server, and how many requests that takes."""
    batch: int  # the server's batch size (engine/servers/capacity.py)
    source: str  # where it came from (BatchSource)
    in_flight: int  # requests kept in flight: batch + queue margin, or dispatch.max_in_flight_per_worker
    needed: int  # requests that fill it: ROUNDS x in_flight

    @property
    def full(self) -> int:
        """The batch the server runs while the pilot keeps `in_flight` requests on it."""
        return min(self.batch, self.in_flight)


def pilot_size(batch: int, source: str, fixed: int | None) -> PilotSize:
    in_flight = fixed or batch + margin_for(batch)
    return PilotSize(batch, source, in_flight, ROUNDS * in_flight)


async def _follow(resp, cfg: RunConfig, url: str, stop: Callable[[], None]):
    """A streamed pilot answer read through the runaway detector (engine.run.answer_stream); `stop()` once it fires.
    A stream that breaks off after that is still the answer: what it delivered is exact."""
    import aiohttp

    from engine.run.answer_stream import AnswerStream, StreamError
    from engine.run.runaway import RunawayDetector

    answer = AnswerStream(RunawayDetector(cfg.runaway))
    try:
        async for data in resp.content.iter_any():
            if answer.feed(data) is not None:
                stop()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, StreamError) as exc:
        if answer.verdict is None:
            raise PilotError(f"pilot: {url}/generate stream broke off: {type(exc).__name__}: {exc}") from exc
    return answer


async def _abort(session, url: str, rid: str, notes: list[str]) -> None:
    """POST /abort_request for a runaway the guard stopped; a failure is a note (the answer then runs on)."""
    import aiohttp

    try:
        async with session.post(url + "/abort_request", json={"rid": rid},
                                timeout=aiohttp.ClientTimeout(total=10)) as resp:
            text = await resp.text()
            if resp.status == 200:
                return
            problem = f"HTTP {resp.status}: {text[:200]}"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    notes.append(f"pilot: {url}/abort_request for runaway {rid} failed ({problem}): it ran to max_new_tokens")


def bootstrap_mean_ci(values: np.ndarray, rounds: int = BOOTSTRAP_ROUNDS, seed: int = 0) -> tuple[float, float]:
    if values.size == 0:
        return (0.0, 0.0)
    rng = np.random.default_rng(seed)
    means = rng.choice(values, size=(rounds, values.size), replace=True).mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


class _PilotServers:
    """The pilot's servers, launched by engine/servers/workers.py's Worker (the supervisor's launch path: port check, identity
    proof, server log, readiness) in a scratch run dir. A worker refused, crashed or failed ends the pilot with its
    cause instead of being restarted: a pilot measures servers that work, or says why there are none."""

    def __init__(self, cfg: RunConfig, scratch_dir: Path, python: str, session, tuning: RunTuning):
        from engine.servers.launch import worker_specs
        from engine.servers.workers import Worker

        self.alerts: list[str] = []
        self.cause: str | None = None
        self._ended = asyncio.Event()
        self.workers = [Worker(spec, cfg, scratch_dir, session, self._emit, python=python,
                               tuner=tuning.for_server(spec.name)) for spec in worker_specs(cfg)]
        for w in self.workers:
            w.listeners.append(self._on_state)

    def _emit(self, event) -> None:
        from engine.api.events import AlertEvent

        if isinstance(event, AlertEvent) and event.severity != Severity.INFO:
            self.alerts.append(f"{event.text}" + (f" ({event.evidence.splitlines()[0]})" if event.evidence else ""))

    def _on_state(self, w, state: str) -> None:
        from engine.api.wire import WorkerState

        if state in (WorkerState.REFUSED, WorkerState.CRASHED, WorkerState.FAILED) and self.cause is None:
            # measuring another process's server, or one that restarts, would be a wrong figure
            if state == WorkerState.REFUSED:  # its error names the port, the holder and the remedy
                self.cause = f"pilot: {w.error}"
            else:
                self.cause = (f"pilot: worker {w.name} ({w.url}) {state}: {w.error or 'no error text'}; "
                              f"last log lines ({w.log_path}):\n{_tail(w.log_path)}")
            self._ended.set()

    async def start_and_wait_ready(self) -> None:
        for w in self.workers:
            w.start()
        ready = asyncio.ensure_future(asyncio.gather(*(w.wait_ready() for w in self.workers)))
        ended = asyncio.ensure_future(self._ended.wait())
        waiting: set[asyncio.Future[Any]] = {ready, ended}
        try:  # each worker gives up by itself after workers.ready_timeout_s (crashed: "not ready after ...")
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            ended.cancel()
            await asyncio.gather(ready, ended, return_exceptions=True)  # collected: no "never retrieved" noise
        if self.cause is not None:
            raise PilotError(self.cause)

    def sizes(self, fixed: int | None) -> list[PilotSize]:
        """Each ready server's size as its Worker discovered it (engine/servers/capacity.py)."""
        return [pilot_size(w.capacity_info.batch().size, w.capacity_info.batch().source, fixed) for w in self.workers]

    async def stop(self) -> list[str]:
        """Stop every server; what went wrong on the way (alerts other than the cause already raised)."""
        await asyncio.gather(*(w.stop() for w in self.workers))
        return [a for a in self.alerts if self.cause is None or a not in self.cause]


def _timeout(seconds: float):
    import aiohttp

    return aiohttp.ClientTimeout(total=seconds)


def logged_batches(w) -> list[int]:
    """The running counts of a pilot server's batch log lines (one scheduler's: none counted with DP ranks)."""
    if w.capacity_info.dp_ranks > 1:
        return []
    try:
        text = w.log_path.read_text(errors="replace")
    except OSError:
        return []  # the /metrics readings stand in
    return [int(joined or 0) + int(running) for joined, running in BATCH_LINE.findall(text)]


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(cannot read {path}: {exc})"


def spread_over_sources(rendered: Sequence, n: int) -> list:
    """Up to n prompts taking turns over the sources, so each source is in the pilot."""
    by_source: dict[str, list] = {}
    for item in rendered:
        by_source.setdefault(item[0].source, []).append(item)
    picked: list = []
    queues = [list(v) for _, v in sorted(by_source.items())]
    while len(picked) < n and any(queues):
        for q in queues:
            if q and len(picked) < n:
                picked.append(q.pop(0))
    return picked


def quotas(sizes: Sequence[PilotSize], total: int) -> list[int]:
    """Requests per worker: each its `needed` first, prompts beyond that in turn; fewer prompts than needed are
    shared in proportion to the need."""
    need = sum(s.needed for s in sizes)
    if total <= need:
        q = [total * s.needed // need for s in sizes]
    else:
        extra = total - need
        q = [s.needed + extra // len(sizes) for s in sizes]
    for i in range(total - sum(q)):
        q[i % len(q)] += 1
    return q


def _size_text(name: str, s: PilotSize, fixed: int | None) -> str:
    if fixed:
        return f"{name} {s.in_flight} (dispatch.max_in_flight_per_worker; batch {s.batch}, {s.source})"
    return f"{name} {s.batch} ({s.source}) + {s.in_flight - s.batch} queued"


async def run_pilot(cfg: RunConfig, renderer, prompts_for: Callable[[int], Sequence], n: int,
                    python: str | None = None, tuning: RunTuning | None = None) -> tuple[PilotResult, list[str]]:
    """Run the pilot; `prompts_for(k)` gives the rendered (conversation, turn, prompt ids) of at least k samples
    when the prompt files hold that many. The servers run at `tuning`'s start value (the run's), and their /metrics
    are the evidence of the next choice (PilotResult.evidence). Returns the result and notes for the plan."""
    import aiohttp

    log_dir = Path(tempfile.mkdtemp(prefix="regen-pilot-"))
    headers = {"Authorization": f"Bearer {cfg.workers.api_key}"} if cfg.workers.api_key else {}
    fixed = cfg.dispatch.max_in_flight_per_worker
    notes: list[str] = []
    done: list[list[Completed]] = []
    readings: list[list[Reading]] = []
    windows: list[EvidenceWindow] = []
    read_errors: dict[int, str] = {}
    started = time.monotonic()
    # not aiohttp's default limit (100 in all): the pilot keeps batch + margin in flight on every server, up to
    # CONNECTIONS_PER_SERVER; keepalive below uvicorn's idle close
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=CONNECTIONS_PER_SERVER, keepalive_timeout=KEEPALIVE_S)
    # the servers' health checks, the /metrics readings and the aborts on connections of their own: behind the
    # pilot's requests (CONNECTIONS_PER_SERVER open on a server) a reading waited for a request to end, and a pilot on
    # a large pool read 2 /metrics in 46 s
    watch_connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    tuning = tuning or RunTuning(cfg, None, pilot=True)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session, \
            aiohttp.ClientSession(headers=headers, connector=watch_connector) as watch:
        servers = _PilotServers(cfg, log_dir, python or sys.executable, watch, tuning)
        try:
            await servers.start_and_wait_ready()
            sizes = servers.sizes(fixed)
            # SGLang's own prompt rule with the servers' reported pool and context (engine/run/prompt_limit.py)
            limit = tightest(from_context(renderer.context_length, "tokenizer"),
                             ((w.name, w.capacity_info) for w in servers.workers))
            needed = sum(s.needed for s in sizes)
            names = [w.name for w in servers.workers]
            want = max(n, needed)
            if n < needed:
                notes.append(f"pilot: {n} prompts cannot fill the servers' batches; raised to {needed} "
                             f"({ROUNDS} x the requests kept in flight per worker: "
                             + ", ".join(_size_text(nm, s, fixed) for nm, s in zip(names, sizes)) + ")")
            candidates = prompts_for(want)
            fitting = [c for c in candidates if limit.fits(len(c[2]))]
            if len(fitting) < len(candidates):
                notes.append(f"pilot: {len(candidates) - len(fitting)} prompts left out: "
                             f"{limit.reason(max(len(c[2]) for c in candidates))}")
            chosen = spread_over_sources(fitting, want)
            if not chosen:
                raise PilotError("pilot: no prompts to generate (no conversation with a user turn)")
            if len(chosen) < want:
                notes.append(f"pilot: the prompt files hold {len(chosen)} samples, fewer than the {want} asked; "
                             "all of them were sent")
            per_worker: list[list] = []
            at = 0
            for q in quotas(sizes, len(chosen)):
                per_worker.append(chosen[at:at + q])
                at += q
            done = [[] for _ in servers.workers]
            readings = [[] for _ in servers.workers]
            windows = [EvidenceWindow(w.name, f"pilot: {w.name} {w.url}/metrics") for w in servers.workers]
            sending_over = asyncio.Event()
            started = time.monotonic()

            guard = cfg.runaway.enabled  # answers stream through the runaway guard, as in the run
            aborts: list[asyncio.Future] = []
            resent: list[str] = []  # the connection errors of requests sent again

            async def one(w: int, prompt: list[int], rid: str) -> None:
                url = servers.workers[w].url
                params = cfg.sampling.as_sglang()
                params["max_new_tokens"] = min(cfg.sampling.max_new_tokens, limit.room(len(prompt)))
                if guard:
                    params["stream_interval"] = cfg.runaway.stream_interval
                sent = time.monotonic()
                async with session.post(url + "/generate",
                                        json={"rid": rid, "input_ids": prompt, "sampling_params": params,
                                              "stream": guard},
                                        timeout=_timeout(cfg.dispatch.request_timeout_s)) as resp:
                    if resp.status != 200:
                        body = await resp.text()
                        raise PilotError(f"pilot: {url}/generate answered HTTP {resp.status}: {body[:300]}")
                    if guard and resp.content_type == "text/event-stream":
                        answer = await _follow(resp, cfg, url, lambda: aborts.append(
                            asyncio.ensure_future(_abort(watch, url, rid, notes))))
                        if answer.error is not None or (answer.finish is None and answer.verdict is None):
                            raise PilotError(f"pilot: {url}/generate stream of {rid}: "
                                             + (answer.error or f"ended without a final chunk ({answer.chunks} "
                                                                 "chunks)"))
                        out = answer.ids.tolist()
                        fr = REPETITION if answer.verdict is not None else (answer.finish or {}).get("type", "unknown")
                        completion = len(out) if answer.verdict is not None else int(
                            answer.meta.get("completion_tokens", len(out)))
                        done[w].append(Completed(sent, time.monotonic(), completion, fr, out))
                        return
                    body = await resp.text()
                data = json.loads(body)
                meta = data.get("meta_info") or {}
                fr = (meta.get("finish_reason") or {}).get("type", "unknown")
                out = data.get("output_ids") or []
                done[w].append(Completed(sent, time.monotonic(), int(meta.get("completion_tokens", len(out))), fr, out))

            async def worker_loop(w: int) -> None:
                queue = list(per_worker[w])

                async def lane() -> None:
                    while queue:
                        conv, turn, prompt = queue.pop(0)
                        for attempt in range(cfg.dispatch.max_retries + 1):
                            # a rid per sample (the simulator's answer follows it, as in the run) and per attempt (a
                            # server refuses a rid it still runs); "/" ends it, since SGLang aborts every rid the
                            # aborted one prefixes, and the turns of one conversation run at once
                            rid = f"regen-pilot-{conv.conversation_id}#turn{turn}{f'@{attempt}' if attempt else ''}/"
                            try:
                                await one(w, prompt, rid)
                                break
                            except aiohttp.ClientConnectionError as exc:  # no answer: a burst of connections can
                                if attempt == cfg.dispatch.max_retries:  # overflow a loaded server's accept queue
                                    raise
                                resent.append(f"{type(exc).__name__}: {exc}")
                                await asyncio.sleep(cfg.dispatch.retry_backoff_s * 2 ** attempt)

                await asyncio.gather(*(lane() for _ in range(max(1, min(sizes[w].in_flight, len(queue))))))

            async def read_metrics(w: int) -> None:
                url = servers.workers[w].url + "/metrics"
                misses = 0
                while not sending_over.is_set():
                    try:
                        async with watch.get(url, timeout=_timeout(METRICS_TIMEOUT_S)) as resp:
                            text = await resp.text()
                            if resp.status != 200:
                                raise ValueError(f"HTTP {resp.status}: {text[:200]}")
                        m = parse_metrics(text)
                        if m.running_reqs is None:
                            raise ValueError("no sglang:num_running_reqs in it")
                        readings[w].append(Reading(time.monotonic(), m.running_reqs, m.queued_reqs or 0.0))
                        windows[w].add(m, time.time(), servers.workers[w].capacity_info.max_running_requests)
                        misses = 0
                    except asyncio.TimeoutError:
                        # a server deep in a big batch can answer /metrics late; one late answer is no reason
                        # to give up its window, a server that never answers is
                        misses += 1
                        if misses >= METRICS_MISSES:
                            read_errors[w] = f"no answer within {METRICS_TIMEOUT_S:g} s, {misses} times in a row"
                            return
                    except (aiohttp.ClientError, ValueError) as exc:
                        read_errors[w] = f"{type(exc).__name__}: {exc}"
                        return
                    try:
                        await asyncio.wait_for(sending_over.wait(), READ_INTERVAL_S)
                    except asyncio.TimeoutError:
                        pass  # next reading

            readers = [asyncio.ensure_future(read_metrics(w)) for w in range(len(servers.workers))]
            try:
                await asyncio.gather(*(worker_loop(w) for w in range(len(servers.workers))))
            finally:
                sending_over.set()
                await asyncio.gather(*readers, return_exceptions=True)
                await asyncio.gather(*aborts)  # each notes its own failure
        except aiohttp.ClientError as exc:
            raise PilotError(f"pilot: request failed: {exc}{'; ' + servers.cause if servers.cause else ''};"
                             f" server logs in {log_dir}") from exc
        finally:
            notes += await servers.stop()
        if resent:
            notes.append(f"pilot: {len(resent)} requests were sent again after a connection error without an answer "
                         f"([dispatch] max_retries {cfg.dispatch.max_retries}; the last: {resent[-1]})")
    wall = time.monotonic() - started
    workers = []
    for w, (srv, size) in enumerate(zip(servers.workers, sizes)):
        mine = done[w]
        if w in read_errors:  # a server without metrics: the window is the client's reconstruction
            notes.append(f"pilot: {srv.name} {srv.url}/metrics could not be read ({read_errors[w]}); its full-batch "
                         "window is reconstructed from the completions (is --enable-metrics set?)")
            readings[w] = []
        fb = full_batch(mine, readings[w], size.full, logged_batches(srv))
        workers.append(PilotWorker(srv.name, srv.url, len(mine), size.batch, size.source, size.in_flight,
                                   fb.batch, sum(r.completion_tokens for r in mine), fb.window_s, fb.tokens_per_s,
                                   fb.basis))
        if fb.batch < size.full:
            notes.append(f"pilot: {srv.name} ran at most {fb.batch} requests at once, below its batch of "
                         f"{size.full}; its throughput is measured at {fb.batch}")
        if size.source == BatchSource.DEFAULT and not fixed:
            notes.append(f"pilot: {srv.name} did not report its batch size (default {size.batch}); the run grows it "
                         "from the server's queue, so the run may be faster than this pilot")
    reqs = [r for mine in done for r in mine]
    lens = np.array([r.completion_tokens for r in reqs], dtype=np.float64)
    finish: dict[str, int] = {}
    for r in reqs:
        finish[r.finish] = finish.get(r.finish, 0) + 1
    p50, p90, p99 = np.percentile(lens, [50, 90, 99])
    evidence = [e for e in (win.evidence() for win in windows) if e is not None]
    result = PilotResult(n, needed, len(reqs), workers, float(lens.mean()), float(p50), float(p90), int(lens.max()),
                         bootstrap_mean_ci(lens), finish.get("length", 0) / len(reqs), wall, str(log_dir), finish,
                         float(p99), evidence, answer_tail(lens.tolist(), tuning.clip_in_force),
                         clip_tails(lens.tolist(), tuning.clip_in_force))
    result._outputs = [r.output_ids for r in reqs]  # type: ignore[attr-defined]  # for the bytes/token sample
    result._finishes = [r.finish for r in reqs]  # type: ignore[attr-defined]  # with _outputs: the guard projection
    return result, notes
