"""Fatal faults of one simulated server: the --sim-*-after switches, a dead scheduler or node rank."""
from __future__ import annotations

import asyncio
import os
import sys
import traceback
from typing import TYPE_CHECKING

from engine.simulator.dist import Joiner
from engine.simulator.server_state import ServerStatus

if TYPE_CHECKING:
    from engine.simulator.server import SimServer

SCHEDULER_SIGQUIT = "SIGQUIT received. signum=None, frame=None. It usually means one child failed."
CHILD_SIGQUIT = "Received sigquit from a child process. It usually means the child failed."


def crash_lines(final: str) -> str:
    """The traceback of a scheduler that died in its event loop, ending in `final`."""
    return ("Traceback (most recent call last):\n"
            '  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 2712, '
            "in run_scheduler_process\n    scheduler.event_loop_overlap()\n"
            '  File "/usr/local/lib/python3.12/dist-packages/torch/utils/_contextlib.py", line 120, '
            "in decorate_context\n    return func(*args, **kwargs)\n"
            '  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 1013, '
            "in event_loop_overlap\n    batch_result = self.run_batch(batch)\n"
            '  File "/sgl-workspace/sglang/python/sglang/srt/model_executor/model_runner.py", line 2105, '
            "in forward\n    output = self._forward_raw(\n" + final + "\n")


class Faults:
    """Counts finished client requests, trips the fault switches, and crashes the server as SGLang's would."""

    def __init__(self, server: SimServer):
        self.server = server
        self.completed = 0  # finished client requests (the switches' counter)
        self.hung = False
        self._hang_forever: asyncio.Future | None = None

    def request_finished(self) -> None:
        self.completed += 1
        cfg = self.server.cfg
        if cfg.sim_crash_after is not None and self.completed >= cfg.sim_crash_after:
            self.fatal_soon(crash_lines("RuntimeError: CUDA error: an illegal memory access was encountered\n"
                                        "CUDA kernel errors might be asynchronously reported at some other "
                                        "API call, so the stacktrace below might be incorrect."), SCHEDULER_SIGQUIT)
        elif cfg.sim_oom_after is not None and self.completed >= cfg.sim_oom_after:
            self.fatal_soon(crash_lines(
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                f"of {cfg.sim_gpu_mem_gb:.2f} GiB of which 1.12 GiB is free. Including non-PyTorch memory, this "
                "process has 138.10 GiB memory in use. Of the allocated memory 131.40 GiB is allocated by PyTorch, "
                "and 2.37 GiB is reserved by PyTorch but unallocated."), CHILD_SIGQUIT)
        elif cfg.sim_hang_after is not None and self.completed >= cfg.sim_hang_after and not self.hung:
            self.hung = True
            self._hang_forever = asyncio.get_running_loop().create_future()
            self.server.started_scheduler.freeze()

    def hang_future(self) -> asyncio.Future:
        """What every request of a hung server waits on: the port stays open, nothing answers."""
        if self._hang_forever is None:
            raise RuntimeError("hang_future() before --sim-hang-after hung the server")
        return self._hang_forever

    def end_hang(self) -> None:
        if self._hang_forever is not None and not self._hang_forever.done():
            self._hang_forever.cancel()

    def scheduler_ended(self, task: asyncio.Task) -> None:
        """A bug in the scheduler loop is fatal, as in SGLang: traceback, SIGQUIT line, exit 1."""
        if task.cancelled() or task.exception() is None:
            return
        self.fatal_soon("".join(traceback.format_exception(task.exception())), SCHEDULER_SIGQUIT)

    def rank_lost(self, joiner: Joiner | None) -> None:
        """A node rank's connection closed (`joiner` None: rank 0's, seen from a rank > 0): the next collective fails
        with NCCL's remote-error, the scheduler dies and takes the server with it, as in SGLang."""
        s = self.server
        if s.status in (ServerStatus.STOPPED, ServerStatus.CRASHED):
            return
        tpn = s.cfg.tp_per_node
        if joiner:
            rank, peer = joiner.node_rank, joiner.peer
        elif s.dist is not None:
            rank, peer = 0, f"{s.dist.addr.host}<{s.dist.addr.port}>"
        else:
            raise RuntimeError("rank 0 was reported lost before this node rank joined it")
        error = ("torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/"
                 "ProcessGroupNCCL.cpp:3356, remote process exited or there was a network error, NCCL version 2.21.5\n"
                 "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting "
                 "prematurely.\nLast error:\n"
                 f"socketProgress: Connection closed by remote peer {peer} (node rank {rank}, TP ranks "
                 f"{rank * tpn}-{rank * tpn + tpn - 1})")
        self.fatal_soon(crash_lines(error), SCHEDULER_SIGQUIT if joiner else CHILD_SIGQUIT)

    def fatal_soon(self, traceback_text: str, sigquit_line: str) -> None:
        s = self.server
        if s.status == ServerStatus.CRASHED:
            return
        s.status = ServerStatus.CRASHED

        async def die() -> None:
            await asyncio.sleep(0.05)  # let the response that completed the count go out, as a real crash races
            s.log.sched_error(f"Scheduler hit an exception: {traceback_text.rstrip()}")
            s.log.error(sigquit_line)
            if s.cfg.exit_process_on_fault:
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except OSError:  # a full disk must not keep a dead server's process alive
                        pass
                os._exit(1)
            s.exit_code = 1
            await s.stop()

        s.tasks.append(asyncio.get_running_loop().create_task(die(), name="sim-crash"))
