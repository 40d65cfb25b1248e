"""[slurm] in run.toml and `regen plan`: the server-to-node mapping from tp_size, the rules between keys, the exact
sbatch and srun lines regen will submit, and how many allocations in a row the projected run needs."""
from __future__ import annotations

import json
import shlex
import tomllib

import pytest

from console.cli import main as cli_main
from engine.config.load import ConfigError, config_from_dict, dump_toml
from console.commands.plan import slurm_lines
from engine.placement.slurm.plan import allocations_needed, layout_of, plan_slurm, sbatch_argv, srun_argv
from rich.console import Console

BASE = {"run_dir": "/scratch/run", "model": "/m", "prompts": ["p.jsonl"]}


def cfg_with(slurm: dict, **extra):
    return config_from_dict({**BASE, "slurm": {"partition": "gpu", **slurm}, **extra})


@pytest.mark.parametrize("tp,gpn,nodes,per_group,servers_per_group,groups,gpus", [
    (1, 8, 2, 1, 8, 2, tuple(range(8))),      # several servers per node
    (4, 8, 3, 1, 2, 3, tuple(range(8))),
    (8, 8, 1, 1, 1, 1, tuple(range(8))),
    (16, 8, 4, 2, 1, 2, tuple(range(16))),    # one server across two nodes
    (32, 8, "4-8", 4, 1, 2, tuple(range(32))),  # a range: jobs for the most nodes
])
def test_tp_size_maps_servers_onto_nodes(tp, gpn, nodes, per_group, servers_per_group, groups, gpus):
    cfg = cfg_with({"gpus_per_node": gpn, "nodes": nodes}, workers={"tp_size": tp})
    layout = layout_of(cfg)
    assert (layout.nodes_per_group, layout.servers_per_group, layout.groups) == (per_group, servers_per_group, groups)
    assert cfg.workers.gpus == gpus  # derived: one node's GPUs, or one spanning server's


@pytest.mark.parametrize("doc,key,words", [
    ({"workers": {"tp_size": 3}}, "[workers] tp_size", "does not divide slurm.gpus_per_node = 8"),
    ({"workers": {"tp_size": 12}}, "[workers] tp_size", "not a multiple of it"),
    ({"workers": {"tp_size": 16}, "slurm": {"partition": "gpu", "nodes": 3}}, "[slurm] nodes",
     "3 is not a multiple of 2"),
    ({"workers": {"gpus": [0, 1]}}, "[workers] gpus", "remove [workers] gpus"),
    ({"hosts": [{"name": "a", "address": "b"}]}, "[slurm]", "not both"),
    ({"slurm": {"partition": "gpu", "time_limit": "5", "handover_s": 300}}, "[slurm] handover_s", "not below"),
    ({"slurm": {"partition": "gpu", "time_limit": "4h"}}, "[slurm] time_limit", '"4:00:00"'),
    ({"slurm": {"partition": "gpu", "nodes": "4-2"}}, "[slurm] nodes", '"2-4"'),
    ({"slurm": {}}, "[slurm] partition", "required"),
])
def test_rules_between_keys_name_the_key_and_the_fix(doc, key, words):
    with pytest.raises(ConfigError) as err:
        config_from_dict({**BASE, "slurm": {"partition": "gpu"}, **doc})
    assert key in str(err.value) and words in str(err.value), str(err.value)


def test_sbatch_and_srun_lines_carry_every_key():
    cfg = cfg_with({"account": "llm", "qos": "high", "constraint": "h100", "time_limit": "1-00:00:00",
                    "handover_s": 600, "extra_args": ["--exclusive"], "nodes": 4, "job_name": "drafter"},
                   workers={"tp_size": 16}, host_python="/opt/sglang/bin/python")
    argv = sbatch_argv(cfg, 1)
    assert argv[:2] == ["sbatch", "--parsable"]
    for word in ("--job-name=drafter-1", "--partition=gpu", "--account=llm", "--qos=high", "--constraint=h100",
                 "--nodes=2", "--ntasks-per-node=1", "--gres=gpu:8",
                 "--exclusive", "--output=/scratch/run/slurm/job-%j.out"):
        assert word in argv, word
    # the first jobs' limits staggered: (24 h - 600 s) / 2 groups apart, in whole minutes
    assert "--time=1-00:00:00" in sbatch_argv(cfg, 0) and "--time=12:05:00" in argv
    assert argv[-1] == "--wrap=" + shlex.join(srun_argv(cfg, 1))
    assert srun_argv(cfg, 1) == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "env",
                                 "PYTHONPATH=/scratch/run/slurm/.regen/engine", "/opt/sglang/bin/python", "-m", "engine.placement.slurm.step", "--work-dir",
                                 "/scratch/run/slurm", "--group", "1", "--dist-init-port", "31008"]
    assert "--test-only" in sbatch_argv(cfg, 0, test_only=True)


def test_allocations_needed_counts_the_hand_over():
    assert allocations_needed(3000, 3300) == 1
    assert allocations_needed(3301, 3300) == 2
    assert allocations_needed(10 * 3600, 3 * 3600 + 1800) == 3


def test_plan_prints_the_exact_lines_and_the_allocations(tmp_path, tiny_model_dir, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"s{i}", "prompt": f"q {i}"}) + "\n" for i in range(40)))
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(f"""
run_dir = {json.dumps(str(tmp_path / 'run'))}
model = {json.dumps(str(tiny_model_dir))}
prompts = [{json.dumps(str(prompts))}]
[workers]
tp_size = 4
[plan]
output_tokens_per_sample = 9000.0
tokens_per_s_per_gpu = 10.0
[slurm]
partition = "gpu"
nodes = 2
gpus_per_node = 8
time_limit = "1:00:00"
handover_s = 600
""")
    assert cli_main(["plan", "local", "--config", str(run_toml), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    s = d["slurm"]
    # 40 samples x 9000 tokens at 4 servers x 40 tokens/s: 2250 s; 3000 s usable per allocation
    assert d["projection"]["workers"] == 4
    assert (s["groups"], s["servers"], s["usable_s"], s["allocations"]) == (2, 4, 3000, 1)
    assert s["sbatch"][0].startswith("sbatch --parsable --job-name=regen-0 --partition=gpu --nodes=1")
    assert cli_main(["plan", "local", "--config", str(run_toml)]) == 0
    out = capsys.readouterr().out
    assert "slurm: 2 node(s) x 8 GPUs: 2 server(s) of tp 4 per node; 2 job(s) of 1 node(s), 4 server(s)" in out
    for line in s["sbatch"] + s["srun"]:
        assert line in out  # word for word, never wrapped
    assert "needs 1 allocation(s) per job in a row" in out
    assert "  time limit 1h00m, hand-over 600 s before it: the run (" in out  # durations as the TUI writes them
    # when each group hands over: the first limits staggered (60 and 35 minutes), on the plan's assumptions (a
    # 2-minute queue wait, a 5-minute load); within the projected 2250 s only group 1's first job hands over
    assert [(h["group"], h["job"], h["time_limit_s"]) for h in s["handovers"]] == [(1, 0, 2100)]
    assert s["spacing_s"] == (3600 - 600 - 10) / 2
    assert ("    group 1: job 1 (--time 35m00s): next job submitted at 19m50s, serving at 26m50s, drain by 27m00s"
            in out), out
    assert cli_main(["plan", "local", "--config", str(run_toml), "--pilot", "4"]) == 2
    assert "--pilot with [slurm] is not supported" in capsys.readouterr().err


# -- elastic groups: min_groups / max_groups (the group form of `nodes`), time_min ------------------------------
@pytest.mark.parametrize("slurm,tp,counted,groups", [
    ({"nodes": "2-4"}, 8, 2, 4),                          # the node range as before
    ({"min_groups": 2, "max_groups": 4}, 8, 2, 4),        # the same in groups
    ({"max_groups": 3}, 8, 1, 3),                         # min_groups defaults to 1: every group beyond is elastic
    ({"min_groups": 2}, 8, 2, 2),                         # max_groups defaults to min_groups: not elastic
    ({"min_groups": 1, "max_groups": 2}, 16, 1, 2),       # a group of a spanning server is 2 nodes
    ({"nodes": "2-4"}, 16, 1, 2),
])
def test_the_group_range_in_nodes_or_in_groups(slurm, tp, counted, groups):
    cfg = cfg_with({"gpus_per_node": 8, **slurm}, workers={"tp_size": tp})
    layout = layout_of(cfg)
    assert (layout.groups_counted, layout.groups) == (counted, groups)
    assert layout.nodes_low == counted * layout.nodes_per_group
    again = config_from_dict(tomllib.loads(dump_toml(cfg)))
    assert layout_of(again) == layout  # the frozen copy in the run dir reads back the same (nodes = 1 written)


@pytest.mark.parametrize("slurm,key,words", [
    ({"nodes": 2, "max_groups": 2}, "[slurm] nodes", "not both"),
    ({"min_groups": 3, "max_groups": 2}, "[slurm] min_groups", "3 is above max_groups = 2"),
    ({"time_limit": "10", "time_min": "20"}, "[slurm] time_min", "use a time_min up to time_limit"),
    ({"time_limit": "10", "time_min": "1", "handover_s": 60}, "[slurm] time_min", "not above handover_s = 60"),
    ({"time_min": "1h"}, "[slurm] time_min", '"4:00:00"'),
])
def test_the_elastic_keys_rules_name_the_key_and_the_fix(slurm, key, words):
    with pytest.raises(ConfigError) as err:
        cfg_with(slurm)
    assert key in str(err.value) and words in str(err.value), str(err.value)


def test_time_min_is_on_the_sbatch_line_and_in_the_plan(capsys):
    cfg = cfg_with({"time_limit": "4:00:00", "time_min": "30", "handover_s": 300, "max_groups": 3})
    assert "--time-min=30" in sbatch_argv(cfg, 2) and "--time=4:00:00" in sbatch_argv(cfg, 0)
    assert "--time-min=30" not in " ".join(sbatch_argv(cfg_with({}), 0))
    plan = plan_slurm(cfg, None)
    assert plan.layout.endswith("3 job(s) of 1 node(s), 24 server(s) (elastic: each one Slurm grants serves at "
                                "once; the plan counts on 1)")
    slurm_lines(plan, Console(width=200))
    out = capsys.readouterr().out
    assert ("time_min 30m00s: Slurm's backfill may start a job in a shorter idle window, with a limit down to it; "
            "such a job serves 25m00s before its hand-over") in out


def test_time_min_never_exceeds_the_jobs_own_time_limit():
    """A staggered first job or a successor whose --time is below [slurm] time_min gets --time-min = its --time:
    Slurm refuses a job whose time-min is above its time limit."""
    def times(argv: list[str]) -> tuple[str, str]:
        return (next(w for w in argv if w.startswith("--time=")), next(w for w in argv if w.startswith("--time-min=")))

    cfg = cfg_with({"time_limit": "10", "time_min": "8", "handover_s": 60, "max_groups": 2})
    assert times(sbatch_argv(cfg, 0)) == ("--time=10", "--time-min=8")
    assert times(sbatch_argv(cfg, 1)) == ("--time=6", "--time-min=6")  # group 1's staggered first limit
    assert times(sbatch_argv(cfg, 0, time_limit_min=3, slot=1)) == ("--time=3", "--time-min=3")
    assert times(sbatch_argv(cfg, 0, time_limit_min=9, slot=1)) == ("--time=9", "--time-min=8")
    assert "--time-min=6" in plan_slurm(cfg, None).sbatch[1]


def test_the_groups_first_limits_are_staggered_so_no_two_hand_over_together():
    """Each group's first --time is time_limit less its share of the hand-over cycle (whole minutes, Slurm's
    resolution); the plan's hand-over record says when each group's next job is submitted, serves and drains."""
    from engine.placement.slurm.schedule import LEAD_MARGIN_S, handover_times, window_s

    cfg = cfg_with({"nodes": 4, "gpus_per_node": 8, "time_limit": "12:00:00", "handover_s": 600},
                   workers={"tp_size": 8})
    limits = [next(w for w in sbatch_argv(cfg, g) if w.startswith("--time=")) for g in range(4)]
    assert limits == ["--time=12:00:00", "--time=9:03:00", "--time=6:05:00", "--time=3:08:00"]
    s = cfg.slurm
    times = handover_times(s, 4, None, per_group=3, queue_wait_s=60, load_s=300)
    assert [(h.group, h.job) for h in times[:3]] == [(0, 0), (0, 1), (0, 2)]
    for h in times:
        assert h.switch_s == h.drain_s - LEAD_MARGIN_S and h.drain_s == h.limit_s - 600
        assert h.submit_s == h.switch_s - 300 - 60  # the lead: queue wait + load before the switch
    drains = sorted(h.drain_s for h in times)
    assert min(b - a for a, b in zip(drains, drains[1:])) >= window_s(s)  # no two groups' hand-overs overlap


def test_a_job_whose_limit_falls_in_another_groups_window_is_lowered_before_it():
    from engine.placement.slurm.schedule import trimmed_limit_min

    # started at 0 with a 60-minute limit; another group's limit at 3590 s: lowered to end 700 s before that
    assert trimmed_limit_min(0, 3600, [3590], 700, 700) == 48
    assert trimmed_limit_min(0, 3600, [2800], 700, 700) is None  # far enough apart
    assert trimmed_limit_min(0, 3600, [3590, 2950], 700, 700) == 37  # before both
    assert trimmed_limit_min(0, 900, [890], 700, 700) is None  # it would serve too little: left as it is


def test_the_lead_is_this_runs_longest_recent_queue_wait_and_load():
    from engine.placement.slurm.schedule import DEFAULT_LOAD_S, DEFAULT_QUEUE_WAIT_S, LEAD_MARGIN_S, Schedule

    sched = Schedule()
    assert sched.lead_s() == DEFAULT_QUEUE_WAIT_S + DEFAULT_LOAD_S + LEAD_MARGIN_S
    assert "assumed, none measured yet" in sched.lead_words()
    sched.queue_waits += [3.0, 40.0, 5.0]
    sched.loads += [20.0, 25.0]
    assert sched.lead_s() == 40.0 + 25.0 + LEAD_MARGIN_S
    assert sched.lead_words() == "queue wait 40 s measured, load 25 s measured, margin 10 s"
