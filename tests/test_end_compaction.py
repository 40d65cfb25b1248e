"""A run's end: once every sample is settled the servers are stopped first (GPU time is not paid for the
compaction), then the finished shards are compacted, and only then is the run done. Killed during that
compaction, the next start launches nothing, compacts what is left and ends done, each sample once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from engine.config.load import dump_toml
from tests.held_compaction_supervisor import held_path, release
from tests.run_helpers import process_alive
from tests.test_engine_run import (REPO, assert_one_file_per_shard, make_config, read_rows, status,  # noqa: F401
                                   supervisors, wait_for)  # supervisors: a fixture


def server_pids(run_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in (run_dir / "workers").glob("*/server.pid")]


def dispatch_ticks(run_dir: Path) -> int:
    """The monitor's ticks so far: each emits one dispatch event."""
    return sum(1 for line in (run_dir / "telemetry.jsonl").read_text().splitlines() if '"type":"dispatch"' in line)


class HeldProc:
    """tests.held_compaction_supervisor as a subprocess (its own session: killed with its group)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        with open(run_dir / "supervisor.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.held_compaction_supervisor", "--run-dir",
                                          str(run_dir)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True,
                                         cwd=str(REPO))

    def log_text(self) -> str:
        return (self.run_dir / "supervisor.log").read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def test_servers_stopped_before_the_final_compaction_and_a_kill_there_resumes_done(tmp_path, tiny_model_dir,
                                                                                   supervisors):  # noqa: F811
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=40, gpus=1)
    run_dir.mkdir(parents=True)
    (run_dir / "run.toml").write_text(dump_toml(cfg))
    held = HeldProc(run_dir)
    try:
        wait_for(lambda: server_pids(run_dir), 60, "a server launched", held)
        pids = server_pids(run_dir)
        wait_for(lambda: "samples settled" in held.log_text(), 90, "every sample settled", held)
        # the compaction waits for the release: the servers must be gone meanwhile
        wait_for(lambda: held_path(run_dir).exists() and not any(process_alive(p) for p in pids), 30,
                 "the servers stopped while the finished shards' compaction waits", held)
        st = status(run_dir)
        # done only once the shards are final files; meanwhile not `running` either: the servers are gone
        assert st is not None and st["state"] == "finishing", st
        ticks = dispatch_ticks(run_dir)
        wait_for(lambda: dispatch_ticks(run_dir) >= ticks + 2, 30, "two more monitor ticks", held)
        last = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()
                if '"type":"dispatch"' in line][-1]
        assert last["state"] == "finishing", last
        assert held.log_text().count("samples settled") == 1, held.log_text()[-3000:]
        assert "servers stopped; compacting" in held.log_text()
        held.kill()  # killed during the end's compaction (the run is not recorded done)
    finally:
        release(run_dir)
        held.kill()
    ends = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()
            if '"type":"run_end"' in line]
    assert ends == []
    committed = len(read_rows(run_dir))
    sup = supervisors(run_dir).start()
    assert sup.wait(60) == 0, sup.log_text()[-3000:]
    log = sup.log_text().rsplit("starting on", 1)[1]
    assert "nothing to generate" in log and "launched pid" not in log, log
    rows = read_rows(run_dir)
    assert len(rows) == committed and len({r["sample_id"] for r in rows}) == committed
    assert_one_file_per_shard(run_dir)
    end = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()
           if '"type":"run_end"' in line][-1]
    assert end["state"] == "done" and end["exit_code"] == 0, end
