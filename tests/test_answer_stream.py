"""Reading streamed /generate answers exactly (cumulative or new ids, cut anywhere), and what the dispatcher makes
of a stream: a stopped runaway committed, its abort never retried, error events, streams that break off."""
from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from engine.config.load import Runaway
from engine.http_client import client_session
from engine.run.answer_stream import AnswerStream, StreamError
from engine.run.items import Generated, Rejected, Retry
from engine.run.runaway import RunawayDetector
from tests.test_dispatcher_requeue import make_dispatcher, make_item

pytestmark = pytest.mark.timeout(60)


def events(ids: list[int], step: int, *, cumulative: bool, final: dict, text_cumulative: bool | None = None,
           total: bool = True, dumps=lambda chunk: json.dumps(chunk).encode()) -> bytes:
    """SGLang's SSE body for an answer of `ids`, a chunk every `step` ids, the last one with `final`."""
    text_cumulative = cumulative if text_cumulative is None else text_cumulative
    out, sent = [], 0
    cuts = list(range(step, len(ids), step)) + [len(ids)]
    for n in cuts:
        last = n == len(ids)
        meta = {"id": "r", "finish_reason": final if last else None}
        if total:
            meta["completion_tokens"] = n
        text = "".join(f"<{t}>" for t in (ids[:n] if text_cumulative else ids[sent:n]))
        chunk = {"text": text, "output_ids": ids[:n] if cumulative else ids[sent:n], "meta_info": meta}
        out.append(b"data: " + dumps(chunk) + b"\n\n")
        sent = n
    return b"".join(out) + b"data: [DONE]\n\n"


def read(body: bytes, pieces: int, seed: int = 0, detector=None) -> AnswerStream:
    """Feed `body` cut at `pieces` random places (the network cuts events anywhere)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(body)), min(pieces, len(body) - 1)))
    a = AnswerStream(detector)
    for lo, hi in zip([0] + cuts, cuts + [len(body)]):
        a.feed(body[lo:hi])
    return a


STOP = {"type": "stop", "matched": 2}


@pytest.mark.parametrize("cumulative,text_cumulative", [(True, True), (False, False), (False, True)],
                         ids=["0.5.10+", "incremental", "0.5.5"])
@pytest.mark.parametrize("pieces", [0, 5, 400])
def test_ids_and_text_are_exact_whatever_the_version_and_the_cuts(cumulative, text_cumulative, pieces):
    ids = [random.Random(1).randrange(3, 1000) for _ in range(500)]
    a = read(events(ids, 37, cumulative=cumulative, final=STOP, text_cumulative=text_cumulative), pieces)
    assert a.ids.tolist() == ids and a.finish == STOP and a.done and a.verdict is None
    assert a.text == "".join(f"<{t}>" for t in ids)
    assert a.cumulative_ids is cumulative


def test_without_completion_tokens_the_kind_is_learned_from_the_ids():
    ids = list(range(10, 300))
    for cumulative in (True, False):
        a = read(events(ids, 50, cumulative=cumulative, final=STOP, total=False), 30)
        assert a.ids.tolist() == ids and a.cumulative_ids is cumulative


@pytest.mark.parametrize("total", [True, False])
def test_long_chunks_as_sglang_writes_them_read_the_same(total):
    """orjson's layout, as SGLang's: chunks of many ids are read into int32 without Python ints (reply_json)."""
    rng = random.Random(2)
    ids = [rng.randrange(0, 200_000) for _ in range(3000)]
    for cumulative in (True, False):
        a = read(events(ids, 1000, cumulative=cumulative, final=STOP, total=total, dumps=orjson.dumps), 40)
        assert a.ids.tolist() == ids and a.finish == STOP and a.cumulative_ids is cumulative
    body = events(ids, 1000, cumulative=True, final=STOP, dumps=orjson.dumps)
    changed = body.replace(orjson.dumps(ids[:1000])[1:-1], orjson.dumps(ids[:999] + [7])[1:-1], 1)
    with pytest.raises(StreamError, match="differ from the 1000 ids streamed before"):
        read(changed, 0)


def test_a_chunk_that_fits_no_kind_is_an_error_not_a_guess():
    good = b'data: {"output_ids": [1, 2], "text": "", "meta_info": {"completion_tokens": 2}}\n\n'
    with pytest.raises(StreamError, match="neither the new ids nor all of them"):
        read(good + b'data: {"output_ids": [3], "text": "", "meta_info": {"completion_tokens": 5}}\n\n', 0)
    with pytest.raises(StreamError, match="differ from the 2 ids streamed before"):
        read(good + b'data: {"output_ids": [1, 9, 3], "text": "", "meta_info": {"completion_tokens": 3}}\n\n', 0)
    with pytest.raises(StreamError, match="not JSON"):
        read(b"data: {oops\n\n", 0)


def test_an_error_event_and_a_stream_cut_before_its_end():
    a = read(b'data: {"error": {"message": "The input (9 tokens) is longer than the model\'s context length"}}\n\n'
             b"data: [DONE]\n\n", 3)
    assert a.error.startswith("The input (9 tokens)") and not a.ids and a.finish is None
    body = events(list(range(5, 400)), 20, cumulative=True, final=STOP)
    cut = read(body[: len(body) // 2], 7)  # the connection lost half-way: no final chunk, exact ids so far
    assert cut.finish is None and not cut.done
    assert cut.ids.tolist() == list(range(5, 5 + len(cut.ids)))


def test_every_cut_between_and_inside_the_blank_line_and_multi_line_events_read_the_same():
    """An event ends at its blank line, found newline by newline: a cut between its two newlines, a line break
    inside an event (SSE's multi-line data, a comment line) and a keep-alive comment read as one whole body."""
    ids = list(range(7, 60))
    body = (b": keep-alive\n\n" + events(ids[:20], 20, cumulative=False, final=STOP)[:-len(b"data: [DONE]\n\n")]
            .replace(b'"finish_reason": {"type": "stop", "matched": 2}', b'"finish_reason": null'))
    body += (b'data: {"output_ids": ' + json.dumps(ids[20:]).encode() + b',\ndata: "text": "",\n: a comment\n'
             b'data: "meta_info": {"completion_tokens": 53, "finish_reason": {"type": "stop", "matched": 2}}}\n\n'
             b"data: [DONE]\n\n")
    for cut in range(1, len(body)):
        a = AnswerStream(None)
        a.feed(body[:cut])
        a.feed(body[cut:])
        assert a.ids.tolist() == ids and a.finish == STOP and a.done, cut


def test_the_detector_fires_on_a_chunk_and_the_ids_after_it_are_kept():
    loop = list(range(100, 120)) * 200
    a = read(events(loop, 64, cumulative=True, final={"type": "abort", "message": "Aborted"}), 50,
             detector=RunawayDetector(Runaway()))
    assert a.verdict is not None and a.verdict.period == 20 and a.verdict.at <= 1024 + 64
    assert a.ids.tolist() == loop  # everything the server generated until the abort, not only up to the verdict


# --- the dispatcher on a streamed answer ------------------------------------------------------------------

class StreamingServer:
    """/generate streams `body`, optionally stopping after `cut` bytes (the connection dropped); /abort_request is
    recorded; `hold`: the stream waits for the abort before its final chunk, as a running SGLang request does."""

    def __init__(self, body: bytes, *, cut: int | None = None, hold: bytes | None = None):
        self.body, self.cut, self.hold = body, cut, hold
        self.aborts: list[dict] = []
        self.aborted = asyncio.Event()
        self.requests: list[dict] = []

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return f"http://127.0.0.1:{self.server.port}"

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        body = self.body if self.cut is None else self.body[: self.cut]
        for i in range(0, len(body), 300):
            await resp.write(body[i:i + 300])
        if self.hold is not None:
            await asyncio.wait_for(self.aborted.wait(), 10)
            await resp.write(self.hold)
        if self.cut is not None:
            request.transport.close()  # dropped mid-stream
            return resp
        await resp.write_eof()
        return resp

    async def abort(self, request: web.Request) -> web.Response:
        self.aborts.append(await request.json())
        self.aborted.set()
        return web.Response(status=200)

    async def close(self) -> None:
        await self.server.close()


async def run_one(server: StreamingServer, rid: str = "c1#turn0"):
    url = await server.start()
    session = client_session()
    d, w, _, events_ = make_dispatcher(session, url)
    outcomes: list[object] = []
    d.answers.deliver = outcomes.append
    d.answers.renderer = SimpleNamespace(answer_text=lambda ids, text, matched: ("t", False),
                                 reasoning_tokens=lambda ids, prompt_opened=False: 0)
    item = make_item(rid, [1, 2, 3])
    try:
        await d._send(w, item)
        await asyncio.gather(*d.client._aborts)
    finally:
        await d.close()
        await session.close()
        await server.close()
    return outcomes, item, events_, d


def _chunk(ids_all: list[int], n_before: int, final: dict | None) -> bytes:
    meta = {"finish_reason": final, "completion_tokens": len(ids_all)}
    return b"data: " + json.dumps({"text": "", "output_ids": ids_all, "meta_info": meta}).encode() + b"\n\n"


async def test_a_runaway_is_aborted_by_rid_and_committed_with_every_id_never_retried():
    loop = list(range(100, 107)) * 300  # 2,100 ids: the guard fires by 1,024 + a chunk
    streamed = b"".join(_chunk(loop[:n], 0, None) for n in range(64, len(loop), 64))
    after = loop + [100, 101, 102]  # what the server generated until the abort took effect
    final = _chunk(after, 0, {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
    server = StreamingServer(streamed, hold=final + b"data: [DONE]\n\n")
    outcomes, item, events_, d = await run_one(server)
    assert server.aborts == [{"rid": "c1#turn0"}]
    assert server.requests[0]["stream"] is True and server.requests[0]["sampling_params"]["stream_interval"] == 1024
    assert len(outcomes) == 1 and isinstance(outcomes[0], Generated)
    row = outcomes[0].row
    assert row.finish_reason == "repetition" and row.output_ids.tolist() == after
    assert row.completion_tokens == len(after) and item.attempt == 0 and d.retried == 0
    assert d.answers.stopped_runaways == 1
    # this server streams cumulative ids (SGLang 0.5.10+ without --incremental-streaming-output): read, and noted once
    assert [(e.severity, e.key) for e in events_] == [("info", "cumulative-stream:gpu0")]
    assert "streams every id so far in each chunk" in events_[0].text


async def test_a_runaway_whose_stream_then_breaks_off_keeps_what_was_delivered():
    loop = list(range(200, 213)) * 200
    body = b"".join(_chunk(loop[:n], 0, None) for n in range(64, len(loop), 64))
    server = StreamingServer(body, cut=len(body) - 5)
    outcomes, item, _, _ = await run_one(server)
    assert isinstance(outcomes[0], Generated) and outcomes[0].row.finish_reason == "repetition"
    ids = outcomes[0].row.output_ids.tolist()
    assert ids == loop[: len(ids)] and len(ids) >= 1024 and server.aborts


async def test_a_stream_cut_mid_way_without_a_verdict_is_retried():
    ids = [random.Random(2).randrange(3, 900) for _ in range(300)]
    body = events(ids, 40, cumulative=True, final=STOP)
    outcomes, item, _, _ = await run_one(StreamingServer(body, cut=len(body) // 2))
    assert isinstance(outcomes[0], Retry) and item.attempt == 1
    assert "ClientPayloadError" in item.last_error or "without a final chunk" in item.last_error


async def test_an_error_event_before_any_id_is_a_rejection_and_a_duplicate_rid_a_retry():
    bad = b'data: {"error": {"message": "The input (99 tokens) is longer than the model\'s context length"}}\n\n' \
          b"data: [DONE]\n\n"
    outcomes, _, _, _ = await run_one(StreamingServer(bad))
    assert isinstance(outcomes[0], Rejected) and "stream error event" in outcomes[0].reason
    dup = b'data: {"error": {"message": "Duplicate request ID(s) detected: c1#turn0"}}\n\ndata: [DONE]\n\n'
    outcomes, item, events_, _ = await run_one(StreamingServer(dup))
    assert isinstance(outcomes[0], Retry) and item.attempt == 1
    assert [e.key for e in events_] == ["duplicate-rid:gpu0"]
