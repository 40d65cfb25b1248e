"""The empty-answer rule and think-block states shared by the shard store and the stats."""
import pytest

from engine.text.answer_shape import is_empty_answer, split_reasoning, think_state


@pytest.mark.parametrize("text, empty", [
    ("<think>\n\n</think>\n\nOK.<|im_end|>", True),  # the 87% failure
    ("<think>\n</think>\nYes, 4<|im_end|>", True),  # 3 visible tokens: Yes , 4
    ("<think>\n</think>\nYes it is.<|im_end|>", False),  # 4
    ("<think>\nreal reasoning\n</think>\n\nOK.<|im_end|>", False),
    ("OK.<|im_end|>", True),  # no think block at all (enable_thinking false)
    ("", True),
    ("<think>\n   \n", True),  # unterminated, whitespace only, nothing after
    ("<think>\nthinking until the length limit", False),
    ("reasoning opened by the prompt\n</think>\n\nOK.", False),
    ("\n</think>\n\n42<|im_end|><|endoftext|>", True),
])
def test_is_empty_answer(text, empty):
    assert is_empty_answer(text) is empty


def test_think_state():
    assert think_state("<think>\na\n</think>\n\nb") == "present"
    assert think_state("a\n</think>\n\nb") == "present"
    assert think_state("<think>\nstill going") == "unterminated"
    assert think_state("just an answer") == "missing"


def test_split_reasoning():
    assert split_reasoning("<think>\nr\n</think>\n\nA") == ("\nr\n", "\n\nA")
    assert split_reasoning("A") == ("", "A")


# --- both template families: Qwen3 (the model opens <think>) and Qwen3.5/3.6 style (the prompt opens it) ---
# (output text, prompt_opened, think_state, empty)
FAMILY_SHAPES = [
    # Qwen3: the output holds the whole block
    ("<think>\nreasoning\n</think>\n\nThe answer is four.<|im_end|>", False, "present", False),
    ("<think>\nreasoning cut by the length limit", False, "unterminated", False),
    ("The answer is four, no block at all.<|im_end|>", False, "missing", False),
    ("<think>\n\n</think>\n\nOK.<|im_end|>", False, "present", True),
    # Qwen3.5/3.6 style: the prompt ended with `<think>\n`, the output only closes the block
    ("reasoning\n</think>\n\nThe answer is four.<|im_end|>", True, "present", False),
    ("reasoning cut by the length limit", True, "unterminated", False),
    ("\n</think>\n\nOK.<|im_end|>", True, "present", True),
    ("   \n", True, "unterminated", True),  # whitespace only, nothing after: empty
    ("", True, "unterminated", True),
    ("OK.", True, "unterminated", False),  # inside the block: reasoning, not an answer
]


@pytest.mark.parametrize("text, opened, state, empty", FAMILY_SHAPES)
def test_answer_shape_on_both_template_families(text, opened, state, empty):
    assert think_state(text, opened) == state
    assert is_empty_answer(text, opened) is empty


def test_an_answer_cut_inside_a_prompt_opened_block_is_all_reasoning():
    assert split_reasoning("step one, step two", prompt_opened=True) == ("step one, step two", "")
    assert split_reasoning("step one\n</think>\n\nA", prompt_opened=True) == ("step one\n", "\n\nA")
    # without the fact, the same text is an answer with no reasoning (Qwen3 thinking off)
    assert split_reasoning("step one, step two") == ("", "step one, step two")
    assert think_state("step one, step two") == "missing"


def test_prompt_opens_think_reads_the_rendered_prompt_tail():
    from engine.text.answer_shape import prompt_opens_think

    assert prompt_opens_think("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking disabled
