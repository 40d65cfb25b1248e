"""A server across nodes as a placement backend gets it: its ranks and each rank's launch line (engine.servers.ranks),
and the launch line regen builds from run.toml for one rank (engine.servers.workers.launch_argv)."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from engine.config.load import RunConfig, Workers
from engine.servers.ranks import DistInitAddr, RankPlanError, plan_server, rank_argv
from engine.simulator import parse_args
from engine.servers.launch import WorkerSpec, launch_argv


def test_two_nodes_of_four_gpus_make_one_tp8_server():
    server = plan_server("big", ["n1", "n2"], [0, 1, 2, 3], port=30000, dist_init_port=5000)
    assert server.nodes == ("n1", "n2") and server.tp_size == 8 and server.head.node == "n1"
    assert [(r.node, r.node_rank, r.serves_http, list(r.tp_ranks)) for r in server.ranks] == [
        ("n1", 0, True, [0, 1, 2, 3]), ("n2", 1, False, [4, 5, 6, 7])]
    assert {r.dist_init for r in server.ranks} == {DistInitAddr("n1", 5000)}
    assert server.ranks[1].flags() == ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "n1:5000"]
    v6 = plan_server("v6", ["a", "b"], [0], port=30000, dist_init_port=5000, dist_init_host="fd00::1")
    assert str(v6.head.dist_init) == "[fd00::1]:5000"


@pytest.mark.parametrize("nodes, gpus, ports, words", [
    ([], [0], (30000, 5000), "no nodes given"),
    (["a", "a"], [0], (30000, 5000), "node(s) a given twice"),
    (["a", "b"], [0, 0], (30000, 5000), "must be distinct GPU indices"),
    (["a", "b"], [0], (30000, 65530), "choose one below"),
    (["a", "b"], [0], (5003, 5000), "falls in the dist-init ports 5000..5008"),
    (["a", "b"], [0], (0, 5000), "port 0 is not a TCP port"),
])
def test_a_layout_that_cannot_work_is_refused_with_the_fix(nodes, gpus, ports, words):
    with pytest.raises(RankPlanError) as exc:
        plan_server("s", nodes, gpus, port=ports[0], dist_init_port=ports[1])
    assert words in str(exc.value)


def test_each_rank_runs_the_same_line_with_its_own_rank_and_the_simulator_takes_it(tiny_model_dir):
    cfg = RunConfig(run_dir="/r", model=str(tiny_model_dir), prompts=("p",),
                    workers=Workers(gpus=(0, 1), tp_size=2, launch="{python} -m engine.simulator --model-path {model} "
                                    "--host {host} --port {port} --tp-size {tp}"))
    server = plan_server("big", ["n1", "n2"], [0, 1], port=30000, dist_init_port=5000)
    lines = [launch_argv(cfg, WorkerSpec(name="big", gpus=r.gpus, host="0.0.0.0", port=server.port, rank=r), "/py",
                         served_model_name="regen-r-big-1") for r in server.ranks]
    assert [line[line.index("--tp-size") + 1] for line in lines] == ["4", "4"]  # the total over both nodes
    assert lines[0][:-6] == lines[1][:-6]
    assert lines[1][-6:] == ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "n1:5000"]
    sim = parse_args(lines[1][3:])
    assert (sim.nnodes, sim.node_rank, sim.dist_init_addr, sim.tp_size, sim.tp_per_node) == (2, 1, "n1:5000", 4, 2)


def test_a_launch_line_that_sets_a_rank_flag_is_refused():
    rank = plan_server("s", ["a", "b"], [0], port=30000, dist_init_port=5000).ranks[0]
    with pytest.raises(RankPlanError, match="sets --nnodes: remove it from workers.launch / extra_args"):
        rank_argv(["python", "-m", "sglang.launch_server", "--nnodes=2"], rank)


async def test_two_workers_launch_one_server_across_two_ranks_and_rank0_ends_with_rank1(tmp_path, tiny_model_dir):
    """What a placement backend does, on one machine: a Worker per rank (rank 1's own --port on 127.0.0.1 here);
    rank 1 is ready by its dummy /health and its socket, rank 0 by its name once rank 1 joined; rank 1 lost ends
    rank 0 with NCCL's error naming it."""
    import aiohttp

    from engine.api.events import AlertEvent
    from engine.servers.workers import Worker, WorkerState
    from tests.run_helpers import make_config
    from tests.sshd_fixtures import free_port
    from tests.waiting import await_until

    cfg = make_config(tmp_path / "run", tiny_model_dir, prompts=1, gpus=1)
    cfg = cfg.model_copy(update=dict(workers=cfg.workers.model_copy(update=dict(max_restarts=0))))
    server = plan_server("big", ["127.0.0.1", "also-127.0.0.1"], [0], port=free_port(), dist_init_port=free_port(),
                         dist_init_host="127.0.0.1")
    events: list = []
    async with aiohttp.ClientSession() as session:
        workers = [Worker(spec=WorkerSpec(name=f"big.rank{r.node_rank}", gpus=r.gpus, host="127.0.0.1",
                                          port=server.port if r.serves_http else free_port(), rank=r),
                          cfg=cfg, run_dir=tmp_path / "run", session=session, emit=events.append)
                   for r in server.ranks]
        head, other = workers
        try:
            head.start()
            await await_until(lambda: head.state == WorkerState.LOADING, 30, "rank 0 loading")
            other.start()
            await await_until(lambda: head.state == WorkerState.READY and other.state == WorkerState.READY, 60,
                              "both ranks ready", describe=lambda: f"{head.state} {head.error}; {other.state} {other.error}")
            assert "--node-rank 1" in (tmp_path / "run" / "workers" / "big.rank1" / "server.log").read_text()
            assert head.capacity_info.discovered and not other.capacity_info.discovered  # no API on rank 1
            os.killpg(other.pid, signal.SIGKILL)
            await await_until(lambda: head.state in (WorkerState.CRASHED, WorkerState.FAILED), 30, "rank 0 ended")
            assert "Connection closed by remote peer" in head.error and "(node rank 1, TP ranks 1-1)" in head.error
            crash = next(e for e in events if isinstance(e, AlertEvent) and e.key == "worker:big.rank0:crash")
            assert "remote process exited or there was a network error" in crash.evidence
        finally:
            await asyncio.gather(*(w.stop() for w in workers))


def test_a_host_agent_on_a_spanning_node_launches_its_rank_of_the_hosts_server():
    """engine.placement.hosts.agent --nnodes 2 --node-rank i: the host's one server (tp 4 over 4 GPU indices in
    host.toml) as this node's rank: 2 GPUs, rank 0 under the server's name, rank 1 named apart."""
    from engine.placement.hosts.agent import NodeRank, parse_dist_init, rank_specs
    from engine.placement.hosts.deploy import named_specs

    specs = named_specs(Workers(gpus=(0, 1, 2, 3), tp_size=4, base_port=30000, host="10.0.0.2"), "regen-0")
    addr = parse_dist_init("10.0.0.1:31000")
    head, = rank_specs(specs, "10.0.0.1", NodeRank(2, 0, addr))
    other, = rank_specs(specs, "10.0.0.2", NodeRank(2, 1, addr))
    assert (head.name, head.gpus, head.tp_size, head.port) == ("regen-0.gpu0-1-2-3", (0, 1), 4, 30000)
    assert (other.name, other.gpus, other.tp_size, other.port) == ("regen-0.gpu0-1-2-3.rank1", (0, 1), 4, 30000)
    assert other.rank.flags() == ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:31000"]
    with pytest.raises(ValueError, match="give HOST:PORT"):
        parse_dist_init("10.0.0.1")
