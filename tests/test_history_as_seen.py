"""Text exports write each earlier turn as the model saw it: re-rendering an exported row's history with the model's
own template gives the stored prompt ids back, on both template families, after cut, empty and normal turns."""
from __future__ import annotations

import json
import random

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.export.conversations import as_seen
from engine.text.ingest import Conversation
from engine.text.render import Renderer
from tests.history_fixtures import KINDS, answer_turns, answered_run
from tests.test_export import export

pytestmark = pytest.mark.timeout(120)

# the defect's shapes: turns cut inside their reasoning at max_new_tokens, followed by later turns
DEFECT = [["cut", "normal"], ["cut", "normal", "normal"], ["normal", "cut", "normal"], ["cut", "cut", "normal"],
          ["empty", "cut", "normal"], ["normal", "normal"]]


def _exported(out, fmt: str) -> list[tuple[str, list[dict]]]:
    """(sample id, history messages) of each exported row."""
    if fmt == "conversations-jsonl":
        rows = [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]
        return [(r["id"], r["conversations"][:-1]) for r in rows]
    if fmt == "messages-jsonl":
        rows = [json.loads(line) for line in (out / "messages.jsonl").read_text().splitlines()]
        return [(r["sample_id"], r["messages"][:-1]) for r in rows]
    rows = pq.read_table(sorted(out.glob("*.parquet"))).to_pylist()
    return [(r["id"], r["messages"][:-1]) for r in rows]


@pytest.mark.parametrize("fmt", ["conversations-jsonl", "messages-jsonl", "messages-parquet"])
def test_rows_after_a_cut_turn_re_render_to_the_stored_prompt(family_model_dir, tmp_path, fmt):
    run_dir, rows = answered_run(tmp_path, family_model_dir, DEFECT)
    renderer = Renderer(str(family_model_dir), enable_thinking=True)
    out = tmp_path / "out"
    export(run_dir, out, fmt, "--keep", "length,thinking,empty", "--min-supervised", "0")
    exported = _exported(out, fmt)
    assert {sid for sid, _ in exported} == set(rows), "every row is exported (cut and empty ones kept)"
    after_cut = 0
    for sid, history in exported:
        row = rows[sid]
        assert renderer.prompt_ids(history) == row["input_ids"][:row["prompt_len"]], (
            f"{sid}: the exported history renders to a prompt the model never saw")
        conv, turn = sid.split("#turn")
        earlier = [rows[f"{conv}#turn{k}"] for k in range(int(turn))]
        if any(r["finish_reason"] == "length" for r in earlier):
            after_cut += 1
            cut_history = [m for m in history if m["role"] == "assistant" and m["content"]]
            # the cut reasoning is there, raw: it is what the model was prompted with
            assert any(m["content"].startswith("<think>") and "</think>" not in m["content"] for m in cut_history)
    assert after_cut >= 6


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_conversation_re_renders_from_its_history_as_seen(family_model_dir, data):
    """Property: for random conversations of cut / empty / normal turns, every turn's history written as the
    export writes it renders to the prompt ids the engine sent."""
    renderer = _renderer(family_model_dir)
    kinds = data.draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=5), label="turn kinds")
    users = data.draw(st.lists(st.text(alphabet="ab \n?.", max_size=12), min_size=len(kinds), max_size=len(kinds)),
                      label="user messages")
    msgs: list[dict] = []
    for j, u in enumerate(users):
        if j:
            msgs.append({"role": "assistant", "content": "old"})
        msgs.append({"role": "user", "content": u})
    conv = Conversation("c", "chats.jsonl", "chats.jsonl:1", 0, tuple(msgs))
    rows = answer_turns(renderer, conv, kinds, random.Random(data.draw(st.integers(0, 10**6), label="seed")))
    end_tokens = [t for t in renderer.tokenizer.convert_ids_to_tokens(renderer.eos_ids) if t]
    seen = {r["turn"]: as_seen(renderer, end_tokens, r["text"], r["prompt_opened"]) for r in rows}
    for r in rows:
        history = renderer.build_messages(conv, r["turn"], seen, "all")
        assert renderer.prompt_ids(history) == r["input_ids"][:r["prompt_len"]], (kinds, r["turn"], history)


_RENDERERS: dict[str, Renderer] = {}


def _renderer(model_dir) -> Renderer:
    key = str(model_dir)
    if key not in _RENDERERS:
        _RENDERERS[key] = Renderer(key, enable_thinking=True)
    return _RENDERERS[key]
