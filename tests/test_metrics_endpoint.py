"""The run's figures in Prometheus ([metrics], engine/observe/metrics_server.py), scraped from rehearsals on the simulator with
prometheus-client's own parser: the figures equal `regen status --json` and the Parquet sums at a quiet point, the
counters never go backwards across a SIGKILL and restart of the supervisor, and a busy port is an alert and a status
note while the run goes on."""
from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from console.commands.status import render_status
from engine.text.answer_shape import think_state
from engine.config.load import Metrics, Sampling, Store
from engine.observe.metrics_server import ALERT_KEY, MetricsServer, families
from engine.api.status import MetricsStatus, Rejects, RunStatus
from engine.store.part_table import is_empty
from engine.store.shard_store import ShardStore
from engine.api.events import DispatchEvent
from tests.run_helpers import events, live_status
from tests.test_cli_run import cleanup_runs, regen, start_local  # noqa: F401  (cleanup_runs: a fixture)
from tests.test_engine_run import make_config, supervisors, wait_for  # noqa: F401  (supervisors: a fixture)

FAST_STORE = Store(part_max_age_s=0.3)  # parts committed soon after their last answer: quiet points come quickly
# the counters (monotone by contract), by sample name as the parser gives them
COUNTERS = ("regen_samples_done_total", "regen_output_tokens_total", "regen_samples_rejected_total",
            "regen_samples_empty_total", "regen_samples_truncated_total", "regen_samples_repetition_total",
            "regen_samples_unclosed_reasoning_total")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float] | None:
    """{(sample name, sorted labels): value} of one scrape; None while nothing answers on the port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = r.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def counted(scraped: dict) -> dict:
    """The run's own counters of a scrape: what stands still at a quiet point (the disk's free bytes move with
    whatever else writes to the machine, the tok/s window slides)."""
    return {k: v for k, v in scraped.items() if k[0] in COUNTERS}


def one(scraped: dict, name: str, **labels: str) -> float:
    return scraped[(name, tuple(sorted(labels.items())))]


def parquet_sums(run_dir: Path) -> dict[str, int]:
    """Sums over the committed part files (the store's list of parts: never a file it has not committed)."""
    store = ShardStore(run_dir)
    try:
        parts = store.parts()
    finally:
        store.close()
    sums = dict(samples=0, output_tokens=0, empty=0, truncated=0, repetition=0, unclosed_reasoning=0)
    for part in parts:
        t = pq.read_table(run_dir / part.path, columns=["output_len", "finish_reason", "text", "prompt_opened"])
        cols = t.to_pydict()
        sums["samples"] += t.num_rows
        sums["output_tokens"] += sum(cols["output_len"])
        sums["empty"] += sum(is_empty(x, o) for x, o in zip(cols["text"], cols["prompt_opened"]))
        sums["truncated"] += sum(fr == "length" for fr in cols["finish_reason"])
        sums["repetition"] += sum(fr == "repetition" for fr in cols["finish_reason"])
        sums["unclosed_reasoning"] += sum(
            think_state(x, o) == "unterminated" and fr != "repetition"
            for x, o, fr in zip(cols["text"], cols["prompt_opened"], cols["finish_reason"]))
    return sums


def figures(scraped: dict) -> dict[str, float]:
    return {name: one(scraped, name) for name in COUNTERS if (name, ()) in scraped}


@pytest.mark.slow
def test_scrape_equals_status_json_and_parquet_sums(tmp_path, tiny_model_dir, cleanup_runs):
    run_dir = tmp_path / "run"
    cleanup_runs.append(run_dir)
    port = free_port()
    # some answers empty, some cut at max_new_tokens: every share has something to count
    # a run of ~20 s: it must outlast `regen pause` on a loaded machine (at 20 ms steps it ended first, seen at load 6)
    cfg = make_config(run_dir, tiny_model_dir, prompts=1200, sim=("--sim-output-mean", "80", "--sim-step-ms", "100",
                                                                   "--sim-empty-share", "0.05"),
                      metrics=Metrics(port=port), store=FAST_STORE, sampling=Sampling(max_new_tokens=120))
    start_local(cfg, tmp_path)  # as the operator does: `regen status` then finds the run's python
    wait_for(lambda: (s := scrape(port)) and figures(s).get("regen_samples_done_total", 0) >= 40, 120,
             "40 committed samples on the metrics endpoint")
    paused = regen("pause", "local", "--run-dir", str(run_dir), "--all", home=tmp_path)
    assert paused.returncode == 0, paused.stderr

    def quiet() -> tuple[dict, dict, dict] | None:
        """Paused with nothing in flight, and the scrape, status --json and the Parquet files read while nothing
        moved (the same counters before and after)."""
        before = scrape(port)
        js = regen("status", "local", "--run-dir", str(run_dir), "--json", home=tmp_path)
        assert js.returncode == 0, js.stderr
        st = json.loads(js.stdout)
        try:
            sums = parquet_sums(run_dir)
        except FileNotFoundError:  # a finished shard was compacted into one file while its parts were read
            return None
        after = scrape(port)
        assert st["state"] == "paused", f"the run is {st['state']}, not paused: it must outlast the pause"
        d = st["dispatch"]
        if before is None or after is None or d["in_flight"] or counted(before) != counted(after) \
                or sums["samples"] != d["done"]:
            return None
        return after, st, sums

    scraped, st, sums = wait_for(quiet, 60, "a quiet point: paused, nothing in flight, every answer committed")
    d = st["dispatch"]
    # the figures: status --json, the Parquet sums and the endpoint say the same
    assert one(scraped, "regen_samples_done_total") == d["done"] == sums["samples"] > 0
    assert one(scraped, "regen_output_tokens_total") == d["output_tokens"] == sums["output_tokens"] > 0
    assert one(scraped, "regen_samples_empty_total") == sum(sh["empty"] for sh in st["shards"]) == sums["empty"] > 0
    assert one(scraped, "regen_samples_truncated_total") == sum(sh["truncated"] for sh in st["shards"]) \
        == sums["truncated"] > 0
    assert one(scraped, "regen_samples_repetition_total") == d["repetition"] == sums["repetition"]
    assert one(scraped, "regen_samples_unclosed_reasoning_total") == \
        sum(sh["unclosed_reasoning"] for sh in st["shards"]) == sums["unclosed_reasoning"] > 0
    assert one(scraped, "regen_committed_share", kind="truncated") == pytest.approx(sums["truncated"] / sums["samples"])
    assert one(scraped, "regen_samples_to_generate") == d["total"]
    assert one(scraped, "regen_samples_planned") == d["planned"]
    assert one(scraped, "regen_samples_rejected_total") == d["rejected"]
    assert one(scraped, "regen_samples_failed") == d["failed"]
    assert one(scraped, "regen_requests_in_flight") == 0
    assert one(scraped, "regen_run_state", state="paused") == 1
    assert one(scraped, "regen_run_state", state="running") == 0
    assert ("regen_eta_seconds", ()) not in scraped  # not running: no ETA, as the status says (null)
    by_state: dict[str, int] = {}
    for sh in st["shards"]:
        by_state[sh["state"]] = by_state.get(sh["state"], 0) + 1
    for state, n in by_state.items():
        assert one(scraped, "regen_shards", state=state) == n
    assert sum(v for (name, _), v in scraped.items() if name == "regen_shards") == len(st["shards"])
    for reason, n in st["rejects"]["by_reason"].items():
        assert one(scraped, "regen_rejects_total", reason=reason) == n
    assert len(st["workers"]) == 2
    for w in st["workers"]:
        assert one(scraped, "regen_worker_state", worker=w["name"], host=w["host"], state=w["state"]) == 1
        assert one(scraped, "regen_worker_capacity_requests", worker=w["name"], host=w["host"]) == w["capacity"]
    assert one(scraped, "regen_brake_engaged") == (1 if st["brake"]["engaged"] else 0)
    assert {dict(labels)["reason"] for (name, labels) in scraped if name == "regen_brake_window_share"} == \
        {x["reason"] for x in st["brake"]["window"]}
    assert st["disk"] and all(one(scraped, "regen_disk_free_bytes", host=x["host"], path=x["path"]) > 0
                              for x in st["disk"])
    # where: in status --json and in the text the operator reads
    url = f"http://127.0.0.1:{port}/metrics"
    assert st["metrics"] == {"enabled": True, "address": f"127.0.0.1:{port}", "url": url, "error": None}
    text = regen("status", "local", "--run-dir", str(run_dir), home=tmp_path)
    assert f"metrics: {url} (Prometheus)" in text.stdout
    stopped = regen("stop", "local", "--run-dir", str(run_dir), home=tmp_path)
    assert stopped.returncode == 0, stopped.stderr
    wait_for(lambda: scrape(port) is None, 60, "the endpoint to close with its supervisor")


@pytest.mark.slow
def test_counters_never_go_backwards_across_a_sigkill_and_restart(tmp_path, tiny_model_dir, supervisors):
    run_dir = tmp_path / "run"
    port = free_port()
    cfg = make_config(run_dir, tiny_model_dir, prompts=240, sim=("--sim-output-mean", "80", "--sim-step-ms", "8"),
                      metrics=Metrics(port=port), store=FAST_STORE)
    seen: list[tuple[int, dict[str, float]]] = []  # (start no., the counters of one scrape), in scrape order

    def scraped_past(start: int, done: float):
        s = scrape(port)
        if s is not None and (figs := figures(s)):
            seen.append((start, figs))
            return figs.get("regen_samples_done_total", 0) >= done and figs
        return None

    sup = supervisors(run_dir).start(cfg)
    before = wait_for(lambda: scraped_past(1, 60), 120, "60 committed samples on the endpoint", sup)
    sup.kill()
    assert scrape(port) is None  # the endpoint went with its process
    sup = supervisors(run_dir).start()
    after = wait_for(lambda: scraped_past(2, 0), 120, "the restarted supervisor's first figures", sup)
    # the restarted supervisor starts from the committed state: no counter reads less than before the kill, and
    # the run's committed figures are whatever state.sqlite holds (what the killed one had committed, at least)
    for name, value in before.items():
        assert after[name] >= value, (name, value, after[name])
    wait_for(lambda: sup.proc.poll() is not None or scraped_past(2, 1e18), 180, "the run to finish", None)
    assert sup.wait(60) == 0, sup.log_text()[-3000:]
    assert {start for start, _ in seen} == {1, 2} and len(seen) >= 4
    for (_, prev), (start, cur) in zip(seen, seen[1:]):
        for name, value in prev.items():
            assert cur[name] >= value, f"{name} went from {value} to {cur[name]} (start {start})"
    sums = parquet_sums(run_dir)
    last = seen[-1][1]
    assert last["regen_samples_done_total"] <= sums["samples"] and last["regen_output_tokens_total"] <= \
        sums["output_tokens"]


def test_a_busy_port_is_an_alert_and_a_status_note_and_the_run_goes_on(tmp_path, tiny_model_dir, supervisors):
    run_dir = tmp_path / "run"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        cfg = make_config(run_dir, tiny_model_dir, prompts=40, sim=("--sim-output-mean", "40"),
                          metrics=Metrics(port=port))
        sup = supervisors(run_dir).start(cfg)
        st = wait_for(lambda: (s := live_status(run_dir)) and s.get("metrics") and s, 60, "a live status", sup)
        note = st["metrics"]
        assert note["url"] is None and f"port {port} is busy (held by pid " in note["error"]
        assert "set [metrics] port to a free one" in note["error"]
        assert sup.wait(120) == 0, sup.log_text()[-3000:]  # the run went on to its end
    alerts = [e for e in events(run_dir) if e["type"] == "alert" and e["key"] == ALERT_KEY]
    assert len(alerts) == 1 and alerts[0]["severity"] == "warning"
    assert f"not served on 127.0.0.1:{port}: the run goes on" in alerts[0]["text"]
    assert f"port {port} is busy" in alerts[0]["evidence"]
    assert "metrics not served: port" in sup.log_text()
    # the note as `regen status` prints it
    status = RunStatus.from_dict({**st, "metrics": note})
    text = render_status(status).renderables[0].plain
    assert f"metrics: not served on 127.0.0.1:{port}: port {port} is busy (held by pid " in text


def test_metrics_off_is_said_and_serves_nothing(tmp_path):
    port = free_port()

    async def start() -> MetricsStatus:
        server = MetricsServer(Metrics(enabled=False, port=port), lambda: RunStatus(run_dir="", state="running"),
                               emit=lambda ev: pytest.fail(f"an alert for a disabled endpoint: {ev}"))
        return await server.start()

    state = asyncio.run(start())
    assert state.url is None and state.text() == "metrics: not served ([metrics] enabled = false)"
    assert scrape(port) is None


def test_a_starting_supervisor_sends_no_figure_that_would_read_as_a_counter_reset():
    """Before the ledger is loaded the status has no figures: the counters are left out, never sent as 0."""
    starting = RunStatus(run_dir="/r", state="starting", dispatch=None, rejects=Rejects())
    names = {s.name for fam in families(starting) for s in fam.samples}
    assert not names & set(COUNTERS)
    assert "regen_run_state" in names
    running = RunStatus(run_dir="/r", state="running", rejects=Rejects(3, {"malformed_json": 3}),
                        dispatch=DispatchEvent(done=7, total=10, output_tokens=700, tokens_per_s=35.0, eta_s=60.0))
    by_name = {s.name: s.value for fam in families(running) for s in fam.samples if not s.labels}
    assert by_name["regen_samples_done_total"] == 7 and by_name["regen_output_tokens_total"] == 700
    assert by_name["regen_output_tokens_per_second"] == 35.0 and by_name["regen_eta_seconds"] == 60.0
    assert not any(name.endswith("_created") for name in by_name)  # no created time: a restart is no reset


def full_status() -> RunStatus:
    """A status with every part the exporter reads: figures, shards, workers, the brake, rejects, alerts, disk."""
    from engine.api.brake import BrakeShare, BrakeStatus
    from engine.api.wire import ShardFigures
    from engine.api.events import AlertEvent, DiskEvent, WorkerEvent
    return RunStatus(
        run_dir="/r", state="running", started_at=1.0, rejects=Rejects(1, {"malformed_json": 1}),
        dispatch=DispatchEvent(done=7, total=10, output_tokens=700, tokens_per_s=35.0, eta_s=60.0),
        shards=[ShardFigures(id="shard-00000", state="running", done=7, total=10, planned=10, output_tokens=700,
                            empty=1, truncated=1, failed=0, rejected=0)],
        workers=[WorkerEvent(name="w0", state="ready", in_flight=3, capacity=8)],
        brake=BrakeStatus(window=[BrakeShare("empty", 1, 7, 1 / 7, 0.5)]),
        alerts=[AlertEvent(severity="warning", text="x")], disk=[DiskEvent(path="/r", free_bytes=1, total_bytes=2)])


def test_the_grafana_dashboard_plots_series_that_exist():
    """docs/grafana-regen.json: every regen_ series it queries is exported, every sglang: one is SGLang's (as the
    simulator, measured against SGLang, serves it)."""
    import re

    from engine.simulator.metrics import SimMetrics
    dashboard = json.loads((Path(__file__).resolve().parents[1] / "docs" / "grafana-regen.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\b(regen_\w+|sglang:\w+)", e)}
    exported = {s.name for fam in families(full_status(), per_shard=True) for s in fam.samples}
    sglang = {s.name for fam in SimMetrics("m").registry.collect() for s in fam.samples}
    assert {m for m in used if m.startswith("regen_")} <= exported
    assert {m for m in used if m.startswith("sglang:")} <= sglang
    assert {"sglang:gen_throughput", "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"} <= used
    assert {"regen_samples_done_total", "regen_output_tokens_per_second", "regen_eta_seconds", "regen_committed_share",
            "regen_brake_engaged", "regen_worker_state", "regen_shards", "regen_rejects_total", "regen_alerts",
            "regen_disk_free_bytes"} <= used


def test_unclosed_reasoning_counted_at_commit_equals_the_stores_count_at_a_restart(tmp_path):
    """The ledger moves the count by each committed part's shapes; a restart loads it from the samples table: the
    two agree, so regen_samples_unclosed_reasoning_total does not jump at a restart."""
    from engine.run.counts import ShardCounts, counts_from_store
    from tests.test_shard_store import make_row
    store = ShardStore(tmp_path)
    try:
        store.ensure_shards({"s00000": 10})
        rows = [make_row("a"), make_row("b", text="<think>\nstill thinking and never clos"),
                make_row("c", text="<think>\nlooping looping", finish_reason="repetition"),  # the guard's cut
                make_row("d", text="<think>\ncut here", finish_reason="length")]
        live = ShardCounts(total=10)
        live.add_part(store.commit("s00000", rows))
        (loaded,) = counts_from_store(store.progress()).values()
    finally:
        store.close()
    assert live.unclosed_reasoning == loaded.unclosed_reasoning == 2


def test_port_0_serves_on_a_port_the_system_picks_and_says_which():
    async def serve() -> tuple[MetricsStatus, dict | None]:
        server = MetricsServer(Metrics(port=0), lambda: RunStatus(run_dir="", state="running"),
                               emit=lambda ev: pytest.fail(f"an alert: {ev}"))
        state = await server.start()
        port = int(state.address.rpartition(":")[2])
        scraped = await asyncio.to_thread(scrape, port)
        await server.close()
        return state, scraped

    state, scraped = asyncio.run(serve())
    assert state.address != "127.0.0.1:0" and state.url == f"http://{state.address}/metrics"
    assert scraped is not None and one(scraped, "regen_run_state", state="running") == 1
