"""Each answer of /generate made into exactly one outcome (engine.run.items): a row, a retry, a failure or a rejection.

Retry policy: a failed request is retried with backoff up to dispatch.max_retries; its server pulls nothing for
FAULT_PAUSE_S, doubling while it goes on failing (a dead scheduler answers at once); a router's 503 "No available
workers" and a request moved off a server's queue unrun are re-queued without counting an attempt.
"""
from __future__ import annotations

import logging
import time
from array import array
from typing import Any, Callable, cast

import orjson

from engine.api.events import AlertEvent, Event
from engine.api.wire import FinishReason, Severity
from engine.config.load import RunConfig
from engine.run import reply_json
from engine.run.answer_stream import AnswerStream, int32_array
from engine.run.dispatch.client import Answer, error_message, no_servers
from engine.run.dispatch.pauses import PullPauses
from engine.run.dispatch.stranded import StrandedMover
from engine.run.items import Failed, Generated, Outcome, Rejected, Retry, SampleRow, WorkItem
from engine.run.request_size import RequestSize
from engine.run.runaway import Repetition
from engine.servers.target import DispatchTarget
from engine.store.names import REPETITION
from engine.text.render import Renderer

log = logging.getLogger("regen.dispatch")

DUPLICATE_RID = "Duplicate request ID"  # SGLang 0.5.10+ refuses a rid that is already running
FAULT_PAUSE_S = 0.25  # a server's first failed request stops its pulls this long; each further one in a row doubles it
UNROUTED_PAUSE_S = 0.2  # a router with no server takes no new work this long, doubling while it answers so, at most 2 s
UNROUTED_MAX_PAUSE_S = 2.0
UNROUTED_ALERT_AFTER = 20  # answered so this many times in a row (tens of seconds): an alert, once per run of them


class Answers:
    """Turns what came back into outcomes handed to `deliver`. `stopping`: the run ends, so answers that come back
    aborted or failed are not retried (the next run regenerates them)."""

    def __init__(self, cfg: RunConfig, renderer: Renderer, deliver: Callable[[Outcome], None],
                 emit: Callable[[Event], None], request_size: RequestSize, stranded: StrandedMover,
                 pauses: PullPauses):
        self.cfg = cfg
        self.renderer = renderer
        self.deliver = deliver
        self.emit = emit
        self.request_size = request_size
        self.stranded = stranded
        self.pauses = pauses
        self.stopping = False
        self.retried = 0  # attempts re-queued (no outcome of a sample: the ledger never sees it)
        self.stopped_runaways = 0  # answers the guard stopped in this run (their outcome is their committed row)
        self.unrouted = 0  # requests a router answered 503 "No available workers" (re-queued, not attempts)
        self._faults: dict[str, int] = {}  # per worker: requests failed in a row by the server (reset by an answer)
        self._unrouted_run: dict[str, int] = {}  # per router target: such answers in a row (reset by an answer)
        self._mismatch_alerted: set[str] = set()
        self._text_alerted: set[str] = set()
        self._cumulative_noted: set[str] = set()  # workers seen streaming every id so far in each chunk

    def unsent(self, w: DispatchTarget, item: WorkItem, exc: BaseException) -> None:
        """No answer came (a broken connection, a timeout): a fault of the server's."""
        if self.stopping:
            return
        item.last_error = f"{w.name}: {type(exc).__name__}: {exc}" if str(exc) else f"{w.name}: {type(exc).__name__}"
        self._server_fault(w)
        self.retry_or_fail(item)

    def settle(self, w: DispatchTarget, item: WorkItem, status: int, body: Answer, latency: float) -> None:
        if isinstance(body, AnswerStream):  # only a 200 streams (SGLangClient._read_stream)
            self._handle_stream(w, item, body, latency)
        elif status == 200:
            self.handle_ok(w, item, body, latency)
        elif status == 400 and DUPLICATE_RID in (message := error_message(body)):
            self.duplicate_rid(w, item, f"HTTP 400: {message}", message)
        elif status == 400:
            self.deliver(Rejected(item, f"rejected by SGLang (HTTP 400): {message}",
                                  excerpt=f"prompt_len={len(item.prompt_ids)} max_new_tokens={item.max_new_tokens}"))
        elif status == 503 and w.is_router and no_servers(body):
            if self.stopping:
                return
            self._unrouted(w, item, error_message(body))
        else:
            if self.stopping:
                return
            item.last_error = f"{w.name}: HTTP {status}: {error_message(body)}"
            self._server_fault(w)
            self.retry_or_fail(item)

    def duplicate_rid(self, w: DispatchTarget, item: WorkItem, error: str, message: str) -> None:
        """SGLang refused a rid it is still running: the sample itself is fine, so it is re-queued, never rejected."""
        if self.stopping:
            return
        self.emit(AlertEvent(severity=Severity.ERROR, text=f"{w.name} refused a duplicate request id; re-queued",
                             evidence=f"{item.rid}: {message}", key=f"duplicate-rid:{w.name}"))
        item.last_error = f"{w.name}: {error}"
        self.retry_or_fail(item)

    def handle_ok(self, w: DispatchTarget, item: WorkItem, body: bytes, latency: float) -> None:
        try:
            data = reply_json.loads(body)  # output_ids as array("i") when long (reply_json says why)
            if isinstance(data, list):
                data = data[0]
            output_ids = data["output_ids"]
            if type(output_ids) is array:
                ids32 = output_ids  # every id checked an int32 already
            elif isinstance(output_ids, list):
                ids32 = int32_array(output_ids)  # every id an int32, checked at C speed (TypeError / OverflowError)
            else:
                raise TypeError(f"output_ids is {type(output_ids).__name__}, not a list")
            meta = data.get("meta_info") or {}
            finish = meta.get("finish_reason") or {}
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
            item.last_error = f"{w.name}: unreadable /generate reply ({type(exc).__name__}: {exc}): {body[:200]!r}"
            self.retry_or_fail(item)
            return
        self._answered(w, item, ids32, meta, finish, data.get("text"), latency)

    def _handle_stream(self, w: DispatchTarget, item: WorkItem, answer: AnswerStream, latency: float) -> None:
        """A streamed answer: as a non-streamed one once it ended with its final chunk; an error event as the HTTP
        400 it stands for (a ValueError of SGLang's); a runaway the guard stopped, with every id delivered."""
        if answer.cumulative_ids and w.name not in self._cumulative_noted:
            self._cumulative_noted.add(w.name)
            self.emit(AlertEvent(
                severity=Severity.INFO, text=f"{w.name} streams every id so far in each chunk (no delta streaming): read "
                "exactly, at a client CPU cost growing with the square of an answer's length",
                evidence=f"{item.rid}: {answer.chunks} chunks, {len(answer.ids)} ids; SGLang 0.5.10+ streams deltas "
                "when launched with --incremental-streaming-output (0.5.5: --stream-output), which regen adds when "
                "it can read the server's version (workers/<name>/server.log shows the launch line)",
                key=f"cumulative-stream:{w.name}"))
        if answer.verdict is not None:
            self.stopped_runaways += 1
            self._answered(w, item, answer.ids, answer.meta, answer.finish or {}, answer.text, latency,
                           verdict=answer.verdict)
        elif answer.error is not None and not answer.ids:
            self._refused(w, item, answer.error)
        elif answer.error is not None:
            if self.stopping:
                return
            item.last_error = f"{w.name}: stream error after {len(answer.ids)} ids: {answer.error}"
            self.retry_or_fail(item)
        elif answer.finish is None:
            if self.stopping:
                return
            item.last_error = (f"{w.name}: the stream ended without a final chunk ({answer.chunks} chunks, "
                               f"{len(answer.ids)} ids, [DONE] {'seen' if answer.done else 'missing'})")
            self.retry_or_fail(item)
        else:
            self._answered(w, item, answer.ids, answer.meta, answer.finish, answer.text, latency)

    def _refused(self, w: DispatchTarget, item: WorkItem, message: str) -> None:
        """An error event before any id, in a 200 stream: SGLang's HTTP 400 of a non-streamed request (its
        validation's ValueError, contract 2.4)."""
        if DUPLICATE_RID in message:
            self.duplicate_rid(w, item, f"stream error: {message}", message)
            return
        self.deliver(Rejected(item, f"rejected by SGLang (stream error event): {message}",
                              excerpt=f"prompt_len={len(item.prompt_ids)} max_new_tokens={item.max_new_tokens}"))

    def _answered(self, w: DispatchTarget, item: WorkItem, ids32: array[int], meta: dict[str, Any], finish: object,
                  server_text: object, latency: float, verdict: Repetition | None = None) -> None:
        finish_type = finish.get("type") if isinstance(finish, dict) else str(finish)
        if finish_type == FinishReason.ABORT and verdict is None:
            if self.stopping:
                return
            moving = self.stranded.was_moving(item.rid)
            if moving and not len(ids32):
                # moved off this server's queue unrun: once, by its rid, not a fault (no attempt counted)
                self.stranded.moved += 1
                log.info("%s: %s moved off its queue (%s): re-queued for any server", w.name, item.rid,
                         finish.get("message", "") if isinstance(finish, dict) else finish)
                self.deliver(Retry(item, 0.0))
                return
            item.last_error = f"{w.name}: aborted: {finish.get('message', '') if isinstance(finish, dict) else finish}"
            self.retry_or_fail(item, immediate=moving)  # moving, it had started: retried at once
            return
        self._faults.pop(w.name, None)
        self._unrouted_run.pop(w.name, None)
        completion = meta.get("completion_tokens")
        n = len(ids32)
        self.request_size.answered(n)
        if verdict is not None and finish_type is None:
            completion = n  # the stream broke off after the stop: the ids delivered are the answer
        if completion != n and w.name not in self._mismatch_alerted:
            self._mismatch_alerted.add(w.name)
            self.emit(AlertEvent(
                severity=Severity.WARNING, text=f"{w.name}: meta_info.completion_tokens != len(output_ids)",
                evidence=f"{item.sample_id}: completion_tokens={completion}, len(output_ids)={n}",
                key=f"completion-mismatch:{w.name}"))
        matched = finish.get("matched") if isinstance(finish, dict) else None
        text, refused = self.renderer.answer_text(ids32, server_text, matched)
        if refused and w.name not in self._text_alerted:
            self._text_alerted.add(w.name)
            self.emit(AlertEvent(
                severity=Severity.WARNING, text=f"{w.name}: /generate text does not match output_ids; decoding them here",
                # refused: a server text was there (answer_text judges only a str)
                evidence=f"{item.sample_id}: {n} ids, server text {len(cast(str, server_text))} chars",
                key=f"text-mismatch:{w.name}"))
        row = SampleRow(
            sample_id=item.sample_id, conversation_id=item.conv.conversation_id, turn=item.turn,
            source=item.conv.source, origin=item.conv.origin, prompt_ids=item.prompt_ids, output_ids=ids32,
            reasoning_tokens=self.renderer.reasoning_tokens(ids32, item.prompt_opened),
            prompt_opened=item.prompt_opened,
            finish_reason=REPETITION if verdict is not None else (finish_type or "unknown"),
            completion_tokens=int(completion) if isinstance(completion, int) else n,
            cached_tokens=int(meta.get("cached_tokens") or 0), latency_s=float(latency), worker=w.name, text=text)
        item.served_by = w.name
        answer = None
        if self.cfg.turns == "all" and not item.is_last_turn:
            answer = self.renderer.history_answer(ids32, item.prompt_opened)
        self.deliver(Generated(item, row, answer))

    def _unrouted(self, w: DispatchTarget, item: WorkItem, message: str) -> None:
        """The router answered 503 "No available workers": the request reached no server, so it is no attempt of the
        sample (not in `retried`, no backoff of its own): it goes back to the front of regen's queue as it was. The
        router's list of servers is read again now (the endpoint is ready only while the router lists one), and the
        router takes no new work for a moment, doubling while it goes on answering so (each pull would be answered
        the same at once). Said in the log once per run of such answers, and alerted if it lasts."""
        self.unrouted += 1
        n = self._unrouted_run[w.name] = self._unrouted_run.get(w.name, 0) + 1
        self.pauses.extend(w.name, time.monotonic() + min(UNROUTED_MAX_PAUSE_S, UNROUTED_PAUSE_S * 2 ** min(n - 1, 8)))
        if n == 1:
            log.warning("%s had no server to route %s to (HTTP 503: %s): re-queued (not an attempt); the router's "
                        "list of servers is read again", w.name, item.sample_id, message)
        if n == UNROUTED_ALERT_AFTER:
            self.emit(AlertEvent(
                severity=Severity.ERROR, text=f"{w.name} has answered {n} requests in a row with 503 \"No available "
                "workers\" although it lists servers: nothing reaches them", evidence=f"{item.sample_id}: {message}; "
                f"see the router's own list (GET {w.url}/workers) and its log", key=f"router-no-servers:{w.name}"))
        w.no_servers()
        self.deliver(Retry(item, 0.0))

    def _server_fault(self, w: DispatchTarget) -> None:
        """The server failed a request: its loop pulls nothing for FAULT_PAUSE_S, doubled for each failure in a row,
        at most dispatch.retry_backoff_s."""
        n = self._faults[w.name] = self._faults.get(w.name, 0) + 1
        pause = min(self.cfg.dispatch.retry_backoff_s, FAULT_PAUSE_S * 2 ** min(n - 1, 16))
        if pause > 0:
            self.pauses.extend(w.name, time.monotonic() + pause)

    def retry_or_fail(self, item: WorkItem, immediate: bool = False) -> None:
        item.attempt += 1
        if item.attempt > self.cfg.dispatch.max_retries:
            log.warning("%s failed after %d attempts: %s", item.sample_id, item.attempt, item.last_error)
            self.deliver(Failed(item, f"generation failed after {item.attempt} attempts", excerpt=item.last_error))
            return
        self.retried += 1
        log.info("retry %d of %s: %s", item.attempt, item.sample_id, item.last_error)
        delay = 0.0 if immediate else min(60.0, self.cfg.dispatch.retry_backoff_s * 2 ** (item.attempt - 1))
        self.deliver(Retry(item, delay))
