"""SimServer: one simulated SGLang server's state, its /health check, pause/resume, SIGTERM drain and shutdown."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import traceback

from aiohttp import web

from engine.api.wire import FinishReason
from engine.simulator.config import SimConfig, read_model_config
from engine.simulator.dist import Member, Rendezvous
from engine.simulator.faults import Faults
from engine.simulator.generator import OutputGenerator, Tokenizer
from engine.simulator.gpu import SimGpus
from engine.simulator.intake import Intake
from engine.simulator.metrics import SimMetrics
from engine.simulator.request import RequestState, SimRequest
from engine.simulator.scheduler import Scheduler
from engine.simulator.server_state import PauseMode, ServerStatus
from engine.simulator.simlog import SimLog
from engine.simulator.sizing import MemoryModel, running_per_dp
from engine.simulator.startup import Startup

# /health sleeps 1 s, then is healthy when the scheduler has answered anything since it started, checking
# each second up to SGLANG_HEALTH_CHECK_TIMEOUT (0.5.5 http_server.py:406-481, :462; 0.5.23 :779)
HEALTH_POLL_S = 1.0
HEALTH_CHECK_TIMEOUT_S = 20.0
# what the tokenizer manager's SIGTERM watchdog polls before it kills its own process tree (-9)
DRAIN_POLL_S = 0.05


class SimServer:
    def __init__(self, cfg: SimConfig, log: SimLog | None = None):
        self.cfg = cfg
        self.log = log or SimLog(cfg.log_level, cfg.log_level_http)
        # a node's first scheduler process is TP rank node_rank * tp_size / nnodes (SGLang's tp_rank_range)
        first_tp = cfg.node_rank * cfg.tp_per_node
        self.log.rank_prefix = "".join(f" {tag}{rank}" for tag, size, rank in
                                       (("DP", cfg.dp_size, 0), ("TP", cfg.tp_size, first_tp)) if size > 1)
        self.dist: Rendezvous | Member | None = None  # --nnodes > 1: the node ranks' rendezvous (dist.py)
        self.model_cfg = read_model_config(cfg.model_path)
        self.context_len = cfg.context_length or int(self.model_cfg.get("max_position_embeddings", 40960))
        self.mem = MemoryModel.from_config(self.model_cfg, cfg)
        self.max_total_tokens = cfg.max_total_tokens or self.mem.kv_tokens()
        self.gpus = SimGpus.of(self)  # what NVML would read of its GPUs (GET /sim/gpu)
        # the longest request and prompt the scheduler takes (0.5.5 tp_worker.py:294-298)
        self.max_req_len = min(self.context_len - 1, self.max_total_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.profile = cfg.profile
        self.running_per_dp = running_per_dp(cfg, self.max_total_tokens, self.context_len)
        self.running_limit = self.running_per_dp * max(1, cfg.dp_size)  # one scheduler stands in for every rank
        self.chunked_prefill_size = cfg.chunked_prefill_size or 8192
        # SGLang's is_mixed_chunk: the flag counts only with chunked prefill on, a size <= 0 turning it off
        # (0.5.23 scheduler.py:1372-1378; 0.5.10 :878-884; 0.5.5 :445-451)
        self.mixed_chunk = cfg.enable_mixed_chunk and self.chunked_prefill_size > 0
        self.max_prefill_tokens = 16384
        self.metrics = SimMetrics(
            cfg.model_name, tp_ranks=cfg.tp_per_node if cfg.enable_metrics_for_all_schedulers else 1,  # its node's
            priority=cfg.enable_priority_scheduling and self.profile.priority_labelled_metrics,
            retraction_counters=self.profile.retraction_counters,
        ) if cfg.enable_metrics else None
        self.tokenizer: Tokenizer | None = None
        self.generator: OutputGenerator | None = None
        self.scheduler: Scheduler | None = None
        self.status = ServerStatus.STARTING
        self.paused = False
        self._continue = asyncio.Event()
        self._continue.set()
        self.faults = Faults(self)
        self.in_flight_rids: dict[str, SimRequest] = {}  # rid -> the request that owns it now
        self.runner: web.AppRunner | None = None
        self.host = cfg.host
        self.port = cfg.port
        self._ready = asyncio.Event()
        self._stopped = asyncio.Event()
        self.tasks: list[asyncio.Task] = []  # cancelled by stop()
        self.exit_code: int | None = None
        self.started_at = time.time()
        self.intake = Intake(self)

    # What start() builds, for the code that only runs once it has (the request handlers, the warm-up): None there
    # is a bug, not a state to serve through.
    @property
    def loaded_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RuntimeError("the simulator's tokenizer is used before start() loaded it")
        return self.tokenizer

    @property
    def loaded_generator(self) -> OutputGenerator:
        if self.generator is None:
            raise RuntimeError("the simulator's output generator is used before start() built it")
        return self.generator

    @property
    def started_scheduler(self) -> Scheduler:
        if self.scheduler is None:
            raise RuntimeError("the simulator's scheduler is used before start() started it")
        return self.scheduler

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    # --- lifecycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load, bind the port (fails like uvicorn when busy), then warm up in the background (startup.py)."""
        await Startup(self).run()

    def mark_ready(self) -> None:
        self.status = ServerStatus.READY
        self._ready.set()

    async def wait_ready(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        if self.status == ServerStatus.STOPPED:
            return
        if self.status != ServerStatus.CRASHED:
            self.status = ServerStatus.STOPPED
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()
        self.faults.end_hang()
        if self.scheduler is not None:
            self.scheduler.abort("", abort_all=True)
            await self.scheduler.stop()
        if self.dist is not None:
            await self.dist.close()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
        self._stopped.set()

    async def drain_and_stop(self, signum: int = 15) -> None:
        """SIGTERM: /health turns 503 at once, /generate keeps serving in-flight and new requests until none is
        left, then the server kills its own process tree: exit status -9 (0.5.5 http_server.py:416,
        tokenizer_manager.py:1410-1444)."""
        self.log.info(f"SIGTERM received. signum={signum}, frame=None. Draining requests and shutting down...")
        self.status = ServerStatus.DRAINING
        deadline = time.monotonic() + self.cfg.sim_drain_timeout_s
        next_line = 0.0
        while (self.in_flight_rids or (self.scheduler and (self.scheduler.num_running or self.scheduler.num_waiting))) \
                and time.monotonic() < deadline and not self.faults.hung:
            if time.monotonic() >= next_line:  # SGLang logs it on each of its 5 s polls
                next_line = time.monotonic() + 5.0
                self.log.info(f"Gracefully exiting... Remaining number of requests {len(self.in_flight_rids)}. "
                              f"Remaining requests remaining_rids={list(self.in_flight_rids)[:16]}.")
            await asyncio.sleep(DRAIN_POLL_S)
        left = len(self.in_flight_rids)
        if left:
            self.log.warning(f"Drain timed out with {left} request(s) in flight; aborting them.")
        if self.cfg.exit_process_on_fault:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # kill_process_tree(include_parent=True): status -9
        self.exit_code = -signal.SIGKILL
        await self.stop()

    # --- requests ---------------------------------------------------------------------------------------------
    async def health(self) -> int:
        """GET /health: 503 while starting or draining; else a 1-token generation through the scheduler, healthy
        once the scheduler has produced anything since the check began, looked at after each second."""
        if self.status != ServerStatus.READY:
            return 503
        ids = [0]
        req = SimRequest(rid=f"HEALTH_CHECK_{time.time()}", prompt_ids=ids,
                         plan=self.loaded_generator.plan(b"health", ids, 1), max_new_tokens=1, log_metrics=False)
        tic = time.monotonic()
        scheduler = self.started_scheduler
        scheduler.submit(req)  # also on the --sim-instant path: the check runs through the scheduler
        try:
            while time.monotonic() < tic + HEALTH_CHECK_TIMEOUT_S:
                await asyncio.sleep(HEALTH_POLL_S)
                if self.status == ServerStatus.DRAINING:
                    return 503
                if scheduler.last_output_mono > tic:
                    return 200
            self.log.error(f"Health check failed. Server couldn't get a response from detokenizer for last "
                           f"{HEALTH_CHECK_TIMEOUT_S:.0f} seconds. tic start time: {time.strftime('%H:%M:%S')}. "
                           f"last_heartbeat time: {time.strftime('%H:%M:%S')}")
            return 503
        finally:
            if req.state in (RequestState.WAITING, RequestState.RUNNING):
                scheduler.abort_one(req)

    async def wait_unpaused(self) -> None:
        await self._continue.wait()

    def pause(self, mode: PauseMode) -> None:
        self.paused = True
        self._continue.clear()
        if mode == PauseMode.ABORT:
            self.started_scheduler.abort("", abort_all=True)
        else:
            self.started_scheduler.hold(True)

    def resume(self) -> None:
        self.paused = False
        self.started_scheduler.hold(False)
        self._continue.set()

    def finish_instant(self, req: SimRequest) -> None:
        req.state = RequestState.FINISHED
        req.output_ids = req.plan.output_ids
        req.finish_reason = req.plan.finish_reason
        req.first_token_mono = time.monotonic()
        self.on_finish(req)

    def on_finish(self, req: SimRequest) -> None:
        """A request left the scheduler: its metrics, then the fault switches' count (client requests only)."""
        if not req.log_metrics:
            return
        if req.finish_reason is None:
            raise RuntimeError(f"request {req.rid!r} finished without a finish_reason")
        if self.metrics is not None:
            now = time.monotonic()
            ttft = req.first_token_mono - req.created_mono if req.first_token_mono is not None else None
            self.metrics.observe_finished(
                prompt_tokens=0 if req.aborted_in_queue else req.prompt_len,
                completion_tokens=len(req.output_ids or ()), cached_tokens=req.cached_tokens,
                e2e_s=now - req.created_mono, ttft_s=ttft, aborted=req.finish_reason["type"] == FinishReason.ABORT)
        self.faults.request_finished()


async def run_simulator(cfg: SimConfig, log: SimLog | None = None) -> SimServer:
    """Start a simulated SGLang server in the running event loop; returns once the port is bound.

    `await server.wait_ready()` waits for "The server is fired up and ready to roll!".
    """
    cfg.validate()
    server = SimServer(cfg, log)
    try:
        await server.start()
    except BaseException:
        await server.stop()
        raise
    return server


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)).rstrip()
