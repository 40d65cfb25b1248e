"""A server's /metrics gauges count once: the priority total, one TP rank per DP rank, DP ranks summed.

Exposition text as SGLang writes it (labels of 0.5.23 scheduler_metrics_mixin.init_metrics; contract 7.5):
with --enable-priority-scheduling every gauge has a total series under priority="" plus one per priority;
with --enable-metrics-for-all-schedulers and TP > 1 every TP rank exports the same figures.
"""
from __future__ import annotations

from engine.servers.metrics_client import parse_metrics

HEAD = {
    "sglang:num_running_reqs": "The number of running requests.",
    "sglang:num_queue_reqs": "The number of requests in the waiting queue.",
    "sglang:gen_throughput": "The generation throughput (token/s).",
    "sglang:token_usage": "The token usage.",
}


def exposition(rows: dict[str, list[tuple[str, float]]]) -> str:
    """rows: gauge -> [(extra labels, value)], each series with SGLang's base labels."""
    out = []
    for name, series in rows.items():
        out += [f"# HELP {name} {HEAD[name]}", f"# TYPE {name} gauge"]
        for extra, value in series:
            labels = 'engine_type="unified",model_name="Qwen/Qwen3-27B",moe_ep_rank="0",pp_rank="0"'
            out.append(f"{name}{{{labels},{extra}}} {value}")
    return "\n".join(out) + "\n"


def test_priority_scheduling_reads_the_total_series_not_the_sum_of_priorities():
    text = exposition({
        "sglang:num_running_reqs": [('priority="",tp_rank="0"', 12), ('priority="0",tp_rank="0"', 5),
                                    ('priority="1",tp_rank="0"', 7)],
        "sglang:num_queue_reqs": [('priority="",tp_rank="0"', 3), ('priority="0",tp_rank="0"', 1),
                                  ('priority="1",tp_rank="0"', 2)],
        "sglang:gen_throughput": [('priority="",tp_rank="0"', 1500.0), ('priority="1",tp_rank="0"', 900.0)],
        "sglang:token_usage": [('priority="",tp_rank="0"', 0.42), ('priority="1",tp_rank="0"', 0.9)],
    })
    m = parse_metrics(text)
    assert (m.running_reqs, m.queued_reqs, m.gen_throughput, m.token_usage) == (12, 3, 1500.0, 0.42)


def test_every_tp_rank_exporting_counts_one_rank():
    text = exposition({
        "sglang:num_running_reqs": [('tp_rank="0"', 40), ('tp_rank="1"', 40), ('tp_rank="2"', 40), ('tp_rank="3"', 40)],
        "sglang:num_queue_reqs": [('tp_rank="1"', 2), ('tp_rank="0"', 2)],
        "sglang:token_usage": [('tp_rank="3"', 0.61), ('tp_rank="0"', 0.6)],
    })
    m = parse_metrics(text)
    assert (m.running_reqs, m.queued_reqs, m.token_usage) == (40, 2, 0.6)  # tp_rank 0's series


def test_dp_ranks_are_summed_each_read_from_one_tp_rank():
    text = exposition({
        "sglang:num_running_reqs": [('dp_rank="0",tp_rank="0"', 30), ('dp_rank="0",tp_rank="1"', 30),
                                    ('dp_rank="1",tp_rank="2"', 20), ('dp_rank="1",tp_rank="3"', 20)],
        "sglang:num_queue_reqs": [('dp_rank="0",tp_rank="0"', 1), ('dp_rank="1",tp_rank="2"', 4)],
        "sglang:token_usage": [('dp_rank="0",tp_rank="0"', 0.5), ('dp_rank="1",tp_rank="2"', 0.7)],
    })
    m = parse_metrics(text)
    assert (m.running_reqs, m.queued_reqs, m.token_usage) == (50, 5, 0.7)


def test_priority_tp_ranks_and_dp_ranks_together():
    series = []
    for dp, running in (("0", 9), ("1", 11)):
        for tp in ("0", "1"):
            series += [(f'dp_rank="{dp}",priority="",tp_rank="{tp}"', running),
                       (f'dp_rank="{dp}",priority="5",tp_rank="{tp}"', running - 4),
                       (f'dp_rank="{dp}",priority="9",tp_rank="{tp}"', 4)]
    m = parse_metrics(exposition({"sglang:num_running_reqs": series}))
    assert m.running_reqs == 20 and m.queued_reqs is None


def test_one_series_per_gauge_reads_as_before():
    text = exposition({"sglang:num_running_reqs": [('tp_rank="0"', 12)], "sglang:num_queue_reqs": [('tp_rank="0"', 3)]})
    m = parse_metrics(text)
    assert (m.running_reqs, m.queued_reqs, m.gen_throughput) == (12, 3, None)
