"""A server across nodes as a placement backend gets it: its ranks and each rank's launch line (engine.server_ranks),
and the launch line regen builds from run.toml for one rank (engine.workers.launch_argv)."""
from __future__ import annotations

import pytest

from engine.config import RunConfig, Workers
from engine.server_ranks import DistInitAddr, RankPlanError, plan_server, rank_argv
from engine.simulator import parse_args
from engine.workers import WorkerSpec, launch_argv


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
