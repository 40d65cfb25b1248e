"""A run's --schedule-conservativeness past one machine: each host agent (or Slurm job) is given its servers' start
(RunTuning.host_record, beside its host.toml), its launch's value comes back in the agent's identity record and is
shown per server, and a restart's change there is recorded as the run's and alerted on the dispatch host."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import aiohttp

from console.tui.panel_workers import COLUMNS, worker_cells
from console.view.model import RunModel
from engine.api.events import AlertEvent
from engine.api.tuning import LaunchTuning, TuningSource
from engine.config.load import RunConfig, config_from_dict
from engine.placement.hosts.agent import NodeRank, agent_tuning, rank_specs, server_tuner
from engine.placement.hosts.deploy import host_config, named_specs
from engine.placement.hosts.link import HostLink
from engine.servers.identity_record import IdentityRecord
from engine.servers.ranks import DistInitAddr
from engine.servers.tuning import RunTuning
from engine.servers.tuning_record import RECORD_FILE, config_key, read_record, write_record
from tests.test_tuning_config import pilot_record


def run_cfg(tmp_path: Path, **workers) -> RunConfig:
    return config_from_dict({"run_dir": str(tmp_path / "run"), "model": "/m", "prompts": ["/p.jsonl"],
                             "workers": workers,
                             "hosts": [{"name": "h1", "address": "x", "gpus": [0, 1], "work_dir": "/w1"},
                                       {"name": "h2", "address": "y", "gpus": [0, 1, 2, 3], "tp_size": 2,
                                        "work_dir": "/w2"}]})


def restarted(value: float, floor: float | None = None) -> LaunchTuning:
    return LaunchTuning(value, TuningSource.RESTART, "12 requests retracted in 1m00s ...; raised from 0.3 to 0.6",
                        clip=None, floor=floor)


def test_a_hosts_record_holds_the_pilots_choice_and_its_own_servers_keyed_for_its_config(tmp_path):
    cfg = run_cfg(tmp_path)
    pilot_record(cfg, 0.3, clip=1536)
    run = RunTuning(cfg, Path(cfg.run_dir))
    run.save(run.for_server("h2.gpu0-1"))  # as a restart would have left it (the pilot's value, recorded)
    run.record.servers[0].value, run.record.servers[0].source = 0.6, TuningSource.RESTART
    h1, h2 = (host_config(cfg, h) for h in cfg.hosts)
    assert config_key(h2) != run.key  # its tp_size is its own: the agent reads a record keyed for its config

    one = run.host_record(h1, ["h1.gpu0", "h1.gpu1"])
    assert one is not None and one.config_key == config_key(h1) and one.servers == []
    assert (one.pilot.value, one.pilot.clip) == (0.3, 1536)
    two = run.host_record(h2, ["h2.gpu0-1", "h2.gpu2-3"])
    assert two is not None and [(s.name, s.value) for s in two.servers] == [("h2.gpu0-1", 0.6)]

    # the agent (its work dir holding the record as the link wrote it) starts each server there, with the clip env
    work = tmp_path / "w2"
    write_record(work / RECORD_FILE, two)
    agent = agent_tuning(h2.model_copy(update={"run_dir": str(work)}), work)
    assert agent.notes == []
    kept, fresh = agent.for_server("h2.gpu0-1"), agent.for_server("h2.gpu2-3")
    assert (kept.flag_value(), kept.source, fresh.flag_value(), fresh.source) == (0.6, "restart", 0.3, "pilot")
    assert fresh.env() == {"SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "1536"}


def test_no_record_is_given_when_the_run_has_none_or_the_value_is_not_regens(tmp_path):
    cfg = run_cfg(tmp_path)
    h1 = host_config(cfg, cfg.hosts[0])
    assert RunTuning(cfg, Path(cfg.run_dir)).host_record(h1, ["h1.gpu0"]) is None  # nothing measured yet
    pilot_record(cfg, 0.3)
    assert RunTuning(cfg, Path(cfg.run_dir)).host_record(h1, ["h1.gpu0"]) is not None
    for fixed in (run_cfg(tmp_path, schedule_conservativeness=0.5),
                  run_cfg(tmp_path, extra_args=["--schedule-conservativeness", "0.7"])):
        pilot_record(fixed, 0.3)
        assert RunTuning(fixed, Path(fixed.run_dir)).host_record(host_config(fixed, fixed.hosts[0]), ["h1.gpu0"]) is None


def test_each_rank_of_a_server_across_nodes_starts_where_the_server_does_and_keeps_it(tmp_path):
    cfg = run_cfg(tmp_path)
    pilot_record(cfg, 0.3)
    work = tmp_path / "job"
    h1 = host_config(cfg, cfg.hosts[0])
    write_record(work / RECORD_FILE, RunTuning(cfg, Path(cfg.run_dir)).host_record(h1, ["g0.gpu0"]))
    tuning = RunTuning(h1, work)
    rank1 = rank_specs(named_specs(h1.workers, "g0"), "n2", NodeRank(2, 1, DistInitAddr("10.0.0.1", 31000)))[0]
    tuner = server_tuner(tuning, rank1)
    assert rank1.name == "g0.gpu0.rank1" and (tuner.name, tuner.value, tuner.source) == ("g0.gpu0", 0.3, "pilot")
    assert tuner.held and "keeps its value within a job" in tuner.held


def test_the_identity_record_carries_the_launchs_value_and_an_older_one_reads_as_na():
    record = IdentityRecord(name="h1.gpu0", state="ready", served_model_name="n", pid=7, port=30000,
                            tuning=LaunchTuning(0.3, TuningSource.PILOT, "the pilot's choice: ...", clip=1536))
    assert IdentityRecord.from_json(record.to_json()) == record
    older = json.loads(record.to_json())
    del older["tuning"]
    assert IdentityRecord.from_json(json.dumps(older)).tuning is None
    older["tuning"] = {"value": "low", "source": "pilot"}  # unreadable: N/A, the record still reads
    assert IdentityRecord.from_json(json.dumps(older)).tuning is None


async def test_a_remote_servers_value_is_shown_and_its_restarts_change_recorded_and_alerted_once(tmp_path):
    cfg = run_cfg(tmp_path)
    pilot_record(cfg, 0.3)
    tuning = RunTuning(cfg, Path(cfg.run_dir))
    emitted: list = []
    base = IdentityRecord(name="h1.gpu0", state="loading", served_model_name=None, pid=7, port=30000, agent_pid=11)
    async with aiohttp.ClientSession() as session:
        link = HostLink(cfg, cfg.hosts[0], engine_root=Path("."), session=session, emit=emitted.append,
                        forward_base=45000, tuning=tuning)
        m = link.members[0]
        assert (m.snapshot().conservativeness, m.snapshot().conservativeness_source) == (None, "")  # not read yet: N/A
        link.records.mirror(m, dataclasses.replace(base, tuning=LaunchTuning(0.3, TuningSource.PILOT, "pilot")))
        ev = m.snapshot()
        assert (ev.conservativeness, ev.conservativeness_source) == (0.3, "pilot")
        assert not [e for e in emitted if isinstance(e, AlertEvent)]

        again = dataclasses.replace(base, restarts=1, tuning=restarted(0.6, floor=0.3))
        link.records.mirror(m, again)
        link.records.mirror(m, again)  # read again: nothing new to say
        [alert] = [e for e in emitted if isinstance(e, AlertEvent)]
        assert (alert.key, alert.severity) == ("worker:h1.gpu0:tuning", "warning")
        assert alert.text == ("worker h1.gpu0 restarts with --schedule-conservativeness 0.6 (was 0.3): 12 requests "
                              "retracted in 1m00s ...; raised from 0.3 to 0.6")
        assert alert.evidence.splitlines()[0] == "from host h1's /w1/workers/h1.gpu0/identity.json"
        ev = m.snapshot()
        assert (ev.conservativeness, ev.conservativeness_source) == (0.6, "restart")
        model = RunModel("local", "/r")  # the TUI's workers table
        model.apply_all([ev])
        assert dict(zip(COLUMNS, worker_cells(model, model.workers["h1.gpu0"])))["conserv."] == "0.6 (restart)"
    # the run dir's record holds it: the host's next join (or a supervisor started again) starts it there
    record, problem = read_record(Path(cfg.run_dir) / RECORD_FILE)
    assert problem is None and record.pilot.value == 0.3
    [kept] = record.servers
    assert (kept.name, kept.value, kept.source, kept.floor) == ("h1.gpu0", 0.6, "restart", 0.3)
    given = RunTuning(cfg, Path(cfg.run_dir)).host_record(host_config(cfg, cfg.hosts[0]), ["h1.gpu0", "h1.gpu1"])
    assert [(s.name, s.value, s.floor) for s in given.servers] == [("h1.gpu0", 0.6, 0.3)]
    # a supervisor started again, its agent still running: the same value is no new change
    assert RunTuning(cfg, Path(cfg.run_dir)).remote_change("h1.gpu0", restarted(0.6, floor=0.3), "x") is None


async def test_the_hosts_deploy_writes_its_record_and_removes_a_stale_one(tmp_path):
    """What `deploy` sends over ssh: a stale record removed with host.toml's writing, then this run's record (as the
    agent reads it) where the run has one."""
    cfg = run_cfg(tmp_path)
    sent: list[tuple[str, bytes | None]] = []

    async def fake_ssh(command, stdin=None, timeout=60.0):
        sent.append((command, stdin))
        return 0, "", ""

    async def deploy(tuning: RunTuning) -> list[tuple[str, bytes | None]]:
        sent.clear()
        async with aiohttp.ClientSession() as session:
            link = HostLink(cfg, cfg.hosts[0], engine_root=Path(__file__).parent.parent, session=session,
                            emit=lambda _: None, forward_base=45000, tuning=tuning)
            link.ssh = fake_ssh
            await link.deploy()
        return sent[2:]  # after the work dir and the engine's copy

    assert [c for c, _ in await deploy(RunTuning(cfg, Path(cfg.run_dir)))] == [
        "rm -f /w1/tuning.json && cat > /w1/host.toml"]
    pilot_record(cfg, 0.3)
    toml, (command, stdin) = await deploy(RunTuning(cfg, Path(cfg.run_dir)))
    assert toml[0] == "rm -f /w1/tuning.json && cat > /w1/host.toml"
    assert command == "cat > /w1/.tuning.json.tmp && mv -f /w1/.tuning.json.tmp /w1/tuning.json"
    doc = json.loads(stdin)
    assert doc["config_key"] == config_key(host_config(cfg, cfg.hosts[0])) and doc["pilot"]["value"] == 0.3
