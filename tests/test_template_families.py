"""The two chat template families: Qwen3 (the model opens `<think>`) and Qwen3.5/3.6 style (the
generation prompt ends with `<think>\\n`): the tiny model's templates, the simulator continuing an
opened block, and the renderer's per-sample fact and multi-turn history."""
from __future__ import annotations

import asyncio

import pytest

from engine.text.answer_shape import is_empty_answer, think_state
from engine.text.ingest import Conversation
from engine.text.render import Renderer
from tests.sim_fixtures import start_sim  # noqa: F401  (fixture)
from tests.test_simulator import chat_prompt, post

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tok35(tiny35_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny35_model_dir))


# --- the tiny model's Qwen3.5-style template ------------------------------------------------------------
def test_qwen35_template_opens_the_block_and_drops_earlier_reasoning(tok35):
    history = [{"role": "user", "content": "q1"},
               {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nold answer"},
               {"role": "user", "content": " q2 "}]
    on = tok35.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert on == ("<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\nold answer<|im_end|>\n"
                  "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n<think>\n")
    off = tok35.apply_chat_template(history, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # an assistant turn after the last user message keeps its block, rebuilt from an answer that only closes it
    last = tok35.apply_chat_template(history[:1] + [{"role": "assistant", "content": "r\n</think>\n\nA"}],
                                     tokenize=False)
    assert last.endswith("<|im_start|>assistant\n<think>\nr\n</think>\n\nA<|im_end|>\n")


def test_build_tiny_model_rebuilds_a_dir_of_the_other_family(tmp_path):
    from transformers import AutoTokenizer

    from engine.text.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "m", template="qwen3")
    build_tiny_model(path, template="qwen3.5")
    text = AutoTokenizer.from_pretrained(str(path)).apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<think>\n")
    with pytest.raises(ValueError, match="must be one of qwen3, qwen3.5"):
        build_tiny_model(tmp_path / "n", template="llama")


# --- the simulator continues the prompt -------------------------------------------------------------------
def _think_ids(tok):
    return tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>"), tok.convert_tokens_to_ids("<|im_end|>")


async def _answers(sim, tok, n: int, **sampling) -> list[dict]:
    sampling = {"max_new_tokens": 4000, "skip_special_tokens": False, **sampling}

    async def one(i: int):
        ids = chat_prompt(tok, f"question {i}: what is {i} plus {i}?")
        status, out = await post(sim.url + "/generate", {"rid": f"r{i}", "input_ids": ids,
                                                          "sampling_params": sampling})
        assert status == 200, out
        return out

    return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.parametrize("instant", [False, True])
async def test_no_answer_opens_think_again_after_a_prompt_that_opened_it(start_sim, tiny35_model_dir, tok35, instant):
    sim = await start_sim(model_path=str(tiny35_model_dir), sim_output_mean=40, sim_output_sigma=0.3,
                          sim_empty_share=0.2, sim_seed=5, sim_instant=instant, sim_instant_pool=16)
    think, close, im_end = _think_ids(tok35)
    outs = await _answers(sim, tok35, 60)
    opened_again = [o for o in outs if think in o["output_ids"] or "<think>" in o["text"]]
    assert len(opened_again) == 0, f"{len(opened_again)} of {len(outs)} answers open <think> again"
    empty = [o for o in outs if o["text"] == "\n</think>\n\nOK."]  # the matched <|im_end|> is cut from text
    assert 0 < len(empty) < len(outs)
    for o in outs:
        ids, meta = o["output_ids"], o["meta_info"]
        assert meta["finish_reason"]["type"] == "stop" and ids[-1] == im_end
        assert ids.count(close) == 1 and "\n</think>\n\n" in o["text"]
        assert meta["reasoning_tokens"] == ids.index(close)  # from the first output token to </think>
        assert think_state(o["text"], prompt_opened=True) == "present"
        assert is_empty_answer(o["text"], prompt_opened=True) is (o in empty)


async def test_an_answer_cut_inside_a_prompt_opened_block_is_unterminated(start_sim, tiny35_model_dir, tok35):
    sim = await start_sim(model_path=str(tiny35_model_dir), sim_output_mean=500, sim_output_sigma=0.0)
    think, close, _ = _think_ids(tok35)
    (out,) = await _answers(sim, tok35, 1, max_new_tokens=12)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert think not in out["output_ids"] and close not in out["output_ids"]
    assert out["meta_info"]["reasoning_tokens"] == 12  # every token is inside the block the prompt opened
    assert think_state(out["text"], prompt_opened=True) == "unterminated"
    assert not is_empty_answer(out["text"], prompt_opened=True)


async def test_thinking_disabled_qwen35_prompt_gets_no_block(start_sim, tiny35_model_dir, tok35):
    sim = await start_sim(model_path=str(tiny35_model_dir), sim_empty_share=1.0)
    ids = chat_prompt(tok35, "Say hi", enable_thinking=False)
    _, out = await post(sim.url + "/generate", {"input_ids": ids, "sampling_params": {"skip_special_tokens": False}})
    assert out["text"] == "OK." and out["meta_info"]["reasoning_tokens"] == 0


async def test_qwen3_answers_still_open_the_block_themselves(start_sim, tiny_tokenizer):
    sim = await start_sim(sim_output_mean=40, sim_output_sigma=0.3, sim_empty_share=0.2, sim_seed=5)
    think, close, _ = _think_ids(tiny_tokenizer)
    outs = await _answers(sim, tiny_tokenizer, 20)
    assert all(o["output_ids"][0] == think and o["meta_info"]["reasoning_tokens"] == o["output_ids"].index(close) - 1
               for o in outs)


# --- the renderer: the fact per sample, and the history a later turn is built on ------------------------
@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_renderer_knows_whether_each_prompt_opened_the_block(family, tiny_model_dir, tiny35_model_dir):
    path = tiny_model_dir if family == "qwen3" else tiny35_model_dir
    on = Renderer(str(path), enable_thinking=True)
    off = Renderer(str(path), enable_thinking=False)
    msgs = [{"role": "user", "content": "hello"}]
    assert on.opens_think(on.prompt_ids(msgs)) is (family == "qwen3.5")
    assert off.opens_think(off.prompt_ids(msgs)) is False
    assert on.prompt_opens_think is (family == "qwen3.5")


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_next_turn_history_is_what_the_template_renders_from_the_regenerated_answer(
        family, tiny_model_dir, tiny35_model_dir):
    path = tiny_model_dir if family == "qwen3" else tiny35_model_dir
    r = Renderer(str(path), enable_thinking=True)
    tok = r.tokenizer
    conv = Conversation(conversation_id="c1", source="p.jsonl", origin="p.jsonl:1", index=0, messages=(
        {"role": "user", "content": "first question"}, {"role": "assistant", "content": "an old answer"},
        {"role": "user", "content": "second question"}))
    prompt0 = r.prompt_ids(r.build_messages(conv, 0, {}, "all"))
    opened = r.opens_think(prompt0)
    for body in ("careful reasoning\n</think>\n\nIt is four.", "reasoning cut by the length limit"):
        head = "" if opened else "<think>\n"
        output = tok.encode(head + body, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
        answer = r.history_answer(output, opened)
        got = r.prompt_ids(r.build_messages(conv, 1, {0: answer}, "all"))
        # the whole assistant turn as the model saw it: what its prompt opened, then its output
        turn_text = tok.decode(prompt0).rsplit("<|im_start|>assistant\n", 1)[1] + tok.decode(output[:-1])
        messages = [conv.messages[0], {"role": "assistant", "content": turn_text}, conv.messages[2]]
        want = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids
        assert got == want, family
        if "</think>" in body:  # reasoning of an earlier turn is dropped; the answer alone is the history
            assert "<|im_start|>assistant\nIt is four.<|im_end|>" in tok.decode(got)
