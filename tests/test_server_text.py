"""The shards' `text` is decode(output_ids) whether it is SGLang's own /generate `text` (taken when its
byte count is the ids') or decoded by the engine; a server text that is not its ids' is decoded here
instead, with one alert per worker."""
from __future__ import annotations

import random
from array import array
from types import SimpleNamespace

import orjson
import pytest

from engine.config.load import RunConfig
from engine.text.render import Renderer
from engine.run.dispatch.loop import Dispatcher
from engine.run.items import Generated
from tests.test_dispatcher_requeue import make_item


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return Renderer(str(tiny_model_dir), enable_thinking=True)


def decoded(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=False)


ANSWERS = ["<think>\nstep é ü 中文 🙂\n</think>\n\nDone.<|im_end|>", "<think>\n\n</think>\n\nOK.<|im_end|>",
           "plain answer, no think block", "<think>\nunclosed reasoning", ""]


def test_the_server_text_whole_or_without_its_stop_token_is_taken(renderer, tiny_tokenizer):
    for answer in ANSWERS:
        ids = tiny_tokenizer(answer, add_special_tokens=False).input_ids
        want = decoded(tiny_tokenizer, ids)
        assert renderer.answer_text(array("i", ids), want) == (want, False)
        if ids and ids[-1] in renderer.eos_ids:  # SGLang cuts the matched stop token from its text
            trimmed = decoded(tiny_tokenizer, ids[:-1])
            assert renderer.answer_text(array("i", ids), trimmed) == (want, False)


def test_a_text_that_is_not_the_ids_is_decoded_here_and_reported(renderer, tiny_tokenizer):
    ids = tiny_tokenizer(ANSWERS[1], add_special_tokens=False).input_ids
    want = decoded(tiny_tokenizer, ids)
    for other in (want[:-1], want + "x", want.replace("<think>", ""), "", "Done.", want.replace("OK", "ok!")):
        assert renderer.answer_text(array("i", ids), other) == (want, True), other
    # a character split over ids: only a decode tells the text, so nothing to report either way
    split = tiny_tokenizer(ANSWERS[0], add_special_tokens=False).input_ids
    assert renderer.answer_text(array("i", split), "something else") == (decoded(tiny_tokenizer, split), False)
    # a trimmed text is only taken when the last id is a stop token: an eos, or the one SGLang says it matched
    no_eos = ids[:-1]
    assert renderer.answer_text(array("i", no_eos), decoded(tiny_tokenizer, no_eos[:-1])) == (
        decoded(tiny_tokenizer, no_eos), True)
    assert renderer.answer_text(array("i", no_eos), decoded(tiny_tokenizer, no_eos[:-1]), no_eos[-1]) == (
        decoded(tiny_tokenizer, no_eos), False)


def test_no_server_text_or_broken_utf8_is_decoded_here_without_a_report(renderer, tiny_tokenizer):
    ids = tiny_tokenizer("中文🙂", add_special_tokens=False).input_ids
    for part in [ids[:k] for k in range(len(ids) + 1)] + [ids[k:] for k in range(len(ids))] + [ids[::-1]]:
        want = decoded(tiny_tokenizer, part)
        text, refused = renderer.answer_text(array("i", part), want)
        assert text == want and not refused
        assert renderer.answer_text(array("i", part), None) == (want, False)
        if "\ufffd" in want:  # the server replaced broken bytes: how, only a decode here says
            assert renderer.answer_text(array("i", part), want.replace("\ufffd", "?")) == (want, False)


def test_ids_outside_the_table_are_decoded_by_the_tokenizer(renderer, tiny_tokenizer):
    size = tiny_tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    ids = [5, size + 10, 6]
    want = decoded(tiny_tokenizer, ids)
    assert renderer.answer_text(array("i", ids), want)[0] == want
    assert renderer._byte_table.adopt("x", array("i", [-1]), trimmed_last=True) is None


def test_random_answers_agree_with_the_tokenizer(renderer, tiny_tokenizer):
    rng = random.Random(11)
    size = tiny_tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    for _ in range(300):
        ids = [rng.randrange(size) for _ in range(rng.randint(0, 300))] + [renderer.eos_ids[0]]
        want = decoded(tiny_tokenizer, ids)
        for server in (want, decoded(tiny_tokenizer, ids[:-1])):
            assert renderer.answer_text(array("i", ids), server)[0] == want


# -- through the dispatcher: the row the committer gets, the alert the operator sees --------------------
def reply(ids: list[int], text: str | None) -> bytes:
    body = {"output_ids": ids, "meta_info": {"id": "x", "finish_reason": {"type": "stop", "matched": ids[-1]},
                                            "prompt_tokens": 3, "completion_tokens": len(ids), "cached_tokens": 0}}
    if text is not None:
        body["text"] = text
    return orjson.dumps(body)


def make(renderer):
    rows: list[dict] = []  # the rows the store would get

    def deliver(outcome):
        assert isinstance(outcome, Generated), outcome
        rows.append(outcome.row.store_row())

    cfg = RunConfig(run_dir="/nonexistent", model="/nonexistent", prompts=("/nonexistent",))
    events: list[object] = []
    d = Dispatcher(cfg, queue=None, workers=[], deliver=deliver, renderer=renderer, session=None, emit=events.append)
    return d, rows, events


@pytest.mark.parametrize("workers", [1, 2])
def test_the_dispatcher_stores_the_ids_text_and_alerts_once_per_worker(renderer, tiny_tokenizer, workers):
    d, rows, events = make(renderer)
    ids = tiny_tokenizer(ANSWERS[1], add_special_tokens=False).input_ids
    want = decoded(tiny_tokenizer, ids)
    bodies = [reply(ids, want), reply(ids, decoded(tiny_tokenizer, ids[:-1])), reply(ids, None),
              reply(ids, "not this answer"), reply(ids, "nor this one")]
    for k, body in enumerate(bodies):
        for n in range(workers):
            w = SimpleNamespace(name=f"gpu{n}")
            d.answers.handle_ok(w, make_item(f"c{k}#turn0", [1, 2, 3]), body, 0.1)
    assert [r["text"] for r in rows] == [want] * len(bodies) * workers
    alerts = [e for e in events if getattr(e, "key", "").startswith("text-mismatch")]
    assert [a.key for a in alerts] == [f"text-mismatch:gpu{n}" for n in range(workers)]
    assert alerts[0].severity == "warning"
    assert alerts[0].text == "gpu0: /generate text does not match output_ids; decoding them here"
    assert alerts[0].evidence.startswith("c3#turn0: ")
