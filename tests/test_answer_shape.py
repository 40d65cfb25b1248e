"""The empty-answer rule and think-block states shared by the shard store and the stats."""
import pytest

from engine.answer_shape import is_empty_answer, split_reasoning, think_state


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
