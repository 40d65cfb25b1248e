"""The bytes-table decode (engine.text.bytelevel_decode) gives exactly the tokenizer's own decode text."""
from __future__ import annotations

import json
import random

import pytest

from engine.text.bytelevel_decode import ByteTableDecoder
from engine.text.render import Renderer


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return Renderer(str(tiny_model_dir), enable_thinking=True)


def test_table_is_used_for_the_byte_level_tokenizer(renderer):
    renderer.decode([1, 2, 3])
    assert renderer._byte_table is not None


def test_random_sequences_decode_like_transformers(renderer, tiny_tokenizer):
    rng = random.Random(7)
    size = tiny_tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    for _ in range(500):
        ids = [rng.randrange(size) for _ in range(rng.randint(0, 400))]
        assert renderer.decode(ids) == tiny_tokenizer.decode(ids, skip_special_tokens=False)


def test_special_tokens_and_answer_shapes(renderer, tiny_tokenizer):
    for text in ("<think>\n\n</think>\n\nOK.<|im_end|>", "<think>\nstep é ü 中文 🙂\n</think>\n\nDone.<|im_end|>",
                 "<|im_start|>assistant\n<think>", ""):
        ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
        assert renderer.decode(ids) == tiny_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_broken_utf8_is_replaced_like_the_rust_decoder(renderer, tiny_tokenizer):
    ids = tiny_tokenizer("中文🙂", add_special_tokens=False).input_ids
    pieces = [ids[: k] for k in range(len(ids) + 1)] + [ids[k:] for k in range(len(ids))] + [ids[::-1]]
    for part in pieces:
        assert renderer.decode(part) == tiny_tokenizer.decode(part, skip_special_tokens=False)


def test_ids_outside_the_vocabulary_fall_back_to_the_tokenizer(renderer, tiny_tokenizer):
    size = tiny_tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    ids = [5, size + 10, 6]
    assert renderer.decode(ids) == tiny_tokenizer.decode(ids, skip_special_tokens=False)
    assert renderer._byte_table.decode([-1]) is None


def test_other_decoders_are_not_table_decoded(tiny_tokenizer):
    from tokenizers import Tokenizer

    spec = json.loads(tiny_tokenizer.backend_tokenizer.to_str())
    spec["decoder"] = {"type": "Fuse"}
    other = Tokenizer.from_str(json.dumps(spec))
    assert ByteTableDecoder.build(other) is None
