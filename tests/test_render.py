"""Renderer: prompt ids are the model's own chat template through transformers, turn by turn."""
from __future__ import annotations

import json

import pytest

from engine.text.ingest import Conversation
from engine.text.render import Renderer, RenderError, sample_id

CONV = Conversation(
    conversation_id="c1", source="src.jsonl", origin="src.jsonl:1", index=0,
    messages=(
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Dataset answer one."},
        {"role": "user", "content": "And times three?"},
        {"role": "assistant", "content": "Dataset answer two."},
        {"role": "user", "content": "Final question?"},
    ),
)
ANSWERS = {
    0: "<think>\nfirst reasoning here\n</think>\n\nIt is four.",
    1: "<think>\nsecond reasoning here\n</think>\n\nIt is twelve.",
}


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return Renderer(str(tiny_model_dir), enable_thinking=True)


def reference_ids(tok, messages, enable_thinking=True):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking)
    return tok(text, add_special_tokens=False).input_ids, text


def test_config_values_come_from_the_model_dir(renderer, tiny_tokenizer):
    assert renderer.context_length == 40960
    assert renderer.eos_ids == [tiny_tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                tiny_tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    assert renderer.think_open_id == tiny_tokenizer.convert_tokens_to_ids("<think>")


def test_context_length_argument_and_fallbacks(model_copy):
    assert Renderer(str(model_copy), enable_thinking=True, context_length=4096).context_length == 4096
    cfg = json.loads((model_copy / "config.json").read_text())
    del cfg["max_position_embeddings"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    (model_copy / "generation_config.json").unlink()
    r = Renderer(str(model_copy), enable_thinking=True)
    assert r.context_length == 40960  # tokenizer model_max_length
    assert r.eos_ids == [cfg["eos_token_id"]]  # config.json's, generation_config.json being gone


def test_missing_tokenizer_path_names_it(tmp_path):
    with pytest.raises(RenderError) as exc:
        Renderer(str(tmp_path / "no-model"), enable_thinking=True)
    assert str(tmp_path / "no-model") in str(exc.value) and "No such file or directory" in str(exc.value)


def test_model_dir_without_chat_template_is_refused(model_copy):
    (model_copy / "chat_template.jinja").unlink()
    with pytest.raises(RenderError) as exc:
        Renderer(str(model_copy), enable_thinking=True)
    assert str(model_copy) in str(exc.value) and "has no chat template" in str(exc.value)


def test_unparsable_config_json_is_named(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(RenderError) as exc:
        Renderer(str(model_copy), enable_thinking=True)
    # transformers reads config.json first; either way the message names the file and the problem
    assert str(model_copy / "config.json") in str(exc.value) and "valid JSON" in str(exc.value)


def test_user_turns_per_mode(renderer):
    assert renderer.user_turns(CONV, "all") == [0, 1, 2]
    assert renderer.user_turns(CONV, "last") == [2]
    assert renderer.user_turns(CONV, "first") == [0]
    with pytest.raises(ValueError):
        renderer.user_turns(CONV, "every")


def test_mode_all_uses_own_answers_and_template_drops_earlier_reasoning(renderer, tiny_tokenizer):
    messages = renderer.build_messages(CONV, 2, ANSWERS, "all")
    assert messages == [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": ANSWERS[0]},
        {"role": "user", "content": "And times three?"},
        {"role": "assistant", "content": ANSWERS[1]},
        {"role": "user", "content": "Final question?"},
    ]
    ids = renderer.prompt_ids(messages)
    expected, text = reference_ids(tiny_tokenizer, messages)
    assert ids == expected
    assert "It is four." in text and "It is twelve." in text
    assert "first reasoning" not in text and "second reasoning" not in text
    assert "Dataset answer" not in text
    assert text.endswith("<|im_start|>user\nFinal question?<|im_end|>\n<|im_start|>assistant\n")


def test_mode_all_first_turn_and_missing_answer(renderer, tiny_tokenizer):
    messages = renderer.build_messages(CONV, 0, {}, "all")
    assert messages == [CONV.messages[0], CONV.messages[1]]
    assert renderer.prompt_ids(messages) == reference_ids(tiny_tokenizer, messages)[0]
    with pytest.raises(KeyError) as exc:
        renderer.build_messages(CONV, 2, {0: "a"}, "all")
    assert "turn 1" in str(exc.value)


def test_mode_last_keeps_dataset_history(renderer, tiny_tokenizer):
    (turn,) = renderer.user_turns(CONV, "last")
    messages = renderer.build_messages(CONV, turn, {}, "last")
    assert messages == list(CONV.messages)
    ids = renderer.prompt_ids(messages)
    expected, text = reference_ids(tiny_tokenizer, messages)
    assert ids == expected and "Dataset answer two." in text


def test_prompt_ids_many_equals_one_by_one(renderer):
    batch = [renderer.build_messages(CONV, t, ANSWERS, "all") for t in renderer.user_turns(CONV, "all")]
    assert renderer.prompt_ids_many(batch) == [renderer.prompt_ids(m) for m in batch]
    assert renderer.prompt_ids_many([]) == []


def test_mode_first(renderer, tiny_tokenizer):
    (turn,) = renderer.user_turns(CONV, "first")
    messages = renderer.build_messages(CONV, turn, {}, "first")
    assert messages == list(CONV.messages[:2])
    assert renderer.prompt_ids(messages) == reference_ids(tiny_tokenizer, messages)[0]


def test_consecutive_user_messages_each_get_their_answer(renderer):
    conv = Conversation("c2", "s", "s:1", 0, (
        {"role": "user", "content": "u0"}, {"role": "user", "content": "u1"}, {"role": "user", "content": "u2"}))
    assert renderer.build_messages(conv, 2, {0: "a0", 1: "a1"}, "all") == [
        {"role": "user", "content": "u0"}, {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"}]


def test_enable_thinking_false_closes_the_think_block(tiny_model_dir, tiny_tokenizer):
    r = Renderer(str(tiny_model_dir), enable_thinking=False)
    messages = r.build_messages(CONV, 0, {}, "all")
    ids = r.prompt_ids(messages)
    expected, text = reference_ids(tiny_tokenizer, messages, enable_thinking=False)
    assert ids == expected
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert r.decode(ids) == text


def test_max_new_tokens_for_stays_inside_the_context(tiny_model_dir):
    r = Renderer(str(tiny_model_dir), enable_thinking=True, context_length=100)
    assert r.max_new_tokens_for([1] * 60, 40) == 39
    assert r.max_new_tokens_for([1] * 10, 40) == 40
    assert r.max_new_tokens_for([1] * 120, 40) == 0


def test_decode_history_answer_and_reasoning_tokens(renderer, tiny_tokenizer):
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    body = tiny_tokenizer("<think>\nlet me think\n</think>\n\nOK.", add_special_tokens=False).input_ids
    inner = tiny_tokenizer("\nlet me think\n", add_special_tokens=False).input_ids
    out = body + [im_end]
    assert renderer.decode(out) == "<think>\nlet me think\n</think>\n\nOK.<|im_end|>"
    assert renderer.history_answer(out) == "<think>\nlet me think\n</think>\n\nOK."
    assert renderer.reasoning_tokens(out) == len(inner)
    unclosed = tiny_tokenizer("<think>\nstill going", add_special_tokens=False).input_ids
    assert renderer.reasoning_tokens(unclosed) == len(unclosed) - 1
    assert renderer.reasoning_tokens(tiny_tokenizer("plain", add_special_tokens=False).input_ids) == 0


def test_sample_id():
    assert sample_id("conv-9", 2) == "conv-9#turn2"


def test_prompt_ids_many_fast_encode_equals_the_tokenizer_call(tiny_model_dir, tiny_tokenizer):
    """prompt_ids_many encodes through the Rust tokenizer directly (encode_batch_fast): the same ids as
    tokenizer(apply_chat_template(...), add_special_tokens=False) over varied conversations, thinking on
    and off; with truncation set on the backend it goes through the tokenizer call instead."""
    import random

    rng = random.Random(11)
    words = ["two", "plus", "<think>", "</think>", "<|im_end|>", "émoji 🙂", "\n\n", "  spaced  ", "中文", "x" * 40, "?"]

    def text():
        return " ".join(rng.choice(words) for _ in range(rng.randint(0, 30)))

    batch = []
    for k in range(60):
        msgs = [{"role": "system", "content": text()}] if k % 3 == 0 else []
        for _ in range(rng.randint(1, 3)):
            msgs.append({"role": "user", "content": text()})
            msgs.append({"role": "assistant", "content": rng.choice(list(ANSWERS.values())) if k % 2 else text()})
        msgs.append({"role": "user", "content": text()})
        batch.append(msgs)
    for thinking in (True, False):
        r = Renderer(str(tiny_model_dir), enable_thinking=thinking)
        assert r._backend_for_ids() is not None  # the fast path is the one tested here
        expected = [reference_ids(tiny_tokenizer, m, enable_thinking=thinking)[0] for m in batch]
        assert r.prompt_ids_many(batch) == expected
        r.tokenizer.backend_tokenizer.enable_truncation(8)
        assert r._backend_for_ids() is None
        assert r.prompt_ids_many(batch) == expected  # the tokenizer call turns the truncation off again
