"""The supervisor end to end: real simulators as subprocesses, real sqlite and Parquet."""
from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from console.commands.demo import demo_config, write_prompts
from engine.config.load import Metrics, RunConfig, dump_toml
from engine.text.ingest import Conversation, iter_prompts
from engine.text.render import Renderer, sample_id
from engine.store.shard_store import ShardStore
from engine.store.stats import compute_stats
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[1]
FAST_SIM = ("--sim-step-ms", "2", "--sim-step-ms-per-req", "0.02", "--sim-tokens-per-step", "8",
            "--sim-output-mean", "24", "--sim-output-sigma", "0.5", "--sim-load-s", "0.2")
# the servers these runs were written for: 32 running requests a server (the demo's servers are limited by their KV pool
# since regen tunes --schedule-conservativeness; tests/test_tuning_servers.py runs those)
SERVER_LIMITS = ("--max-running-requests", "32", "--context-length", "4096")


# -- helpers (also used by tests/test_cli_run.py) -------------------------------------------------
def make_config(run_dir: Path, model: Path, *, prompts: int = 60, gpus: int = 2, sim: tuple = (),
                seed: int = 0, **changes) -> RunConfig:
    prompt_dir = run_dir.parent / f"{run_dir.name}-prompts"
    files = write_prompts(prompt_dir, prompts, seed)
    cfg = demo_config(run_dir, model, files, gpus, list(FAST_SIM + tuple(sim)))
    workers = cfg.workers.model_copy(update=dict(extra_args=SERVER_LIMITS + FAST_SIM + tuple(sim)))
    # the metrics endpoint on a port the system picks: runs of tests side by side never find 9433 busy
    cfg = cfg.model_copy(update=dict(workers=workers, metrics=Metrics(port=0)))
    return cfg.model_copy(update=changes)


class SupervisorProc:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.proc: subprocess.Popen | None = None

    def start(self, cfg: RunConfig | None = None) -> "SupervisorProc":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg is not None:
            (self.run_dir / "run.toml").write_text(dump_toml(cfg))
        env = dict(os.environ, PYTHONPATH=str(REPO))
        log = open(self.run_dir / "supervisor.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.supervisor", "--run-dir", str(self.run_dir)],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True, cwd=str(self.run_dir))
        log.close()
        return self

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def log_text(self) -> str:
        return (self.run_dir / "supervisor.log").read_text(errors="replace")

    def cleanup(self) -> None:
        self.kill()
        for pid_file in (self.run_dir / "workers").glob("*/server.pid"):
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                continue  # already gone


@pytest.fixture
def supervisors():
    started: list[SupervisorProc] = []

    def make(run_dir: Path) -> SupervisorProc:
        sup = SupervisorProc(run_dir)
        started.append(sup)
        return sup

    yield make
    for sup in started:
        sup.cleanup()


def ctl(run_dir: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.ctl", "--run-dir", str(run_dir), *args],
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=str(REPO)))


def status(run_dir: Path) -> dict | None:
    """What `engine.ctl status` prints as its result (None where it would exit non-zero), asked in-process: the same
    request over the control socket and the same reply, without a Python started per poll (polled every 0.1 s, those
    took most of a core from the run under test). The command itself is tested below (ctl(..., "status"))."""
    from engine.ctl import answer
    from engine.api.protocol import encode_reply
    from engine.api.ops import Status

    reply = answer(run_dir, Status(shards=True), None, 30.0)
    return json.loads(encode_reply(reply))["result"] if reply.ok else None


def wait_for(predicate, timeout: float, what: str, sup: SupervisorProc | None = None):
    """`wait_until` for a run: gives up at once when the supervisor has exited, and shows its log."""
    if sup is None:
        return wait_until(predicate, timeout, what, interval=0.1)
    return wait_until(predicate, timeout, what, interval=0.1,
                      stop=lambda: sup.proc.poll() is not None and f"the supervisor exited ({sup.proc.returncode})",
                      describe=lambda: f"supervisor log:\n{sup.log_text()[-3000:]}")


def read_rows(run_dir: Path) -> list[dict]:
    store = ShardStore(run_dir)
    try:
        parts = store.parts()
    finally:
        store.close()
    rows = []
    for part in parts:
        rows += pq.read_table(run_dir / part.path).to_pylist()
    return rows


def assert_one_file_per_shard(run_dir: Path) -> dict[str, list[str]]:
    """A finished run: each shard with rows is one committed file, shards/<id>/shard.parquet, and nothing else is
    on disk (no part, no orphan, no tmp). Returns the files per shard."""
    store = ShardStore(run_dir)
    try:
        listed = {p.path for p in store.parts()}
        per_shard = {p.shard_id for p in store.progress() if p.done_samples}
    finally:
        store.close()
    on_disk = sorted(p.relative_to(run_dir).as_posix() for p in (run_dir / "shards").rglob("*") if p.is_file())
    assert on_disk == sorted(f"shards/{sid}/shard.parquet" for sid in per_shard), on_disk[:20]
    assert listed == set(on_disk)
    return {sid: [f"shards/{sid}/shard.parquet"] for sid in per_shard}


def expected_samples(cfg: RunConfig, renderer: Renderer) -> tuple[set[str], dict[str, Conversation]]:
    ids, convs = set(), {}
    for entry in iter_prompts(cfg.prompts, cfg.prompt_format):
        if isinstance(entry, Conversation):
            convs[entry.conversation_id] = entry
            ids |= {sample_id(entry.conversation_id, t) for t in renderer.user_turns(entry, cfg.turns)}
    return ids, convs


def check_rows(rows: list[dict], cfg: RunConfig, renderer: Renderer) -> None:
    """Every invariant a trainer relies on, re-derived from the inputs with the real tokenizer."""
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == len(set(ids)), "duplicate sample ids"
    by_id = {r["sample_id"]: r for r in rows}
    _, convs = expected_samples(cfg, renderer)
    for r in rows:
        assert len(r["input_ids"]) == len(r["loss_mask"])
        assert sum(r["loss_mask"]) == r["output_len"] == r["completion_tokens"]
        assert r["loss_mask"][: r["prompt_len"]] == [0] * r["prompt_len"]
        out_ids = r["input_ids"][r["prompt_len"]:]
        assert renderer.decode(out_ids) == r["text"]
        assert r["prompt_opened"] is opened_block(r["input_ids"][: r["prompt_len"]], renderer.tokenizer)
        conv = convs[r["conversation_id"]]
        answers, turns_as_seen = {}, {}
        for k in range(r["turn"]):
            prev = by_id.get(sample_id(conv.conversation_id, k))
            if prev is not None:
                answers[k] = renderer.history_answer(prev["input_ids"][prev["prompt_len"]:], prev["prompt_opened"])
                turns_as_seen[k] = assistant_turn_text(prev, renderer)
        if len(answers) == r["turn"]:
            prompt = renderer.prompt_ids(renderer.build_messages(conv, r["turn"], answers, cfg.turns))
            assert r["input_ids"][: r["prompt_len"]] == prompt, f"{r['sample_id']}: prompt ids differ from the template"
            # and straight from the chat template, the earlier answers given as the model saw its turns
            messages = renderer.build_messages(conv, r["turn"], turns_as_seen, cfg.turns)
            tok = renderer.tokenizer
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           enable_thinking=cfg.enable_thinking)
            assert r["input_ids"][: r["prompt_len"]] == tok(text, add_special_tokens=False).input_ids


def opened_block(prompt_ids: list[int], tok) -> bool:
    """The prompt ends inside an opened think block (Qwen3.5/3.6-style templates), read from its text."""
    return tok.decode(prompt_ids).endswith("<think>\n")


def assistant_turn_text(row: dict, renderer: Renderer) -> str:
    """The whole assistant turn of a stored sample as the model saw it: whatever its prompt held after the
    assistant header (`<think>\n` where the template opened the block), then its output without eos."""
    tok = renderer.tokenizer
    out = list(row["input_ids"][row["prompt_len"]:])
    while out and out[-1] in renderer.eos_ids:
        out.pop()
    opened = tok.decode(row["input_ids"][: row["prompt_len"]]).rsplit("<|im_start|>assistant\n", 1)[1]
    return opened + tok.decode(out)


def settled_ids(run_dir: Path) -> set[str]:
    return {r["sample_id"] for r in read_rows(run_dir)}


@pytest.fixture(scope="module")
def renderer_for(tiny_model_dir):
    cfg_cache = {}

    def get(cfg: RunConfig) -> Renderer:
        key = (cfg.tokenizer_path, cfg.context_length)
        if key not in cfg_cache:
            cfg_cache[key] = Renderer(cfg.tokenizer_path, enable_thinking=cfg.enable_thinking,
                                      context_length=cfg.context_length)
        return cfg_cache[key]

    return get


# The SGLang versions the simulator reproduces (engine/simulator/profiles.py): the whole set below runs on the
# default (the newest); the cases marked with `every_version` also run on the older ones.
every_version = pytest.mark.parametrize("sglang_version", ["0.5.23", "0.5.10", "0.5.5"])


# -- tests ------------------------------------------------------------------------------------------
@every_version
def test_run_to_done_rows_match_the_template(tmp_path, family_model_dir, supervisors, renderer_for, sglang_version):
    """On both template families (Qwen3; Qwen3.5/3.6 style, whose prompt opens <think>) and every SGLang version."""
    run_dir = tmp_path / "run"
    # some empty answers, and a max_new_tokens that cuts some answers inside their reasoning
    cfg = make_config(run_dir, family_model_dir, prompts=80,
                      sim=("--sim-empty-share", "0.2", "--sim-sglang-version", sglang_version))
    cfg = cfg.model_copy(update=dict(sampling=cfg.sampling.model_copy(update=dict(max_new_tokens=30))))
    shared_prom = tmp_path / "shared-prometheus"  # one dir in the operator's env: each server gets its own instead
    cfg = cfg.model_copy(update=dict(workers=cfg.workers.model_copy(update=dict(
        api_key="k-s3cret-key", env={"PROMETHEUS_MULTIPROC_DIR": str(shared_prom)}))))
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(120) == 0, sup.log_text()[-3000:]
    assert all((run_dir / "workers" / w / "prometheus_multiproc").is_dir() for w in ("gpu0", "gpu1"))
    assert not shared_prom.exists()
    renderer = renderer_for(cfg)
    rows = read_rows(run_dir)
    expected, _ = expected_samples(cfg, renderer)
    rejects = [json.loads(line) for line in (run_dir / "rejects.jsonl").read_text().splitlines()]
    rejected_turns = {f"{r['conversation_id']}#{r['reason'].split(':')[0].replace(' ', '')}" for r in rejects
                      if r["conversation_id"] and r["reason"].startswith("turn ")}
    assert {r["sample_id"] for r in rows} | rejected_turns == expected
    check_rows(rows, cfg, renderer)
    assert any(r["turn"] > 0 for r in rows)  # check_rows compared later turns' histories with the template
    assert_one_file_per_shard(run_dir)  # every shard finished: compacted
    assert "compacted s00000: " in sup.log_text()
    kinds = {r["kind"] for r in rejects}
    assert {"malformed_json", "no_conversation", "unknown_role", "context_overflow"} <= kinds
    tail = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    final = [e for e in tail if e["type"] == "dispatch"][-1]
    assert final["state"] == "done" and final["done"] == len(rows)
    assert not (run_dir / "supervisor.pid").exists() and not (run_dir / "control.sock").exists()
    for private in ("supervisor.log", "telemetry.jsonl"):
        assert "k-s3cret-key" not in (run_dir / private).read_text()
    assert "--api-key ***" in (run_dir / "workers" / "gpu0" / "server.log").read_text()
    check_answer_shapes(run_dir, rows, renderer)


def check_answer_shapes(run_dir: Path, rows: list[dict], renderer: Renderer) -> None:
    """No answer opens <think> after a prompt that did; `regen stats` and the store count empty, present,
    unterminated and missing answers as the rows say, on either template family."""
    think, close = renderer.think_open_id, renderer.think_close_id
    opened = renderer.prompt_opens_think
    empty_text = "\n</think>\n\nOK.<|im_end|>" if opened else "<think>\n\n</think>\n\nOK.<|im_end|>"
    empty = unterminated = 0
    for r in rows:
        out = r["input_ids"][r["prompt_len"]:]
        assert (think in out) is not opened, r["text"]
        if opened:  # reasoning runs from the first output token to </think> (to the end, eos excluded)
            n = len(out) - (out[-1] in renderer.eos_ids)
            assert r["reasoning_tokens"] == (out.index(close) if close in out else n)
        empty += r["text"] == empty_text
        unterminated += r["finish_reason"] == "length" and close not in out
    assert 0 < empty < len(rows) and 0 < unterminated < len(rows)
    report = compute_stats(run_dir)
    assert report.samples == len(rows)
    assert report.empty.count == empty
    assert report.reasoning["unterminated"].count == unterminated
    assert report.reasoning["missing"].count == 0
    assert report.reasoning["present"].count == len(rows) - unterminated
    with sqlite3.connect(f"file:{run_dir / 'state.sqlite'}?mode=ro", uri=True) as db:
        assert db.execute("SELECT sum(empty) FROM samples").fetchone()[0] == empty


@pytest.mark.slow
@every_version
def test_sigkill_at_random_moments_loses_and_duplicates_nothing(tmp_path, tiny_model_dir, supervisors,
                                                                renderer_for, sglang_version):
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=120,
                      sim=("--sim-output-mean", "40", "--sim-sglang-version", sglang_version))
    rng = random.Random(1234)
    for round_no in range(3):
        sup = supervisors(run_dir).start(cfg if round_no == 0 else None)
        wait_for(lambda: (status(run_dir) or {}).get("state") in ("running", "done") or sup.proc.poll() is not None,
                 60, "a running supervisor", sup)
        try:  # the SIGKILL lands at a random moment (what is tested), unless the run ends first
            sup.proc.wait(timeout=rng.uniform(0.3, 2.5))
        except subprocess.TimeoutExpired:
            pass
        sup.kill()
        for f in (run_dir / "shards").rglob("*.parquet"):
            pq.read_metadata(f)  # every file left on disk is a whole Parquet file
    sup = supervisors(run_dir).start()
    assert sup.wait(180) == 0, sup.log_text()[-3000:]
    rows = read_rows(run_dir)
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == len(set(ids))
    renderer = renderer_for(cfg)
    expected, _ = expected_samples(cfg, renderer)
    rejected = sum(1 for line in (run_dir / "rejects.jsonl").read_text().splitlines()
                   if json.loads(line)["reason"].startswith("turn "))
    assert len(ids) + rejected == len(expected)
    check_rows(rows, cfg, renderer)
    assert "recovered the shard store" in sup.log_text() or len(list((run_dir / "shards").rglob("*.tmp"))) == 0
    assert_one_file_per_shard(run_dir)  # shards finished before, between and after the kills: each compacted


@pytest.mark.slow
def test_pause_stops_dispatch_and_survives_restart(tmp_path, tiny_model_dir, supervisors):
    run_dir = tmp_path / "run"
    # slow answers so the run is still going when we look
    cfg = make_config(run_dir, tiny_model_dir, prompts=150, sim=("--sim-output-mean", "200", "--sim-step-ms", "10"))
    sup = supervisors(run_dir).start(cfg)
    wait_for(lambda: (status(run_dir) or {}).get("state") == "running", 60, "running", sup)
    r = ctl(run_dir, "pause", "s00002")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["result"]["paused"] == ["s00002"]
    # the pause takes effect at pull time, and a pull dispatches in the same loop turn: once the reply is
    # here, no sample of s00002 is sent; shown over the next 20 samples dispatched for the other shards
    def others(st: dict) -> int:
        return sum(s["dispatched"] for s in st["shards"] if s["id"] != "s00002")

    st = status(run_dir)
    before, others_before = {s["id"]: s for s in st["shards"]}["s00002"]["dispatched"], others(st)
    wait_for(lambda: (lambda st: st and (others(st) >= others_before + 20 or st["state"] == "paused"))(status(run_dir)),
             60, "20 more samples dispatched for the other shards", sup)
    now = {s["id"]: s for s in status(run_dir)["shards"]}
    assert now["s00002"]["dispatched"] == before
    assert now["s00002"]["state"] == "paused"
    bad = ctl(run_dir, "pause", "s99999")
    assert bad.returncode == 1 and "unknown shard" in bad.stderr
    unknown = ctl(run_dir, "restart-worker", "gpu9")
    assert unknown.returncode == 1 and "workers: gpu0, gpu1" in unknown.stderr
    assert ctl(run_dir, "restart-worker", "gpu0").returncode == 0
    wait_for(lambda: {w["name"]: w for w in status(run_dir)["workers"]}["gpu0"]["restarts"] == 1, 30,
             "gpu0 restarted", sup)
    assert ctl(run_dir, "stop").returncode == 0
    assert sup.wait(60) == 0
    sup = supervisors(run_dir).start()
    st = wait_for(lambda: (lambda s: s if s and s["state"] in ("running", "paused") and s["dispatch"] else None)(
        status(run_dir)), 60, "restarted supervisor", sup)
    shard = {s["id"]: s for s in st["shards"]}["s00002"]
    assert shard["state"] == "paused"
    wait_for(lambda: (status(run_dir) or {}).get("state") == "paused", 120, "everything but the paused shard", sup)
    assert {s["id"]: s for s in status(run_dir)["shards"]}["s00002"]["dispatched"] == 0
    assert ctl(run_dir, "resume", "s00002").returncode == 0
    assert sup.wait(120) == 0, sup.log_text()[-3000:]
    done = {s.shard_id: s for s in ShardStore(run_dir).progress()}["s00002"]
    assert done.done_samples > 0 and not done.paused


@every_version
def test_worker_crash_requeues_in_flight_samples(tmp_path, tiny_model_dir, supervisors, renderer_for, sglang_version):
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=150, sim=("--sim-crash-after", "40", "--sim-output-mean", "80",
                                                                 "--sim-sglang-version", sglang_version))
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(180) == 0, sup.log_text()[-3000:]
    events = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    crashes = [e for e in events if e["type"] == "alert" and "crashed" in e["text"]]
    assert crashes, "the simulated crash was not reported"
    assert any(e["type"] == "worker" and e["restarts"] > 0 for e in events)
    rows = read_rows(run_dir)
    renderer = renderer_for(cfg)
    expected, _ = expected_samples(cfg, renderer)
    rejected = sum(1 for line in (run_dir / "rejects.jsonl").read_text().splitlines()
                   if json.loads(line)["reason"].startswith("turn "))
    duplicate_alerts = [e["text"] for e in events if e["type"] == "alert" and "duplicate" in e["text"]]
    assert not duplicate_alerts, "an in-flight item was re-queued twice"
    assert len(rows) + rejected == len(expected)
    assert len({r["sample_id"] for r in rows}) == len(rows)
    final = [e for e in events if e["type"] == "dispatch"][-1]
    assert final["retried"] > 0 and final["failed"] == 0


def test_changed_content_config_is_refused_naming_the_field(tmp_path, tiny_model_dir, supervisors):
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=10)
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(120) == 0, sup.log_text()[-3000:]
    changed = cfg.model_copy(update=dict(sampling=cfg.sampling.model_copy(update=dict(temperature=0.9))))
    sup = supervisors(run_dir).start(changed)
    assert sup.wait(60) == 3
    assert "sampling.temperature 0.6 -> 0.9" in sup.log_text()


def test_ctl_without_supervisor_exits_2(tmp_path):
    r = ctl(tmp_path, "status")
    assert r.returncode == 2
    assert "control.sock does not exist" in r.stderr


def test_workers_that_keep_crashing_fail_the_run_with_the_error_lines(tmp_path, tiny_model_dir, supervisors):
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=200, sim=("--sim-oom-after", "3", "--sim-output-mean", "300"))
    cfg = cfg.model_copy(update=dict(workers=cfg.workers.model_copy(update=dict(max_restarts=1))))
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(120) == 1, sup.log_text()[-3000:]
    events = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    failed = [e for e in events if e["type"] == "alert" and "failed" in e["text"] and e["key"].endswith(":failed")]
    assert len(failed) == 2
    assert "out of memory" in failed[0]["evidence"].lower()
    assert any(e["type"] == "alert" and e["key"] == "all-failed" for e in events)
    assert [e for e in events if e["type"] == "dispatch"][-1]["state"] == "failed"
    rows = read_rows(run_dir)
    assert len({r["sample_id"] for r in rows}) == len(rows)  # what was committed stays, once


def test_hung_worker_is_killed_and_its_samples_requeued(tmp_path, tiny_model_dir, supervisors):
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=60, sim=("--sim-hang-after", "30"))
    cfg = cfg.model_copy(update=dict(
        workers=cfg.workers.model_copy(update=dict(health_timeout_s=2.0, health_failures=2)),
        dispatch=cfg.dispatch.model_copy(update=dict(request_timeout_s=300.0))))
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(150) == 0, sup.log_text()[-3000:]
    events = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    assert any(e["type"] == "alert" and e["key"].endswith(":hung") for e in events)
    assert "hung: /health failed 2 times" in sup.log_text()
    rows = read_rows(run_dir)
    assert len({r["sample_id"] for r in rows}) == len(rows)
    final = [e for e in events if e["type"] == "dispatch"][-1]
    assert final["state"] == "done" and final["failed"] == 0


@every_version
def test_5xx_and_aborts_are_retried_until_every_sample_is_done(tmp_path, tiny_model_dir, supervisors, sglang_version):
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=60, sim=("--sim-5xx-rate", "0.2", "--sim-abort-rate", "0.1",
                                                                "--sim-sglang-version", sglang_version))
    cfg = cfg.model_copy(update=dict(dispatch=cfg.dispatch.model_copy(update=dict(max_retries=10,
                                                                                   retry_backoff_s=0.05))))
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(120) == 0, sup.log_text()[-3000:]
    events = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    final = [e for e in events if e["type"] == "dispatch"][-1]
    assert final["state"] == "done" and final["retried"] > 0 and final["failed"] == 0
    rows = read_rows(run_dir)
    assert {r["finish_reason"] for r in rows} <= {"stop", "length"}
    assert final["done"] == len(rows) == len({r["sample_id"] for r in rows})
    assert "HTTP 503" in sup.log_text() and "aborted" in sup.log_text()


def test_status_without_shards_keeps_the_figures_and_leaves_out_the_list(tmp_path, tiny_model_dir, supervisors):
    run_dir = tmp_path / "run"
    # ~30 s of run (answers of ~1.2 s, 4 at a time a server): it outlasts the two readings on a loaded box
    sup = supervisors(run_dir).start(make_config(run_dir, tiny_model_dir, sim=(
        "--sim-step-ms", "40", "--sim-tokens-per-step", "1", "--max-running-requests", "4")))

    def pair() -> tuple[dict, dict] | None:
        """A full status and a compact one while the total stood still (a rejected sample lowers it mid-run)."""
        full = status(run_dir)
        if not (full and full["dispatch"] and full["shards"]):
            return None
        r = ctl(run_dir, "status", "--no-shards")
        assert r.returncode == 0, r.stderr
        compact = json.loads(r.stdout)["result"]
        return (full, compact) if compact["dispatch"]["total"] == full["dispatch"]["total"] else None

    full, compact = wait_for(pair, 60, "a status and a compact one with the same total", sup)
    assert compact["shards"] == [] and compact["shards_omitted"] is True and full["shards_omitted"] is False
    assert compact["workers"]
