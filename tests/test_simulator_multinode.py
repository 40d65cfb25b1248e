"""One simulated SGLang server across two node ranks (`--nnodes 2 --node-rank i --dist-init-addr`), each rank its
own process as in SGLang: rank 0 serves only once rank 1 joined, rank 1 serves only the dummy health check, and
losing either rank ends the server."""
from __future__ import annotations

import re
import signal
import socket

import aiohttp
import pytest

from engine.simulator import parse_args
from tests.test_simulator_process import generate, launch  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(90)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_args(rank: int, dist_port: int) -> tuple[str, ...]:
    return ("--tp-size", "4", "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", f"127.0.0.1:{dist_port}")


async def start_both(launch):  # noqa: F811
    dist = free_port()
    head = await launch(*rank_args(0, dist))
    await head.wait_for_line("Init torch distributed begin.")
    other = await launch(*rank_args(1, dist))
    await other.wait_for_line("server_args=ServerArgs(")  # rank 1 loads its tokenizer before it joins: rank 0 waits
    assert not any("Init torch distributed ends" in line or "Uvicorn running" in line for line in head.lines)
    await head.wait_for_line("The server is fired up and ready to roll!")
    await other.wait_for_line("Starting dummy health check server at")
    return head, other


async def test_rank0_serves_once_rank1_joined_and_ends_when_rank1_is_lost(launch):  # noqa: F811
    head, other = await start_both(launch)
    assert re.search(r"^\[[\d\- :]+ TP2\] Init torch distributed begin\.$", other.log, re.M)  # node 1: TP ranks 2-3
    assert "The server is fired up" not in other.log and "Uvicorn running" not in other.log
    port = re.search(r"Starting dummy health check server at 127\.0\.0\.1:(\d+)", other.log).group(1)
    async with aiohttp.ClientSession() as session:  # rank 1: the dummy health server and nothing else
        async with session.get(f"http://127.0.0.1:{port}/health") as resp:
            assert resp.status == 200
        async with session.post(f"http://127.0.0.1:{port}/generate", json={"text": "x"}) as resp:
            assert resp.status == 404

    status, out = await generate(head.url, {"text": "hello", "sampling_params": {"max_new_tokens": 20}})
    assert status == 200 and out["meta_info"]["completion_tokens"] > 0

    other.proc.kill()
    assert await head.wait_exit() == 1
    assert "Scheduler hit an exception: Traceback (most recent call last):" in head.log
    assert "remote process exited or there was a network error" in head.log
    assert re.search(r"Connection closed by remote peer 127\.0\.0\.1<\d+> \(node rank 1, TP ranks 2-3\)", head.log)
    assert "SIGQUIT received. signum=None, frame=None. It usually means one child failed." in head.log


async def test_rank1_ends_when_rank0_goes(launch):  # noqa: F811
    head, other = await start_both(launch)
    head.proc.send_signal(signal.SIGTERM)
    assert await head.wait_exit() == -signal.SIGKILL  # drained, then its own tree killed, as SGLang does
    assert await other.wait_exit() == 1
    assert re.search(r"Connection closed by remote peer 127\.0\.0\.1<\d+> \(node rank 0, TP ranks 0-1\)", other.log)
    assert "Received sigquit from a child process. It usually means the child failed." in other.log


async def test_a_rank_that_cannot_join_fails_with_torchs_timeout(launch):  # noqa: F811
    sim = await launch(*rank_args(1, free_port()), "--dist-timeout", "1")
    assert await sim.wait_exit() == 1
    assert re.search(r"DistNetworkError: The client socket has timed out after 1000ms while trying to connect to "
                     r"\(127\.0\.0\.1, \d+\)\.", sim.log)
    assert "Scheduler hit an exception" in sim.log and "Starting dummy health" not in sim.log


@pytest.mark.parametrize("args, words", [
    (["--nnodes", "2"], "please provide --dist-init-addr as host:port of head node"),
    (["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], "--node-rank 2: must be in 0..1"),
    (["--nnodes", "2", "--tp-size", "3", "--dist-init-addr", "h:1"], "must be a multiple of --nnodes"),
    (["--nnodes", "2", "--tp", "2", "--dist-init-addr", "h"], "please provide --dist-init-addr as host:port"),
])
def test_multinode_flags_are_checked_with_sglangs_words(tiny_model_dir, capsys, args, words):
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tiny_model_dir), *args])
    assert words in capsys.readouterr().err


def test_ipv6_dist_init_addr_and_the_nccl_alias(tiny_model_dir):
    cfg = parse_args(["--model-path", str(tiny_model_dir), "--nnodes", "2", "--tp", "2", "--nccl-init-addr",
                      "[::1]:5000", "--node-rank", "1"])
    assert (cfg.nnodes, cfg.node_rank, cfg.dist_init_addr, cfg.tp_per_node) == (2, 1, "[::1]:5000", 1)
