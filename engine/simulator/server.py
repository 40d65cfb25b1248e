"""SimServer: startup sequence, the scheduler, fault switches and shutdown of one simulated SGLang server."""
from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass

from aiohttp import web

from engine.simulator.config import SimConfig, read_model_config
from engine.simulator.dist import (
    DEFAULT_TIMEOUT_S,
    DistError,
    Joiner,
    Member,
    Rendezvous,
    parse_dist_addr,
)
from engine.simulator.generator import (
    OutputGenerator,
    Tokenizer,
    load_tokenizer,
)
from engine.simulator.gpu import SimGpus
from engine.simulator.intake import Intake
from engine.simulator.metrics import SimMetrics
from engine.simulator.request import RequestState, SimRequest
from engine.simulator.scheduler import Scheduler
from engine.simulator.sglang_check import check_installed
from engine.simulator.simlog import SimLog

BYTES_PER_GB = 1 << 30
# uvicorn's timeout_keep_alive: idle keep-alive connections are closed after 5 s (0.5.5 http_server.py:1387;
# 0.5.23 SGLANG_TIMEOUT_KEEP_ALIVE=5), the same in every version
KEEPALIVE_TIMEOUT_S = 5.0
# /health sleeps 1 s, then is healthy when the scheduler has answered anything since it started, checking
# each second up to SGLANG_HEALTH_CHECK_TIMEOUT (0.5.5 http_server.py:406-481, :462; 0.5.23 :779)
HEALTH_POLL_S = 1.0
HEALTH_CHECK_TIMEOUT_S = 20.0
# what the tokenizer manager's SIGTERM watchdog polls before it kills its own process tree (-9)
DRAIN_POLL_S = 0.05


def default_max_num_reqs(max_total_tokens: int, context_len: int) -> int:
    """SGLang's request slots when nothing sets them (0.5.5 model_runner.py:1592-1601)."""
    return min(max(int(max_total_tokens / context_len * 512), 2048), 4096)


def running_per_dp(cfg: SimConfig, max_total_tokens: int, context_len: int) -> int:
    """The batch one DP rank's scheduler runs (0.5.5 tp_worker.py:281-289): --max-running-requests split
    over the DP ranks, else half the KV pool; never more than the request slots."""
    slots = cfg.sim_max_num_reqs
    if cfg.max_running_requests is not None:
        wanted = max(1, cfg.max_running_requests // max(1, cfg.dp_size))
        return min(wanted, slots) if slots else wanted
    return max(1, min(max_total_tokens // 2, slots or default_max_num_reqs(max_total_tokens, context_len)))


@dataclass(frozen=True)
class MemoryModel:
    """Plausible memory figures for the startup lines, from config.json (a Qwen3-27B-like default)."""
    weight_gb: float
    kv_bytes_per_token: int
    total_gb: float
    mem_fraction: float

    @classmethod
    def from_config(cls, model_cfg: dict, cfg: SimConfig) -> "MemoryModel":
        h = model_cfg.get("hidden_size", 5120)
        layers = model_cfg.get("num_hidden_layers", 64)
        heads = model_cfg.get("num_attention_heads", 40)
        kv_heads = model_cfg.get("num_key_value_heads", 8)
        head_dim = model_cfg.get("head_dim", h // max(1, heads))
        inter = model_cfg.get("intermediate_size", 25600)
        vocab = model_cfg.get("vocab_size", 151936)
        per_layer = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2 + 3 * h * inter
        params = layers * per_layer + 2 * vocab * h
        tp = max(1, cfg.tp_size)
        kv = layers * kv_heads * head_dim * 2 * 2 // tp  # K and V, bf16
        return cls(params * 2 / BYTES_PER_GB / tp, max(1, kv), cfg.sim_gpu_mem_gb, cfg.mem_fraction_static or 0.88)

    @property
    def free_gb(self) -> float:
        """What the static fraction leaves for the KV pool once the weights are loaded."""
        return self.total_gb * self.mem_fraction - self.weight_gb

    def kv_tokens(self) -> int:
        return max(4096, int(self.free_gb * BYTES_PER_GB / self.kv_bytes_per_token))


class StartupFailure(Exception):
    """The server died before it served (its scheduler's exception and the SIGQUIT line are logged)."""


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
        self.max_prefill_tokens = 16384
        self.metrics = SimMetrics(
            cfg.model_name, tp_ranks=cfg.tp_per_node if cfg.enable_metrics_for_all_schedulers else 1,  # its node's
            priority=cfg.enable_priority_scheduling and self.profile.priority_labelled_metrics,
            retraction_counters=self.profile.retraction_counters,
        ) if cfg.enable_metrics else None
        self.tokenizer: Tokenizer | None = None
        self.generator: OutputGenerator | None = None
        self.scheduler: Scheduler | None = None
        self.status = "starting"  # starting | ready | draining | stopped | crashed
        self.paused = False
        self._continue = asyncio.Event()
        self._continue.set()
        self.completed = 0  # finished client requests (fault switch counter)
        self.hung = False
        self._hang_forever: asyncio.Future | None = None
        self.in_flight_rids: dict[str, SimRequest] = {}  # rid -> the request that owns it now
        self._runner: web.AppRunner | None = None
        self._sock: socket.socket | None = None
        self.host = cfg.host
        self.port = cfg.port
        self._ready = asyncio.Event()
        self._stopped = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.exit_code: int | None = None
        self.started_at = time.time()
        self.intake = Intake(self)

    # --- public ------------------------------------------------------------------------------------------
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

    async def wait_ready(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def stop(self) -> None:
        if self.status == "stopped":
            return
        if self.status != "crashed":
            self.status = "stopped"
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        if self._hang_forever is not None and not self._hang_forever.done():
            self._hang_forever.cancel()
        if self.scheduler is not None:
            self.scheduler.abort("", abort_all=True)
            await self.scheduler.stop()
        if self.dist is not None:
            await self.dist.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._stopped.set()

    # --- startup --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load, bind the port (fails like uvicorn when busy), then warm up in the background."""
        cfg, log = self.cfg, self.log
        args = ", ".join(f"{k}={v!r}" for k, v in self.cfg.server_args_dict().items() if k != "ignored_args")
        log.info(f"server_args=ServerArgs({args})")
        if cfg.ignored_args:
            log.warning(f"Simulator: ignoring SGLang flag(s) it does not model: {' '.join(cfg.ignored_args)}")
        installed = check_installed(self.profile)  # a new SGLang release moving a modelled default shows here
        if installed is not None:
            log.info(installed)
        tokenizer = self.tokenizer = await asyncio.to_thread(load_tokenizer, cfg.tokenizer)
        self.intake.special_pieces = dict(zip(tokenizer.all_special_ids,
                                       tokenizer.convert_ids_to_tokens(tokenizer.all_special_ids)))
        log.info("Using default HuggingFace chat template with detected content format: string")
        log.sched("Init torch distributed begin.")
        if cfg.nnodes > 1:
            await self._rendezvous()
        log.sched("Init torch distributed ends. mem usage=0.00 GB")
        avail = self.mem.total_gb - 0.5
        log.sched(f"Load weight begin. avail mem={avail:.2f} GB")
        self.generator = await asyncio.to_thread(self._build_generator)
        if cfg.sim_slow_start_s > 0:
            await asyncio.sleep(cfg.sim_slow_start_s)
        shards = max(1, round(self.mem.weight_gb * cfg.tp_size / 4))
        log.raw(f"Loading safetensors checkpoint shards: 100% Completed | {shards}/{shards} [00:00<00:00, 0.00it/s]")
        avail -= self.mem.weight_gb
        arch = (self.model_cfg.get("architectures") or ["Qwen3ForCausalLM"])[0]
        log.sched(f"Load weight end. type={arch}, dtype=torch.bfloat16, avail mem={avail:.2f} GB, "
                 f"mem usage={self.mem.weight_gb:.2f} GB.")
        if cfg.max_total_tokens is None and self.mem.free_gb <= 0:  # the weights leave no room for a KV pool
            self._startup_failed(self._init_lines(
                "model_executor/model_runner.py", 1788, "init_memory_pool",
                "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: "
                f"self.server_args.mem_fraction_static={self.mem.mem_fraction}"))
        kv_gb = self.max_total_tokens * self.mem.kv_bytes_per_token / BYTES_PER_GB
        log.sched(f"KV Cache is allocated. #tokens: {self.max_total_tokens}, K size: {kv_gb / 2:.2f} GB, "
                 f"V size: {kv_gb / 2:.2f} GB")
        avail -= kv_gb
        log.sched(f"Memory pool end. avail mem={avail:.2f} GB")
        log.sched(f"Capture cuda graph begin. This can take up to several minutes. avail mem={avail:.2f} GB")
        bs = [1, 2, 4, 8] + list(range(16, min(256, self.running_per_dp) + 1, 16))
        log.sched(f"Capture cuda graph bs {bs}")
        log.sched(f"Capture cuda graph end. Time elapsed: 0.00 s. mem usage=0.50 GB. avail mem={avail - 0.5:.2f} GB.")
        log.sched(f"max_total_num_tokens={self.max_total_tokens}, chunked_prefill_size={self.chunked_prefill_size}, "
                 f"max_prefill_tokens={self.max_prefill_tokens}, max_running_requests={self.running_per_dp}, "
                 f"context_len={self.context_len}, available_gpu_mem={avail - 0.5:.2f} GB")
        if self.metrics is not None:
            self.metrics.set_static(max_total_num_tokens=self.max_total_tokens, context_len=self.context_len)
        scheduler = self.scheduler = Scheduler(
            log=log, metrics=self.metrics, max_running=self.running_limit, max_total_tokens=self.max_total_tokens,
            max_prefill_tokens=self.max_prefill_tokens, step_ms=cfg.sim_step_ms,
            step_ms_per_req=cfg.sim_step_ms_per_req, tokens_per_step=cfg.sim_tokens_per_step,
            prefill_ms_per_1k=cfg.sim_prefill_ms_per_1k, decode_log_interval=cfg.decode_log_interval,
            on_finish=self._on_finish, page_size=cfg.page_size, radix_cache=not cfg.disable_radix_cache,
            profile=self.profile, scheduling=self.profile.scheduling.with_env(os.environ),
            conservativeness=cfg.schedule_conservativeness)
        scheduler.start()
        scheduler.add_done_callback(self._scheduler_ended)
        sock = self._bind()
        if cfg.node_rank > 0:  # no tokenizer manager, no API: SGLang's dummy health server, until rank 0 goes
            await self._serve_dummy_health(sock)
            return
        from engine.simulator.app import build_app  # app imports this module's types

        self._runner = web.AppRunner(build_app(self), handler_cancellation=True, access_log=None,
                                     shutdown_timeout=1.0, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
        await self._runner.setup()
        site = web.SockSite(self._runner, sock)
        await site.start()
        log.uvicorn(f"Started server process [{os.getpid()}]")
        log.uvicorn("Waiting for application startup.")
        log.uvicorn("Application startup complete.")
        log.uvicorn(f"Uvicorn running on http://{self.host}:{self.port} (Press CTRL+C to quit)")
        self._tasks.append(asyncio.get_running_loop().create_task(self._warmup(), name="sim-warmup"))

    async def _rendezvous(self) -> None:
        """Rank 0 waits for every other node rank at the dist-init address; a rank > 0 joins it. Either end losing
        the other later is fatal (_rank_lost)."""
        cfg = self.cfg
        if cfg.dist_init_addr is None:  # SimConfig.validate() refuses --nnodes > 1 without it
            raise ValueError(f"--nnodes {cfg.nnodes}: please provide --dist-init-addr as host:port of head node")
        addr = parse_dist_addr(cfg.dist_init_addr)
        timeout = float(cfg.dist_timeout or DEFAULT_TIMEOUT_S)
        try:
            if cfg.node_rank == 0:
                self.dist = Rendezvous(addr, cfg.nnodes, cfg.tp_size, self._rank_lost)
                await self.dist.open()
                await self.dist.wait_all(timeout)
            else:
                self.dist = Member(addr, cfg.node_rank, cfg.nnodes, cfg.tp_size, lambda: self._rank_lost(None))
                await self.dist.join(timeout)
        except DistError as exc:
            self._startup_failed(self._init_lines("distributed/parallel_state.py", 1288,
                                                  "init_distributed_environment", str(exc)))

    def _rank_lost(self, joiner: Joiner | None) -> None:
        """A node rank's connection closed (`joiner` None: rank 0's, seen from a rank > 0): the next collective fails
        with NCCL's remote-error, the scheduler dies and takes the server with it, as in SGLang."""
        if self.status in ("stopped", "crashed"):
            return
        tpn = self.cfg.tp_per_node
        if joiner:
            rank, peer = joiner.node_rank, joiner.peer
        elif self.dist is not None:
            rank, peer = 0, f"{self.dist.addr.host}<{self.dist.addr.port}>"
        else:
            raise RuntimeError("rank 0 was reported lost before this node rank joined it")
        error = ("torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/"
                 "ProcessGroupNCCL.cpp:3356, remote process exited or there was a network error, NCCL version 2.21.5\n"
                 "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting "
                 "prematurely.\nLast error:\n"
                 f"socketProgress: Connection closed by remote peer {peer} (node rank {rank}, TP ranks "
                 f"{rank * tpn}-{rank * tpn + tpn - 1})")
        sigquit = ("SIGQUIT received. signum=None, frame=None. It usually means one child failed." if joiner else
                   "Received sigquit from a child process. It usually means the child failed.")
        self._fatal_soon(self._crash_lines(error), sigquit)

    async def _serve_dummy_health(self, sock: socket.socket) -> None:
        """A rank > 0 answers only /health and /health_generate (and /ping), each 200, on its --host/--port
        (SGLang's launch_dummy_health_check_server); no ready line."""
        async def ok(request: web.Request) -> web.Response:
            return web.Response(status=200)

        app = web.Application()
        for path in ("/health", "/health_generate", "/ping"):
            app.router.add_get(path, ok)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()
        self.log.info(f"Starting dummy health check server at {self.host}:{self.port}")
        self.status = "ready"
        self._ready.set()

    def _startup_failed(self, traceback_text: str) -> None:
        """The scheduler died while initializing: its exception, the launcher's SIGQUIT line, and no server."""
        self.status = "crashed"
        self.exit_code = 1
        self.log.sched_error(f"Scheduler hit an exception: {traceback_text.rstrip()}")
        self.log.error("Received sigquit from a child process. It usually means the child failed.")
        raise StartupFailure(traceback_text.rstrip().splitlines()[-1])

    @staticmethod
    def _init_lines(path: str, line: int, func: str, final: str) -> str:
        return ("Traceback (most recent call last):\n"
                '  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 2700, '
                "in run_scheduler_process\n    scheduler = Scheduler(\n"
                f'  File "/sgl-workspace/sglang/python/sglang/srt/{path}", line {line}, in {func}\n'
                f"{final}\n")

    def _build_generator(self) -> OutputGenerator:
        cfg = self.cfg
        gen = OutputGenerator(self.loaded_tokenizer, seed=cfg.sim_seed, mean=cfg.sim_output_mean,
                              sigma=cfg.sim_output_sigma, empty_share=cfg.sim_empty_share,
                              abort_rate=cfg.sim_abort_rate, loop_share=cfg.sim_loop_share,
                              repetitive_share=cfg.sim_repetitive_share)
        if cfg.sim_instant:
            gen.build_instant_pool(cfg.sim_instant_pool)
        return gen

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            reason = (exc.strerror or str(exc)).lower()
            message = f"[Errno {exc.errno}] error while attempting to bind on address {(self.host, self.port)!r}: {reason}"
            self.log.uvicorn(message, level="ERROR")
            raise OSError(exc.errno or errno.EADDRINUSE, message) from exc
        sock.listen(1024)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        return sock

    async def _warmup(self) -> None:
        cfg = self.cfg
        if cfg.sim_load_s > 0:
            await asyncio.sleep(cfg.sim_load_s)
        if not cfg.skip_server_warmup:
            self.log.access("127.0.0.1:0", "GET", self.profile.warmup_info_path, 200)
            ids = self.loaded_tokenizer.encode("The capital city of France is")
            plan = self.loaded_generator.plan(b"warmup", ids, 8)
            req = SimRequest(rid="WARMUP_" + os.urandom(4).hex(), prompt_ids=ids, plan=plan, max_new_tokens=8,
                             log_metrics=False)
            if cfg.sim_instant:
                pass  # instant servers have no batching delay to warm up
            else:
                self.started_scheduler.submit(req)
                await req.done_future()
            self.log.access("127.0.0.1:0", "POST", "/generate", 200)
        if self.status == "starting":
            self.status = "ready"
            self._ready.set()
            self.log.info("The server is fired up and ready to roll!")

    # --- requests ---------------------------------------------------------------------------------------------
    async def health(self) -> int:
        """GET /health: 503 while starting or draining; else a 1-token generation through the scheduler, healthy
        once the scheduler has produced anything since the check began, looked at after each second."""
        if self.status != "ready":
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
                if self.status == "draining":
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

    def pause(self, mode: str) -> None:
        self.paused = True
        self._continue.clear()
        if mode == "abort":
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
        self._on_finish(req)

    # --- accounting and faults -------------------------------------------------------------------------------
    def _on_finish(self, req: SimRequest) -> None:
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
                e2e_s=now - req.created_mono, ttft_s=ttft, aborted=req.finish_reason["type"] == "abort")
        self.completed += 1
        cfg = self.cfg
        if cfg.sim_crash_after is not None and self.completed >= cfg.sim_crash_after:
            self._fatal_soon(self._crash_lines("RuntimeError: CUDA error: an illegal memory access was encountered\n"
                                               "CUDA kernel errors might be asynchronously reported at some other "
                                               "API call, so the stacktrace below might be incorrect."),
                             "SIGQUIT received. signum=None, frame=None. It usually means one child failed.")
        elif cfg.sim_oom_after is not None and self.completed >= cfg.sim_oom_after:
            self._fatal_soon(self._crash_lines(
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                f"of {self.cfg.sim_gpu_mem_gb:.2f} GiB of which 1.12 GiB is free. Including non-PyTorch memory, this "
                "process has 138.10 GiB memory in use. Of the allocated memory 131.40 GiB is allocated by PyTorch, "
                "and 2.37 GiB is reserved by PyTorch but unallocated."),
                "Received sigquit from a child process. It usually means the child failed.")
        elif cfg.sim_hang_after is not None and self.completed >= cfg.sim_hang_after and not self.hung:
            self.hung = True
            self._hang_forever = asyncio.get_running_loop().create_future()
            self.started_scheduler.freeze()

    def _scheduler_ended(self, task: asyncio.Task) -> None:
        """A bug in the scheduler loop is fatal, as in SGLang: traceback, SIGQUIT line, exit 1."""
        if task.cancelled() or task.exception() is None:
            return
        self._fatal_soon("".join(traceback.format_exception(task.exception())),
                         "SIGQUIT received. signum=None, frame=None. It usually means one child failed.")

    def hang_future(self) -> asyncio.Future:
        if self._hang_forever is None:
            raise RuntimeError("hang_future() before --sim-hang-after hung the server")
        return self._hang_forever

    @staticmethod
    def _crash_lines(final: str) -> str:
        return ("Traceback (most recent call last):\n"
                '  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 2712, '
                "in run_scheduler_process\n    scheduler.event_loop_overlap()\n"
                '  File "/usr/local/lib/python3.12/dist-packages/torch/utils/_contextlib.py", line 120, '
                "in decorate_context\n    return func(*args, **kwargs)\n"
                '  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 1013, '
                "in event_loop_overlap\n    batch_result = self.run_batch(batch)\n"
                '  File "/sgl-workspace/sglang/python/sglang/srt/model_executor/model_runner.py", line 2105, '
                "in forward\n    output = self._forward_raw(\n" + final + "\n")

    def _fatal_soon(self, traceback_text: str, sigquit_line: str) -> None:
        if self.status == "crashed":
            return
        self.status = "crashed"

        async def die() -> None:
            await asyncio.sleep(0.05)  # let the response that completed the count go out, as a real crash races
            self.log.sched_error(f"Scheduler hit an exception: {traceback_text.rstrip()}")
            self.log.error(sigquit_line)
            if self.cfg.exit_process_on_fault:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
            self.exit_code = 1
            await self.stop()

        self._tasks.append(asyncio.get_running_loop().create_task(die(), name="sim-crash"))

    # --- SIGTERM ------------------------------------------------------------------------------------------------
    async def drain_and_stop(self, signum: int = 15) -> None:
        """SIGTERM: /health turns 503 at once, /generate keeps serving in-flight and new requests until none is
        left, then the server kills its own process tree: exit status -9 (0.5.5 http_server.py:416,
        tokenizer_manager.py:1410-1444)."""
        self.log.info(f"SIGTERM received. signum={signum}, frame=None. Draining requests and shutting down...")
        self.status = "draining"
        deadline = time.monotonic() + self.cfg.sim_drain_timeout_s
        next_line = 0.0
        while (self.in_flight_rids or (self.scheduler and (self.scheduler.num_running or self.scheduler.num_waiting))) \
                and time.monotonic() < deadline and not self.hung:
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
