"""One simulated server's startup sequence: SGLang's load lines, scheduler, port, warm-up."""
from __future__ import annotations

import asyncio
import errno
import os
import socket
from typing import TYPE_CHECKING

from aiohttp import web

from engine.simulator.dist import DEFAULT_TIMEOUT_S, DistError, Member, Rendezvous, parse_dist_addr
from engine.simulator.generator import OutputGenerator, load_tokenizer
from engine.simulator.request import SimRequest
from engine.simulator.scheduler import Scheduler
from engine.simulator.server_state import ServerStatus
from engine.simulator.sglang_check import check_installed
from engine.simulator.sizing import BYTES_PER_GB

if TYPE_CHECKING:
    from engine.simulator.server import SimServer

# uvicorn's timeout_keep_alive: idle keep-alive connections are closed after 5 s (0.5.5 http_server.py:1387;
# 0.5.23 SGLANG_TIMEOUT_KEEP_ALIVE=5), the same in every version
KEEPALIVE_TIMEOUT_S = 5.0


class StartupFailure(Exception):
    """The server died before it served (its scheduler's exception and the SIGQUIT line are logged)."""


def init_lines(path: str, line: int, func: str, final: str) -> str:
    """The traceback of a scheduler that died while initializing, ending in `final`."""
    return ("Traceback (most recent call last):\n"
            '  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 2700, '
            "in run_scheduler_process\n    scheduler = Scheduler(\n"
            f'  File "/sgl-workspace/sglang/python/sglang/srt/{path}", line {line}, in {func}\n'
            f"{final}\n")


class Startup:
    """Builds what a server serves with (tokenizer, generator, scheduler, HTTP site) and logs it as SGLang does."""

    def __init__(self, server: SimServer):
        self.server = server
        self.cfg = server.cfg
        self.log = server.log

    async def run(self) -> None:
        """Load, bind the port (fails like uvicorn when busy), then warm up in the background."""
        s, cfg, log = self.server, self.cfg, self.log
        args = ", ".join(f"{k}={v!r}" for k, v in cfg.server_args_dict().items() if k != "ignored_args")
        log.info(f"server_args=ServerArgs({args})")
        if cfg.ignored_args:
            log.warning(f"Simulator: ignoring SGLang flag(s) it does not model: {' '.join(cfg.ignored_args)}")
        installed = check_installed(s.profile)  # a new SGLang release moving a modelled default shows here
        if installed is not None:
            log.info(installed)
        tokenizer = s.tokenizer = await asyncio.to_thread(load_tokenizer, cfg.tokenizer)
        s.intake.special_pieces = dict(zip(tokenizer.all_special_ids,
                                           tokenizer.convert_ids_to_tokens(tokenizer.all_special_ids)))
        log.info("Using default HuggingFace chat template with detected content format: string")
        log.sched("Init torch distributed begin.")
        if cfg.nnodes > 1:
            await self._rendezvous()
        log.sched("Init torch distributed ends. mem usage=0.00 GB")
        mem = s.mem
        avail = mem.total_gb - 0.5
        log.sched(f"Load weight begin. avail mem={avail:.2f} GB")
        s.generator = await asyncio.to_thread(self._build_generator)
        if cfg.sim_slow_start_s > 0:
            await asyncio.sleep(cfg.sim_slow_start_s)
        shards = max(1, round(mem.weight_gb * cfg.tp_size / 4))
        log.raw(f"Loading safetensors checkpoint shards: 100% Completed | {shards}/{shards} [00:00<00:00, 0.00it/s]")
        avail -= mem.weight_gb
        arch = (s.model_cfg.get("architectures") or ["Qwen3ForCausalLM"])[0]
        log.sched(f"Load weight end. type={arch}, dtype=torch.bfloat16, avail mem={avail:.2f} GB, "
                  f"mem usage={mem.weight_gb:.2f} GB.")
        if cfg.max_total_tokens is None and mem.free_gb <= 0:  # the weights leave no room for a KV pool
            self._failed(init_lines(
                "model_executor/model_runner.py", 1788, "init_memory_pool",
                "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static. Current value: "
                f"self.server_args.mem_fraction_static={mem.mem_fraction}"))
        kv_gb = s.max_total_tokens * mem.kv_bytes_per_token / BYTES_PER_GB
        log.sched(f"KV Cache is allocated. #tokens: {s.max_total_tokens}, K size: {kv_gb / 2:.2f} GB, "
                  f"V size: {kv_gb / 2:.2f} GB")
        avail -= kv_gb
        log.sched(f"Memory pool end. avail mem={avail:.2f} GB")
        log.sched(f"Capture cuda graph begin. This can take up to several minutes. avail mem={avail:.2f} GB")
        bs = [1, 2, 4, 8] + list(range(16, min(256, s.running_per_dp) + 1, 16))
        log.sched(f"Capture cuda graph bs {bs}")
        log.sched(f"Capture cuda graph end. Time elapsed: 0.00 s. mem usage=0.50 GB. avail mem={avail - 0.5:.2f} GB.")
        log.sched(f"max_total_num_tokens={s.max_total_tokens}, chunked_prefill_size={s.chunked_prefill_size}, "
                  f"max_prefill_tokens={s.max_prefill_tokens}, max_running_requests={s.running_per_dp}, "
                  f"context_len={s.context_len}, available_gpu_mem={avail - 0.5:.2f} GB")
        if s.metrics is not None:
            s.metrics.set_static(max_total_num_tokens=s.max_total_tokens, context_len=s.context_len)
        scheduler = s.scheduler = Scheduler(
            log=log, metrics=s.metrics, max_running=s.running_limit, max_total_tokens=s.max_total_tokens,
            max_prefill_tokens=s.max_prefill_tokens, step_ms=cfg.sim_step_ms,
            step_ms_per_req=cfg.sim_step_ms_per_req, tokens_per_step=cfg.sim_tokens_per_step,
            prefill_ms_per_1k=cfg.sim_prefill_ms_per_1k, decode_log_interval=cfg.decode_log_interval,
            on_finish=s.on_finish, page_size=cfg.page_size, radix_cache=not cfg.disable_radix_cache,
            profile=s.profile, scheduling=s.profile.scheduling.with_env(os.environ),
            conservativeness=cfg.schedule_conservativeness, mixed_chunk=s.mixed_chunk)
        scheduler.start()
        scheduler.add_done_callback(s.faults.scheduler_ended)
        sock = self._bind()
        if cfg.node_rank > 0:  # no tokenizer manager, no API: SGLang's dummy health server, until rank 0 goes
            await self._serve_dummy_health(sock)
            return
        from engine.simulator.app import build_app  # app imports the server's types

        s.runner = web.AppRunner(build_app(s), handler_cancellation=True, access_log=None,
                                 shutdown_timeout=1.0, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
        await s.runner.setup()
        site = web.SockSite(s.runner, sock)
        await site.start()
        log.uvicorn(f"Started server process [{os.getpid()}]")
        log.uvicorn("Waiting for application startup.")
        log.uvicorn("Application startup complete.")
        log.uvicorn(f"Uvicorn running on http://{s.host}:{s.port} (Press CTRL+C to quit)")
        s.tasks.append(asyncio.get_running_loop().create_task(self._warmup(), name="sim-warmup"))

    async def _rendezvous(self) -> None:
        """Rank 0 waits for every other node rank at the dist-init address; a rank > 0 joins it. Either end losing
        the other later is fatal (Faults.rank_lost)."""
        s, cfg = self.server, self.cfg
        if cfg.dist_init_addr is None:  # SimConfig.validate() refuses --nnodes > 1 without it
            raise ValueError(f"--nnodes {cfg.nnodes}: please provide --dist-init-addr as host:port of head node")
        addr = parse_dist_addr(cfg.dist_init_addr)
        timeout = float(cfg.dist_timeout or DEFAULT_TIMEOUT_S)
        try:
            if cfg.node_rank == 0:
                rendezvous = s.dist = Rendezvous(addr, cfg.nnodes, cfg.tp_size, s.faults.rank_lost)
                await rendezvous.open()
                await rendezvous.wait_all(timeout)
            else:
                member = s.dist = Member(addr, cfg.node_rank, cfg.nnodes, cfg.tp_size, lambda: s.faults.rank_lost(None))
                await member.join(timeout)
        except DistError as exc:
            self._failed(init_lines("distributed/parallel_state.py", 1288, "init_distributed_environment", str(exc)))

    async def _serve_dummy_health(self, sock: socket.socket) -> None:
        """A rank > 0 answers only /health and /health_generate (and /ping), each 200, on its --host/--port
        (SGLang's launch_dummy_health_check_server); no ready line."""
        async def ok(request: web.Request) -> web.Response:
            return web.Response(status=200)

        s = self.server
        app = web.Application()
        for path in ("/health", "/health_generate", "/ping"):
            app.router.add_get(path, ok)
        s.runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
        await s.runner.setup()
        await web.SockSite(s.runner, sock).start()
        self.log.info(f"Starting dummy health check server at {s.host}:{s.port}")
        s.mark_ready()

    def _failed(self, traceback_text: str) -> None:
        """The scheduler died while initializing: its exception, the launcher's SIGQUIT line, and no server."""
        self.server.status = ServerStatus.CRASHED
        self.server.exit_code = 1
        self.log.sched_error(f"Scheduler hit an exception: {traceback_text.rstrip()}")
        self.log.error("Received sigquit from a child process. It usually means the child failed.")
        raise StartupFailure(traceback_text.rstrip().splitlines()[-1])

    def _build_generator(self) -> OutputGenerator:
        cfg = self.cfg
        gen = OutputGenerator(self.server.loaded_tokenizer, seed=cfg.sim_seed, mean=cfg.sim_output_mean,
                              sigma=cfg.sim_output_sigma, empty_share=cfg.sim_empty_share,
                              abort_rate=cfg.sim_abort_rate, loop_share=cfg.sim_loop_share,
                              repetitive_share=cfg.sim_repetitive_share)
        if cfg.sim_instant:
            gen.build_instant_pool(cfg.sim_instant_pool)
        return gen

    def _bind(self) -> socket.socket:
        s = self.server
        family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((s.host, s.port))
        except OSError as exc:
            sock.close()
            reason = (exc.strerror or str(exc)).lower()
            message = f"[Errno {exc.errno}] error while attempting to bind on address {(s.host, s.port)!r}: {reason}"
            self.log.uvicorn(message, level="ERROR")
            raise OSError(exc.errno or errno.EADDRINUSE, message) from exc
        sock.listen(1024)
        sock.setblocking(False)
        s.port = sock.getsockname()[1]
        return sock

    async def _warmup(self) -> None:
        s, cfg = self.server, self.cfg
        if cfg.sim_load_s > 0:
            await asyncio.sleep(cfg.sim_load_s)
        if not cfg.skip_server_warmup:
            self.log.access("127.0.0.1:0", "GET", s.profile.warmup_info_path, 200)
            ids = s.loaded_tokenizer.encode("The capital city of France is")
            plan = s.loaded_generator.plan(b"warmup", ids, 8)
            req = SimRequest(rid="WARMUP_" + os.urandom(4).hex(), prompt_ids=ids, plan=plan, max_new_tokens=8,
                             log_metrics=False)
            if not cfg.sim_instant:  # instant servers have no batching delay to warm up
                s.started_scheduler.submit(req)
                await req.done_future()
            self.log.access("127.0.0.1:0", "POST", "/generate", 200)
        if s.status == ServerStatus.STARTING:
            s.mark_ready()
            self.log.info("The server is fired up and ready to roll!")
