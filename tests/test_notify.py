"""[notify]: failures and the run's end reach an operator who is not looking.

Unit tests of the bodies, the rate limit, retries, the command destination and the config checks,
against a real aiohttp receiver on 127.0.0.1; then end-to-end runs of the supervisor with the
simulator (a worker crash loop, a disk-full pause, a finished run, an unreachable webhook)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from engine.config.load import ConfigError, NotifyConfig, config_from_dict
from engine.notify import Notification, Notifier, notification_for
from engine.notify.formats import webhook_request
from engine.notify.limiter import Limiter
from engine.api.events import AlertEvent, DispatchEvent, FatalEvent, RunEndEvent
from tests.run_helpers import ctl, events, make_config, wait_for
from tests.run_helpers import supervisors  # noqa: F401  (fixture)
from tests.test_engine_run import SupervisorProc
from tests.waiting import await_until


# -- a webhook receiver: an aiohttp server on 127.0.0.1, in a thread so sync and async tests share it --
class Receiver:
    def __init__(self, statuses: list[int] | None = None, hang: bool = False):
        self.requests: list[dict] = []
        self.statuses = list(statuses or [])  # answered in turn; 200 once used up
        self.hang = hang
        self._cond = threading.Condition()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "receiver did not start"

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._released = asyncio.Event()
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self._server = TestServer(app, host="127.0.0.1")
        await self._server.start_server()
        self.port = self._server.port

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if self.hang:
            await self._released.wait()  # set at close, so the server can shut down
        with self._cond:
            self.requests.append({"path": request.path, "headers": dict(request.headers), "body": body})
            self._cond.notify_all()
            status = self.statuses.pop(0) if self.statuses else 200
        return web.Response(status=status, text="ok" if status == 200 else "boom")

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def bodies(self) -> list[dict]:
        with self._cond:
            return [json.loads(r["body"]) for r in self.requests]

    def wait(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                value = predicate([json.loads(r["body"]) for r in self.requests])
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {what}; received: {self.requests}")
                self._cond.wait(min(left, 0.2))

    def close(self) -> None:
        async def stop():
            self._released.set()
            await self._server.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def make(**kw) -> Receiver:
        r = Receiver(**kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on return: nothing listens there


def notif(**kw) -> Notification:
    base = dict(kind="alert", severity="critical", title="regen critical: worker gpu0 failed",
                text="worker gpu0 failed: 6 crashes in 600 s, not restarted again",
                evidence="crashed (signal 9)", key="worker:gpu0:failed", ts=1700000000.0,
                run_dir="/data/run1", host="gpu-box")
    base.update(kw)
    return Notification(**base)


def ncfg(**kw) -> NotifyConfig:
    kw.setdefault("retry_backoff_s", 0.01)
    return NotifyConfig(**kw)


class Sink:
    """Telemetry stand-in: records what the notifier emits and feeds it back to the listeners, as
    Telemetry.emit does (so a loop would show)."""

    def __init__(self):
        self.events: list = []
        self.listeners: list = []

    def emit(self, ev) -> None:
        self.events.append(ev)
        for listener in self.listeners:
            listener(ev)

    def failures(self) -> list[AlertEvent]:
        return [e for e in self.events if isinstance(e, AlertEvent) and e.key == "notify.failed"]


def make_notifier(cfg: NotifyConfig, sink: Sink) -> Notifier:
    n = Notifier(cfg, "/data/run1", sink.emit, host="gpu-box")
    sink.listeners.append(n.on_event)
    return n


async def until(predicate, timeout: float, what: str):
    return await await_until(predicate, timeout, what, interval=0.02)


# -- bodies -------------------------------------------------------------------------------------------
def test_generic_body_has_every_field():
    req = webhook_request(notif(), "generic")
    assert set(req.json) == {"run_dir", "host", "kind", "severity", "title", "text", "evidence", "key", "ts"}
    assert req.json["kind"] == "alert" and req.json["evidence"] == "crashed (signal 9)" and req.data is None


def test_slack_and_discord_bodies():
    slack = webhook_request(notif(), "slack").json
    assert list(slack) == ["text"]
    assert slack["text"].startswith("*regen critical: worker gpu0 failed*\nworker gpu0 failed: 6 crashes")
    assert "```\ncrashed (signal 9)\n```" in slack["text"] and "`/data/run1` on gpu-box" in slack["text"]
    long = notif(evidence="x" * 10_000, text="y" * 5000)
    discord = webhook_request(long, "discord").json
    assert list(discord) == ["content"] and len(discord["content"]) <= 2000
    assert discord["content"].startswith("**regen critical") and discord["content"].endswith("2023-11-14 22:13:20Z_")


def test_ntfy_is_plain_text_with_title_and_priority_headers():
    req = webhook_request(notif(title="regen critical: disque plein sous /données"), "ntfy",
                          {"Authorization": "Bearer tk"})
    assert req.json is None and req.data.decode().startswith("worker gpu0 failed")
    assert req.headers["Priority"] == "urgent" and req.headers["Authorization"] == "Bearer tk"
    assert req.headers["Title"].startswith("=?utf-8?")  # RFC 2047: header values are latin-1 on the wire
    assert webhook_request(notif(severity="info"), "ntfy").headers["Priority"] == "low"


# -- which events are sent --------------------------------------------------------------------------
def test_events_picked_by_severity_and_kind():
    cfg = ncfg(url="http://x/")
    pick = lambda ev, c=cfg: notification_for(ev, c, run_dir="/r", host="h")  # noqa: E731
    assert pick(AlertEvent(severity="error", text="worker gpu0 crashed", key="worker:gpu0:crash")) is None
    assert pick(AlertEvent(severity="critical", text="disk low", key="disk-low")).kind == "alert"
    assert pick(AlertEvent(severity="error", text="x", key="k"), ncfg(url="http://x/", min_severity="error"))
    assert pick(AlertEvent(severity="error", text="notification not delivered: x", key="notify.failed"),
                ncfg(url="http://x/", min_severity="info")) is None
    assert pick(DispatchEvent(state="disk_full")) is None  # the disk-low alert says it, once
    done = pick(RunEndEvent(state="done", done=10, total=10))
    assert done.severity == "info" and done.text == "run finished: 10/10 samples done (exit code 0)"
    assert pick(RunEndEvent(state="stopped"), ncfg(url="http://x/", run_end=False)) is None
    failed = pick(RunEndEvent(state="failed", exit_code=1, cause="every worker failed: the run stops", done=3,
                              total=9), ncfg(url="http://x/", run_end=False))
    assert failed.severity == "critical" and "run failed at 3/9 samples (exit code 1): every worker failed" in failed.text


# -- rate limit and coalescing ---------------------------------------------------------------------
def test_rate_limit_holds_the_excess_and_sums_it_up_once():
    lim = Limiter(max_per_minute=2, dedupe_s=600)
    assert lim.admit(notif(key="a", text="alert a"), 0) and lim.admit(notif(key="b", text="alert b"), 1)
    assert not lim.admit(notif(key="c", text="alert c"), 2)
    assert not lim.admit(notif(key="d", text="alert d"), 3)
    assert lim.admit(notif(kind="run_end", key="run_end"), 4)  # the run's end is never held
    assert lim.take_summary(30) is None and lim.summary_due_in(30) == pytest.approx(30)
    assert lim.take_summary(60.5) is None  # the run's end used the slot that t=0 freed
    summary = lim.take_summary(61)
    assert summary.title == "regen: 2 more alerts suppressed" and summary.text == "alert c\nalert d"
    assert "notify.max_per_minute = 2" in summary.evidence and lim.take_summary(200) is None


def test_same_key_is_deduplicated_and_counted():
    lim = Limiter(max_per_minute=10, dedupe_s=300)
    assert lim.admit(notif(key="disk-low", text="disk low: 1 GiB free"), 0)
    for t in (10, 20, 30):
        assert not lim.admit(notif(key="disk-low", text="disk low: 1 GiB free"), t)
    assert lim.summary_due_in(40) == pytest.approx(260)  # not before the key's window ends
    summary = lim.take_summary(300)
    assert summary.text == "3x disk low: 1 GiB free" and summary.severity == "critical"
    forced = Limiter(1, 300)
    forced.admit(notif(key="a"), 0)
    forced.admit(notif(key="a"), 1)
    assert forced.take_summary(2, force=True).title == "regen: 1 more alert suppressed"


async def test_flood_sends_the_limit_then_one_summary(receiver):
    r = receiver()
    sink = Sink()
    n = make_notifier(ncfg(url=r.url(), max_per_minute=2), sink)
    n.start()
    for i in range(5):
        sink.emit(AlertEvent(severity="critical", text=f"alert {i}", key=f"k{i}"))
    await until(lambda: len(r.requests) == 2, 10, "two alerts")
    await n.aclose(5)
    bodies = r.bodies()
    assert [b["text"] for b in bodies[:2]] == ["alert 0", "alert 1"]
    assert len(bodies) == 3 and bodies[2]["title"] == "regen: 3 more alerts suppressed"
    assert bodies[2]["text"] == "alert 2\nalert 3\nalert 4" and not sink.failures()


# -- retries and failures ---------------------------------------------------------------------------
async def test_retries_until_delivered(receiver):
    r = receiver(statuses=[500, 503])
    sink = Sink()
    n = make_notifier(ncfg(url=r.url(), retries=3), sink)
    n.start()
    sink.emit(AlertEvent(severity="critical", text="disk low", key="disk-low"))
    await n.aclose(5)
    assert len(r.requests) == 3 and not sink.failures()
    assert [d for d, _ in n.delivered] == [f"webhook http://127.0.0.1:{r.port}/… (generic)"]


async def test_retries_exhausted_is_an_alert_never_itself_sent(receiver, caplog):
    r = receiver(statuses=[500] * 10)
    sink = Sink()
    n = make_notifier(ncfg(url=r.url(), retries=3, min_severity="error"), sink)
    n.start()
    sink.emit(AlertEvent(severity="critical", text="worker gpu0 failed", key="worker:gpu0:failed"))
    await until(sink.failures, 10, "the notify.failed alert")
    await n.aclose(5)
    assert len(r.requests) == 3  # three tries of the alert; the failure alert (error >= min) is not sent
    (failure,) = sink.failures()
    assert failure.severity == "error"
    assert failure.text.startswith("notification not delivered: regen critical: worker gpu0 failed (webhook ")
    assert "3 tries: HTTP 500 Internal Server Error: boom" in failure.text
    assert "notification not delivered to webhook" in caplog.text


async def test_a_4xx_is_not_retried_and_names_the_fix(receiver):
    r = receiver(statuses=[404])
    sink = Sink()
    n = make_notifier(ncfg(url=r.url(), retries=3), sink)
    n.start()
    sink.emit(AlertEvent(severity="critical", text="x", key="x"))
    await n.aclose(5)
    assert len(r.requests) == 1
    assert "1 try: HTTP 404 Not Found" in sink.failures()[0].text
    assert "check notify.url, notify.headers and notify.format" in sink.failures()[0].text


async def test_unreachable_webhook_is_alerted():
    sink = Sink()
    n = make_notifier(ncfg(url=f"http://127.0.0.1:{closed_port()}/hook", retries=2), sink)
    n.start()
    sink.emit(RunEndEvent(state="done", done=5, total=5))
    await n.aclose(5)
    (failure,) = sink.failures()
    assert "notification not delivered: regen: run done (5/5 samples)" in failure.text
    assert "2 tries: ClientConnectorError" in failure.text


async def test_exit_flush_is_bounded_by_flush_timeout(receiver):
    r = receiver(hang=True)
    sink = Sink()
    n = make_notifier(ncfg(url=r.url(), timeout_s=60, flush_timeout_s=1.0), sink)
    n.start()
    sink.emit(AlertEvent(severity="critical", text="first", key="a"))
    sink.emit(RunEndEvent(state="stopped", done=1, total=2))
    started = time.monotonic()
    await n.aclose()
    assert time.monotonic() - started < 3.0
    texts = [f.text for f in sink.failures()]
    assert len(texts) == 2 and any("run stopped" in t for t in texts)
    assert all("notify.flush_timeout_s" in t for t in texts), texts


async def test_fatal_death_is_one_notification_with_the_cause(receiver):
    r = receiver()
    sink = Sink()
    n = make_notifier(ncfg(url=r.url()), sink)
    n.start()
    sink.emit(FatalEvent(exc_type="PromptFileError", message="prompts file /data/chat.jsonl: No such file or directory",
                         path="/data/chat.jsonl", remedy="fix prompts in run.toml, then regen start again",
                         phase="start"))
    sink.emit(RunEndEvent(state="failed", exit_code=1, cause="PromptFileError: prompts file /data/chat.jsonl"))
    await n.aclose(5)
    (body,) = r.bodies()
    assert body["kind"] == "fatal" and body["severity"] == "critical"
    assert body["title"] == "regen: supervisor died: PromptFileError: prompts file /data/chat.jsonl: No such file or directory"
    assert "remedy: fix prompts in run.toml" in body["text"] and "path: /data/chat.jsonl" in body["evidence"]


def test_events_after_the_loop_ended_are_flushed_by_a_sync_close(receiver):
    """A last word emitted outside any event loop (e.g. after asyncio.run returned) is still sent."""
    r = receiver()
    sink = Sink()
    n = make_notifier(ncfg(url=r.url()), sink)
    sink.emit(RunEndEvent(state="failed", exit_code=1, cause="every worker failed: the run stops", done=1, total=4))
    n.close(5)
    (body,) = r.bodies()
    assert body["kind"] == "run_end" and body["text"].endswith("(exit code 1): every worker failed: the run stops")


# -- the command destination -----------------------------------------------------------------------
RECORDER = """
import json, os, sys
data = json.load(sys.stdin)
env = {k: v for k, v in os.environ.items() if k.startswith("REGEN_NOTIFY_")}
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"stdin": data, "env": env}) + "\\n")
print("paged the on-call")
print("a warning on stderr", file=sys.stderr)
sys.exit(int(sys.argv[2]))
"""


async def test_command_gets_the_json_on_stdin_and_env(tmp_path, caplog):
    caplog.set_level(logging.INFO, "regen.notify")
    script = tmp_path / "page.py"
    script.write_text(RECORDER)
    out = tmp_path / "calls.jsonl"
    sink = Sink()
    n = make_notifier(ncfg(command=(sys.executable, str(script), str(out), "0")), sink)
    n.start()
    sink.emit(AlertEvent(severity="critical", text="disk low: 3.0 GiB free", evidence="alerts.disk_free_min_gb = 20",
                         key="disk-low"))
    await n.aclose(10)
    (call,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert call["stdin"]["text"] == "disk low: 3.0 GiB free" and call["stdin"]["kind"] == "alert"
    assert call["env"]["REGEN_NOTIFY_SEVERITY"] == "critical" and call["env"]["REGEN_NOTIFY_KEY"] == "disk-low"
    assert call["env"]["REGEN_NOTIFY_RUN_DIR"] == "/data/run1" and call["env"]["REGEN_NOTIFY_HOST"] == "gpu-box"
    assert "stdout: paged the on-call; stderr: a warning on stderr" in caplog.text and not sink.failures()


async def test_failing_command_is_retried_and_alerted_with_its_stderr(tmp_path, caplog):
    script = tmp_path / "page.py"
    script.write_text(RECORDER)
    out = tmp_path / "calls.jsonl"
    sink = Sink()
    n = make_notifier(ncfg(command=(sys.executable, str(script), str(out), "3"), retries=2), sink)
    n.start()
    sink.emit(AlertEvent(severity="critical", text="x", key="x"))
    await n.aclose(10)
    assert len(out.read_text().splitlines()) == 2
    assert "2 tries:" in sink.failures()[0].text and "exited with 3: a warning on stderr" in sink.failures()[0].text
    missing = Sink()
    n = make_notifier(ncfg(command=("/nonexistent/page-oncall",)), missing)
    missing.emit(AlertEvent(severity="critical", text="x", key="x"))
    await n.aclose(5)
    assert "cannot run /nonexistent/page-oncall" in missing.failures()[0].text
    assert "check notify.command" in missing.failures()[0].text


# -- config ----------------------------------------------------------------------------------------
def base(**kw):
    d = {"run_dir": "/tmp/r", "model": "/m", "prompts": ["/p/*.jsonl"]}
    d.update(kw)
    return d


@pytest.mark.parametrize("notify,needle", [
    ({}, '[notify]: has neither url nor command: set url = "https://..."'),
    ({"url": "ftp://host/x"}, "[notify] url: 'ftp://host/…': the scheme must be http or https"),
    ({"url": ""}, "[notify] url: is empty: give the webhook URL"),
    ({"url": "https:///x"}, "no host in the URL"),
    ({"url": "https://ntfy.sh/t", "format": "teams"},
     "[notify] format: \"teams\": must be one of 'generic', 'slack', 'discord' or 'ntfy'"),
    ({"command": []}, ("[notify] command: []", "give the program and its arguments")),  # the value found, the fix
    ({"command": "page-me --now"},
     ('[notify] command: "page-me --now" (a string): expected a list', "argv, no shell")),  # and why a list
    ({"url": "https://x.io/", "min_severity": "fatal"},
     "[notify] min_severity: \"fatal\": must be one of 'info', 'warning', 'error' or 'critical'"),
    ({"url": "https://x.io/", "retries": 0}, "[notify] retries: 0: must be greater than or equal to 1"),
    ({"url": "https://x.io/", "flush_timeout_s": 0}, "[notify] flush_timeout_s: 0: must be > 0"),
    ({"url": "https://x.io/", "headers": {"A": 1}}, "[notify] headers.A: 1 (an integer): expected a string"),
    ({"url": "https://x.io/", "webhook": "y"}, "[notify] webhook: unknown key"),
])
def test_config_errors_name_the_field(notify, needle):
    with pytest.raises(ConfigError) as e:
        config_from_dict(base(notify=notify))
    for words in (needle,) if isinstance(needle, str) else needle:
        assert words in str(e.value)


def test_notify_is_operational_not_content():
    plain = config_from_dict(base())
    notified = config_from_dict(base(notify={"url": "https://ntfy.sh/regen-x", "format": "ntfy"}))
    assert not plain.notify.enabled and notified.notify.enabled
    assert plain.content_hash() == notified.content_hash()


# -- end to end: the supervisor with the simulator -------------------------------------------------
def notify_table(url: str, **kw) -> NotifyConfig:
    return NotifyConfig(url=url, retry_backoff_s=0.2, flush_timeout_s=5.0, **kw)


def _events(run_dir: Path) -> list[dict]:
    return events(run_dir) if (run_dir / "telemetry.jsonl").exists() else []


def _alerts(bodies: list[dict]) -> list[dict]:
    return [b for b in bodies if b["kind"] == "alert"]


def test_finished_run_is_one_notification(tmp_path, tiny_model_dir, supervisors, receiver):
    r = receiver()
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=20, gpus=1).model_copy(update=dict(
        notify=notify_table(r.url())))
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(120) == 0, sup.log_text()[-3000:]
    (body,) = r.bodies()
    assert body["kind"] == "run_end" and body["severity"] == "info" and body["run_dir"] == str(run_dir)
    assert body["text"].startswith("run finished: ") and body["text"].endswith("samples done (exit code 0)")
    end = [e for e in events(run_dir) if e["type"] == "run_end"]
    assert len(end) == 1 and end[0]["state"] == "done"


def test_worker_crash_loop_is_one_notification_with_the_cause(tmp_path, tiny_model_dir, supervisors, receiver):
    r = receiver()
    run_dir = tmp_path / "run"
    # slow answers: the run outlasts the two crashes (it is stopped once the notification came)
    cfg = make_config(run_dir, tiny_model_dir, prompts=300, gpus=2,
                      sim=("--sim-output-mean", "400", "--sim-step-ms", "50", "--max-running-requests", "8"))
    cfg = cfg.model_copy(update=dict(workers=cfg.workers.model_copy(update=dict(max_restarts=1)),
                                     notify=notify_table(r.url())))
    sup = supervisors(run_dir).start(cfg)
    pid_file = run_dir / "workers" / "gpu0" / "server.pid"

    def gpu0(state: str, restarts: int):
        return any(e["type"] == "worker" and e["name"] == "gpu0" and e["state"] == state and e["restarts"] == restarts
                   for e in _events(run_dir))

    for crash in range(2):  # max_restarts = 1: the second crash fails the worker
        wait_for(lambda: gpu0("ready", crash), 90, f"gpu0 ready after {crash} restarts", sup)
        os.killpg(int(pid_file.read_text()), signal.SIGKILL)
    body = r.wait(lambda bs: next((b for b in bs if b["key"] == "worker:gpu0:failed"), None), 60,
                  "the crash-loop notification")
    assert body["severity"] == "critical" and body["text"].startswith("worker gpu0 failed: 2 crashes in")
    assert "signal 9" in body["evidence"]
    assert ctl(run_dir, "stop").returncode == 0
    assert sup.wait(120) == 0, sup.log_text()[-3000:]
    bodies = r.bodies()
    assert len(_alerts(bodies)) == 1, bodies  # the two crashes (error alerts) are not sent; the failure once
    assert [b["kind"] for b in bodies] == ["alert", "run_end"] and bodies[1]["text"].startswith("run stopped at ")


def test_disk_full_pause_is_one_notification(tmp_path, tiny_model_dir, supervisors, receiver):
    r = receiver()
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=20, gpus=1)
    # a threshold above any disk's free space: the free-space guard pauses dispatch at its first tick
    cfg = cfg.model_copy(update=dict(alerts=cfg.alerts.model_copy(update=dict(disk_free_min_gb=1e9)),
                                     notify=notify_table(r.url())))
    sup = supervisors(run_dir).start(cfg)
    body = r.wait(lambda bs: next((b for b in bs if b["key"] == "disk-low"), None), 90, "the disk-low notification")
    assert body["severity"] == "critical" and "dispatch paused" in body["text"] and str(run_dir) in body["text"]
    assert "alerts.disk_free_min_gb" in body["evidence"]
    wait_for(lambda: any(e["type"] == "dispatch" and e["state"] == "disk_full" for e in _events(run_dir)), 30,
             "dispatch state disk_full", sup)
    assert ctl(run_dir, "stop").returncode == 0
    assert sup.wait(60) == 0, sup.log_text()[-3000:]
    bodies = r.bodies()
    assert len(_alerts(bodies)) == 1, bodies
    assert bodies[-1]["kind"] == "run_end" and bodies[-1]["text"].startswith("run stopped at ")


def test_unreachable_webhook_is_alerted_in_telemetry_and_exit_is_bounded(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=10, gpus=1).model_copy(update=dict(
                              notify=notify_table(f"http://127.0.0.1:{closed_port()}/hook")))
    sup = SupervisorProc(run_dir).start(cfg)
    try:
        assert sup.wait(120) == 0, sup.log_text()[-3000:]
    finally:
        sup.cleanup()
    failed = [e for e in events(run_dir) if e["type"] == "alert" and e["key"] == "notify.failed"]
    assert len(failed) == 1 and failed[0]["severity"] == "error"
    assert failed[0]["text"].startswith("notification not delivered: regen: run done")
    assert "3 tries: ClientConnectorError" in failed[0]["text"]
    assert "notification not delivered to webhook http://127.0.0.1:" in sup.log_text()


def test_supervisor_death_is_one_notification_with_its_cause(tmp_path, tiny_model_dir, supervisors, receiver):
    r = receiver()
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, tiny_model_dir, prompts=10, gpus=1)
    missing = tmp_path / "moved" / "chat.jsonl"  # the prompts are not where the config says
    cfg = cfg.model_copy(update=dict(prompts=(str(missing),), notify=notify_table(r.url())))
    sup = supervisors(run_dir).start(cfg)
    assert sup.wait(120) == 5, sup.log_text()[-3000:]  # 5: prompts or tokenizer unreadable
    bodies = r.bodies()
    assert [b["kind"] for b in bodies] == ["fatal"], bodies  # the failed run end that follows is not sent again
    (body,) = bodies
    assert body["severity"] == "critical" and body["run_dir"] == str(run_dir)
    assert body["title"].startswith(f"regen: supervisor died: PromptFileError: prompt file {missing}")
    assert "No such file or directory" in body["text"] and "remedy: " in body["text"]
    assert f"path: {missing}" in body["evidence"] and "phase: start" in body["evidence"]
