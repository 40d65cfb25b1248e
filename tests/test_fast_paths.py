"""The faster per-answer helpers give exactly the results of the straightforward code they replace:
the shard store's empty-answer check, Renderer.reasoning_tokens, the bytes-table decode."""
from __future__ import annotations

import random
from array import array

import pytest

from engine.text.answer_shape import is_empty_answer
from engine.text.render import Renderer
from engine.store.part_table import is_empty


def test_empty_check_matches_is_empty_answer():
    rng = random.Random(7)
    pieces = ["<think>", "</think>", "\n", " ", "\t", "\u00a0", "\u2003", "OK", ".", "a", "word", "<|im_end|>",
              "<|endoftext|>", "!!", "x y z", "\x1c"]
    texts = ["", "<think>\n\n</think>\n\nOK.<|im_end|>", "</think>", "<think></think>", "<think> </think> a b c d"]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))) for _ in range(20000)]
    for text in texts:
        for opened in (False, True):
            assert is_empty(text, opened) == is_empty_answer(text, opened), (repr(text), opened)


def reference_reasoning_tokens(r: Renderer, output_ids, prompt_opened: bool) -> int:
    """The straightforward implementation (a copy of the ids, slices), kept as the reference."""
    ids = r.strip_eos(output_ids)
    if r.think_close_id is None and r.think_open_id is None:
        return 0
    start = 0 if prompt_opened else None
    if start is None and r.think_open_id is not None and r.think_open_id in ids:
        start = ids.index(r.think_open_id) + 1
    close = ids.index(r.think_close_id, start or 0) if r.think_close_id in ids[start or 0:] else None
    if start is None:
        return close if close is not None else 0
    return (close if close is not None else len(ids)) - start


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return Renderer(str(tiny_model_dir), enable_thinking=True)


def test_reasoning_tokens_matches_the_reference(renderer):
    rng = random.Random(3)
    special = [renderer.think_open_id, renderer.think_close_id, *renderer.eos_ids]
    for _ in range(5000):
        ids = [rng.choice(special) if rng.random() < 0.15 else rng.randrange(10, 200) for _ in range(rng.randint(0, 30))]
        for opens in (False, True):
            expected = reference_reasoning_tokens(renderer, ids, opens)
            assert renderer.reasoning_tokens(ids, opens) == expected, (ids, opens)
            # the dispatcher's form: the same ids as an int32 array too, searched in numpy
            assert renderer.reasoning_tokens(array("i", ids), opens) == expected, (ids, opens)


def test_table_decode_edges(renderer, tiny_tokenizer):
    renderer.decode([1, 2])  # builds the table
    table = renderer._byte_table
    assert table is not None
    vocab = len(table._table)
    for ids in ([], [5], [5, 6], [renderer.think_open_id], list(range(50))):
        assert renderer.decode(ids) == tiny_tokenizer.decode(ids, skip_special_tokens=False)
    assert table.decode([-1]) is None and table.decode([3, -2]) is None  # never wraps around the table
    assert table.decode([vocab]) is None and table.decode([1, vocab + 5]) is None
    # with the ids as an int32 array as well (the dispatcher's form): the same texts, the same refusals
    for ids in ([], [5], [5, 6], [renderer.think_open_id], list(range(50)), [-1], [3, -2], [vocab], [1, vocab + 5]):
        assert table.decode(array("i", ids)) == table.decode(ids)
        if min(ids, default=0) >= 0 and max(ids, default=0) < vocab:
            assert renderer.decode(array("i", ids)) == tiny_tokenizer.decode(ids, skip_special_tokens=False)


def test_int32_array_equals_array_and_refuses_the_same_values():
    from engine.run.answer_stream import int32_array

    rng = random.Random(5)
    for n in (0, 1, 2, 17, 4000):
        values = [rng.randrange(-2**31, 2**31) for _ in range(n)] + [0, 2**31 - 1, -2**31][: n]
        out = int32_array(values)
        assert type(out) is array and out.typecode == "i" and out == array("i", values)
    assert int32_array([True, 2]) == array("i", [True, 2])
    for bad in ([1, 2**31], [1, -2**31 - 1], [1.0], ["1"], [None], [1, [2]], [2**70]):
        with pytest.raises((TypeError, OverflowError)) as fast:
            int32_array(bad)
        with pytest.raises((TypeError, OverflowError)) as slow:
            array("i", bad)
        assert (type(fast.value), str(fast.value)) == (type(slow.value), str(slow.value))
