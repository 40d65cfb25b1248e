"""The runaway detector on synthetic token cycles, near-loops, legitimate repetitive answers and cut streams."""
from __future__ import annotations

import random
from array import array

import pytest

from engine.config.load import ConfigError, Runaway, config_from_dict
from engine.run.runaway import RunawayDetector
from engine.text.tiny_model import corpus

CFG = Runaway()


def feed_all(ids: list[int], chunk: int, cfg: Runaway = CFG):
    """Stream `ids` into a detector `chunk` tokens at a time, as the dispatcher does; the verdict or None."""
    d = RunawayDetector(cfg)
    got = array("i")
    for start in range(0, len(ids), chunk):
        got.extend(ids[start:start + chunk])
        verdict = d.feed(got, start)
        if verdict is not None:
            return verdict
    return None


def noise(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 50_000) for _ in range(n)]


@pytest.mark.parametrize("period", [1, 7, 50, 300])
@pytest.mark.parametrize("prefix", [0, 200, 3000])
@pytest.mark.parametrize("chunk", [1, 64, 4096])
def test_a_token_cycle_is_stopped_once_it_covers_the_span(period, prefix, chunk):
    if chunk == 1 and (period == 300 or prefix == 3000):
        pytest.skip("token by token: covered by the short cases (slow in numpy)")
    cycle = noise(period, seed=period)
    ids = noise(prefix, seed=1) + cycle * (40_000 // period)
    verdict = feed_all(ids, chunk)
    assert verdict is not None and verdict.signal == "cycle"
    assert verdict.period == period
    need = max(CFG.min_span, CFG.min_repeats * period)
    # fires within one chunk of the first token where the cycle covers the span (and never before it)
    assert prefix + need <= verdict.at <= prefix + need + chunk + period
    assert verdict.span >= need
    assert "cycle repeated" in verdict.describe()


def test_the_verdict_does_not_depend_on_how_the_stream_was_cut():
    ids = noise(777, seed=3) + noise(37, seed=4) * 200
    points = {feed_all(ids, chunk).period for chunk in (1, 3, 17, 64, 1000, len(ids))}
    assert points == {37}
    ats = [feed_all(ids, chunk).at for chunk in (1, 3, 17)]
    assert max(ats) - min(ats) < 17


def test_a_stream_cut_before_the_span_is_not_stopped_and_its_state_goes_on():
    """A stream cut mid-way (the connection lost, the answer finished): what was seen is not a runaway; fed on
    from where it stopped, the same detector decides as one that saw it all."""
    ids = noise(500, seed=5) + noise(20, seed=6) * 100
    cut = 500 + CFG.min_span - 40
    d = RunawayDetector(CFG)
    got = array("i", ids[:cut])
    assert d.feed(got, 0) is None
    got.extend(ids[cut:])
    verdict = d.feed(got, cut)
    assert verdict is not None and verdict.period == 20 and verdict.at == len(ids)
    with pytest.raises(ValueError, match="fed from token 3"):
        RunawayDetector(CFG).feed(got, 3)


def test_a_loop_whose_cycles_differ_a_little_is_stopped_by_the_ngram_share():
    """A 300-token paragraph repeated with one token changed each time (a counter): no exact cycle, but nearly
    every n-gram of the window repeats."""
    para = noise(300, seed=7)
    ids = noise(1000, seed=8)
    for k in range(60):
        ids += para[:150] + [10 + k] + para[151:]
    verdict = feed_all(ids, 64)
    assert verdict is not None and verdict.signal == "ngram"
    assert verdict.share >= CFG.ngram_share
    assert verdict.at <= 1000 + CFG.ngram_window + 3 * CFG.check_every
    off = Runaway(ngram_share=1.0)
    assert feed_all(ids, 64, off) is None  # only the n-gram signal sees it


def test_random_text_never_fires():
    assert feed_all(noise(32_768, seed=9), 64) is None


def _first_cycle(ids: list[int], chunk: int, cfg: Runaway) -> tuple[int, int] | None:
    """The cycle signal by its definition, token by token: (the chunk end it fires at, the smallest period p whose
    last need = max(min_span, min_repeats x p) - p tokens each equal the token p before them)."""
    ends = sorted({e for start in range(0, len(ids), chunk)
                   for e in [*range(start + 1024, min(start + chunk, len(ids)), 1024), min(start + chunk, len(ids))]})
    for hi in ends:
        for p in range(1, cfg.max_period + 1):
            need = max(cfg.min_span, cfg.min_repeats * p) - p
            if hi - p >= need and ids[hi - need - p:hi - p] == ids[hi - need:hi]:
                return hi, p
    return None


@pytest.mark.parametrize("seed", range(6))
def test_the_cycle_signal_fires_where_its_definition_says(seed):
    """Random streams, some looping, over ids whose bytes match across token boundaries (0, 1, 256, 65536, ...) and
    over a wide vocabulary: the detector fires at the same chunk end on the same period as the definition, as an
    array or a list."""
    rng = random.Random(seed)
    cfg = Runaway(min_span=48, min_repeats=3, max_period=40, ngram_share=1.0)
    for case in range(60):
        vocab = [0, 1, 256, 257, 65536, 16_777_216, -1] if case % 2 else list(range(100, 50_000))
        ids = [rng.choice(vocab) for _ in range(rng.randrange(0, 300))]
        if case % 3:
            cycle = [rng.choice(vocab) for _ in range(rng.randrange(1, 50))]
            ids += (cycle * (400 // len(cycle) + 1))[:rng.randrange(1, 400)]
            ids += [rng.choice(vocab) for _ in range(rng.randrange(0, 50))]
        chunk = rng.choice([1, 5, 64, 2000])
        want = _first_cycle(ids, chunk, cfg)
        for as_list in (False, True):
            d, got, verdict = RunawayDetector(cfg), ([] if as_list else array("i")), None
            for start in range(0, len(ids), chunk):
                got.extend(ids[start:start + chunk])
                if (verdict := d.feed(got, start)) is not None:
                    break
            assert (None if verdict is None else (verdict.at, verdict.period)) == want, (seed, case, chunk)


# --- legitimate long answers with repeated structure (the tiny tokenizer's ids) -------------------------------

def _words(seed: int) -> list[str]:
    return [w.strip(".,").lower() for s in corpus(400, seed=seed) for w in s.split() if w.isalpha()]


def numbered_list(n: int = 500) -> str:
    sentences = corpus(n, seed=11)
    return "Here are the steps:\n\n" + "".join(f"{i}. **Step {i}**: {s}\n" for i, s in enumerate(sentences, 1))


def same_item_list(n: int = 500) -> str:
    """The hardest list: every item the same text, only its number changes."""
    return "".join(f"{i}. Check the value and write it down.\n" for i in range(1, n + 1))


def markdown_table(rows: int = 300) -> str:
    rng = random.Random(12)
    words = _words(12)
    head = "| name | score | passed | date | note |\n|---|---|---|---|---|\n"
    return head + "".join(
        f"| {rng.choice(words)} | {rng.randint(0, 100)}.{rng.randint(0, 9)} | {rng.choice(['yes', 'no'])} | "
        f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} | {rng.choice(words)} {rng.choice(words)} |\n"
        for _ in range(rows))


def code_blocks(n: int = 120) -> str:
    words = _words(13)
    out = ["```python\nclass Record:\n"]
    for i in range(n):
        name = f"{words[i % len(words)]}_{i}"
        out.append(f"    @property\n    def {name}(self) -> int:\n        \"\"\"The {name} field.\"\"\"\n"
                   f"        return self._data[\"{name}\"]\n\n")
    out.append("```\n")
    return "".join(out)


def multiplication_table(upto: int = 80) -> str:
    return "".join(f"{a} x {b} = {a * b}\n" for a in range(1, upto + 1) for b in range(1, 13))


def matrix_rows(n: int = 60) -> str:
    """Math with repeated structure: an identity matrix in LaTeX, one row per line."""
    return "\\begin{pmatrix}\n" + "".join(
        " & ".join("1" if j == i else "0" for j in range(n)) + " \\\\\n" for i in range(n)) + "\\end{pmatrix}\n"


@pytest.mark.parametrize("make", [numbered_list, same_item_list, markdown_table, code_blocks, multiplication_table,
                                  matrix_rows])
@pytest.mark.parametrize("chunk", [64, 1024])
def test_legitimate_repetitive_answers_are_never_stopped(tiny_tokenizer, make, chunk):
    text = "<think>\nThe user wants a long structured answer.\n</think>\n\n" + make()
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 2 * CFG.min_span, f"{make.__name__}: only {len(ids)} tokens, too short to test anything"
    assert feed_all(ids, chunk) is None, f"{make.__name__} ({len(ids)} tokens) was judged a runaway"


def test_the_same_structure_looping_for_real_is_stopped(tiny_tokenizer):
    """The list's own line, repeated verbatim (the model stuck on one item), is stopped."""
    ids = tiny_tokenizer.encode(numbered_list(20) + "21. **Step 21**: Check it again.\n" * 400,
                                add_special_tokens=False)
    verdict = feed_all(ids, 64)
    assert verdict is not None and verdict.signal == "cycle"


# --- the [runaway] section ------------------------------------------------------------------------------------

def _cfg(**runaway):
    return config_from_dict({"run_dir": "/r", "model": "/m", "prompts": ["p.jsonl"], "runaway": runaway})


def test_runaway_config_defaults_and_overrides():
    assert _cfg().runaway == Runaway()
    assert _cfg(enabled=False, min_span=2048).runaway.min_span == 2048


@pytest.mark.parametrize("key,value,words", [
    ("enabled", "yes", '[runaway] enabled: "yes" (a string): expected true or false'),
    # the whole range and the default, not only the bound that was crossed
    ("max_period", 0, ("[runaway] max_period: 0: must be", "1", "4096", "default 512")),
    ("min_repeats", 1, "[runaway] min_repeats: 1: must be an integer in 2..1000000"),
    # the range, the default, and what 1 does
    ("ngram_share", 0, ("[runaway] ngram_share: 0: must be in (0, 1]", "default 0.9",
                        "1 turns the n-gram signal off")),
    ("alert_share", 1.5, "[runaway] alert_share: 1.5: must be in (0, 1]"),
    ("ngram_window", 10, "[runaway] ngram_window: 10: must be an integer in 64..1000000"),
    ("stream_interval", 2.5, "[runaway] stream_interval: 2.5 (a number): expected an integer"),
    ("nope", 1, "[runaway] nope: unknown key"),
])
def test_runaway_config_errors_name_the_key_and_the_fix(key, value, words):
    with pytest.raises(ConfigError) as err:
        _cfg(**{key: value})
    for needle in (words,) if isinstance(words, str) else words:
        assert needle in str(err.value)
