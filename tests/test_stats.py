"""Shard statistics: real ShardStore parts rendered with the tiny tokenizer, numbers checked independently."""
from __future__ import annotations

import json
import random
import sqlite3
import statistics
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from console.cli import main as cli_main
from engine.text.answer_shape import is_empty_answer, think_state
from engine.text.render import Renderer
from engine.store.shard_schema import PART_COMPRESSION, SHARD_SCHEMA
from engine.store.shard_store import ShardStore
from engine.api.reports import STATS_SCHEMA
from engine.store.stats import compute_stats, log2_histogram, stats_alerts
from engine.store.stats_columns import empty_answer_mask, think_codes
from engine.store.stats_parts import StatsReadError

EMPTY = "<think>\n\n</think>\n\nOK.<|im_end|>"
NORMAL = "<think>\nLet me add two and two carefully.\n</think>\n\nThe answer is 4, because 2 + 2 = 4.<|im_end|>"
UNTERMINATED = "<think>\nStill thinking about the many ways to add these numbers and"
MISSING = "A plain answer without any reasoning block, long enough to count.<|im_end|>"
ABORTED = "<think>\nPartial thought"
N_SAMPLES = 40


def kind_of(i: int) -> str:
    return {0: "empty", 1: "empty", 2: "truncated", 3: "missing", 4: "aborted"}.get(i % 10, "normal")


TEXT = {"empty": EMPTY, "normal": NORMAL, "truncated": UNTERMINATED, "missing": MISSING, "aborted": ABORTED}
FINISH = {"empty": "stop", "normal": "stop", "truncated": "length", "missing": "stop", "aborted": "abort"}


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return Renderer(str(tiny_model_dir), enable_thinking=True)


def make_row(renderer: Renderer, i: int) -> dict:
    kind = kind_of(i)
    words = " ".join(["word"] * (1 + 3 * i))  # prompts from short to long, some past a small cut
    prompt = renderer.prompt_ids([{"role": "user", "content": f"Question {i}: {words}?"}])
    output = renderer.tokenizer.encode(TEXT[kind], add_special_tokens=False)
    conv = f"c{i:03d}"
    source = "a.jsonl" if i < 25 else "b.jsonl"
    return {
        "sample_id": f"{conv}#turn0", "conversation_id": conv, "turn": 0, "source": source, "origin": f"{source}:{i + 1}",
        "input_ids": prompt + output, "loss_mask": [0] * len(prompt) + [1] * len(output),
        "prompt_len": len(prompt), "output_len": len(output), "reasoning_tokens": renderer.reasoning_tokens(output),
        "prompt_opened": False,
        "finish_reason": FINISH[kind], "completion_tokens": len(output), "cached_tokens": 0, "latency_s": 0.1,
        "worker": f"gpu{i % 2}", "text": renderer.decode(output),
    }


@pytest.fixture(scope="module")
def rows(renderer) -> list[dict]:
    return [make_row(renderer, i) for i in range(N_SAMPLES)]


@pytest.fixture
def run_dir(tmp_path, rows) -> Path:
    """Two shards (s00000: rows 0-19 in two parts, s00001: 20-39 in one), committed by the real store,
    plus an orphan part file in s00000 that is not committed (a writer in progress)."""
    with ShardStore(tmp_path) as store:
        store.ensure_shards({"s00000": 20, "s00001": 20, "s00002": 20})
        store.commit("s00000", rows[:12])
        store.commit("s00000", rows[12:20])
        store.commit("s00001", rows[20:])
    orphan = pa.Table.from_pylist(rows[:3], schema=SHARD_SCHEMA)
    pq.write_table(orphan, tmp_path / "shards" / "s00000" / "part-000099.parquet", compression=PART_COMPRESSION)
    return tmp_path


def q(values, p):
    """Percentile by statistics.quantiles (inclusive = linear interpolation)."""
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def test_texts_render_to_the_intended_shapes(rows):
    for i, r in enumerate(rows):
        assert r["text"] == TEXT[kind_of(i)]  # the tiny tokenizer round-trips the output text


def test_overall_shares_lengths_and_histogram(run_dir, rows):
    s = compute_stats(run_dir, train_max_length=4096)
    assert s.samples == N_SAMPLES
    assert (s.parts.listed_from, s.parts.committed, s.parts.read, s.parts.uncommitted_ignored) == ("state.sqlite", 3, 3, 1)
    assert any("not committed" in n for n in s.notes)
    assert (s.empty.count, s.empty.share) == (8, 8 / 40)
    assert (s.truncated.count, s.truncated.share) == (4, 4 / 40)
    assert (s.aborted.count, s.aborted.share) == (4, 4 / 40)
    assert s.reasoning["unterminated"].count == 8 and s.reasoning["unterminated"].share == 8 / 40
    assert s.reasoning["missing"].count == 4 and s.reasoning["missing"].share == 4 / 40
    assert s.reasoning["present"].count == 28 and s.reasoning["present"].share == 28 / 40

    out = [r["output_len"] for r in rows]
    mask_sums = [sum(r["loss_mask"]) for r in rows]
    assert mask_sums == out
    for name, values in (("output", out), ("prompt", [r["prompt_len"] for r in rows]),
                         ("reasoning", [r["reasoning_tokens"] for r in rows])):
        d = s.lengths[name]
        assert d.mean == pytest.approx(statistics.fmean(values))
        assert d.p50 == pytest.approx(statistics.median(values))
        assert d.p90 == pytest.approx(q(values, 90))
        assert d.p99 == pytest.approx(q(values, 99))
        assert (d.min, d.max) == (min(values), max(values))
    lm = s.loss_mask.distribution
    assert (lm.min, lm.max, lm.p50) == (min(mask_sums), max(mask_sums), pytest.approx(statistics.median(mask_sums)))
    # histogram: every sample in the bin [2^k, 2^(k+1)-1] holding its mask sum
    expected: dict[str, int] = {}
    for v in mask_sums:
        k = v.bit_length()
        label = "0" if v == 0 else ("1" if v == 1 else f"{1 << (k - 1)}-{(1 << k) - 1}")
        expected[label] = expected.get(label, 0) + 1
    got = {b.label: b.count for b in s.loss_mask.histogram if b.count}
    assert got == expected
    assert s.loss_mask.histogram[-1].high >= max(mask_sums)
    assert sum(b.count for b in s.loss_mask.histogram) == N_SAMPLES
    assert s.mask_check.mode == "full" and s.mask_check.rows_checked == N_SAMPLES and s.mask_check.mismatches == 0
    assert s.integrity_errors == []


def test_empty_share_flag_and_alerts(run_dir):
    s = compute_stats(run_dir)  # 20% empty > 5% default; truncated 10% is not above 10%
    keys = [f.key for f in s.flags]
    assert "empty_share" in keys and "truncated_share" not in keys
    alerts = stats_alerts(s)
    assert [a.key for a in alerts] == [f"stats.{k}" for k in keys]
    assert "8 of 40 samples (20.0%) are empty" in alerts[0].text
    quiet = compute_stats(run_dir, empty_threshold=0.5, truncated_threshold=0.09)
    assert [f.key for f in quiet.flags] == ["truncated_share"]
    # run-wide 20% is under 22%, but source a.jsonl (6 of 25 = 24%) stands out
    one_source = compute_stats(run_dir, empty_threshold=0.22)
    assert [f.key for f in one_source.flags] == ["source:a.jsonl:empty_share"]
    assert [g.flagged for g in one_source.by_source] == [["empty", "truncated"], []]  # a: 3 of 25 truncated


def test_training_cut(run_dir, rows):
    prompt = [r["prompt_len"] for r in rows]
    n = sorted(prompt)[30]  # a cut some prompts reach or pass
    s = compute_stats(run_dir, train_max_length=n)
    kept = sum(min(max(n - r["prompt_len"], 0), r["output_len"]) for r in rows)
    # independently: count mask ones within the first n positions of input_ids
    kept_from_mask = sum(sum(r["loss_mask"][:n]) for r in rows)
    assert kept == kept_from_mask
    total = sum(r["output_len"] for r in rows)
    c = s.cut
    assert (c.supervised_tokens_total, c.supervised_tokens_kept, c.supervised_tokens_cut) == (total, kept, total - kept)
    assert c.cut_share == pytest.approx((total - kept) / total)
    unsupervised = sum(1 for p in prompt if p >= n)
    assert unsupervised > 0 and c.samples_unsupervised == unsupervised
    assert c.samples_cut == sum(1 for r in rows if r["prompt_len"] + r["output_len"] > n)


def test_by_source_worker_and_shard(run_dir, rows):
    s = compute_stats(run_dir)

    def expect(key_of):
        groups: dict[str, list[dict]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(key_of(i, r), []).append((i, r))
        out = {}
        for name, members in groups.items():
            n = len(members)
            out[name] = (n, sum(kind_of(i) == "empty" for i, _ in members) / n,
                         sum(r["finish_reason"] == "length" for _, r in members) / n,
                         statistics.fmean(r["output_len"] for _, r in members))
        return out

    def got(groups):
        return {g.name: (g.samples, g.empty.share, g.truncated.share, pytest.approx(g.mean_output)) for g in groups}

    assert got(s.by_source) == expect(lambda i, r: r["source"])
    assert got(s.by_worker) == expect(lambda i, r: r["worker"])
    shards = {g.name: g for g in s.by_shard}
    assert got([shards["s00000"], shards["s00001"]]) == expect(lambda i, r: "s00000" if i < 20 else "s00001")
    assert (shards["s00000"].parts, shards["s00001"].parts, shards["s00002"].parts) == (2, 1, 0)
    assert shards["s00002"].samples == 0 and shards["s00002"].total_conversations == 20


def test_without_state_sqlite_parts_are_globbed_and_it_says_so(run_dir):
    (run_dir / "state.sqlite").unlink()
    for extra in run_dir.glob("state.sqlite-*"):
        extra.unlink()
    s = compute_stats(run_dir)
    assert s.parts.listed_from == "glob"
    assert s.samples == N_SAMPLES + 3  # the orphan cannot be told apart without the database
    assert any("no state.sqlite" in n for n in s.notes)


def test_mask_mismatch_is_an_integrity_error(run_dir, rows):
    bad = [dict(r) for r in rows[:2]]
    bad[0]["sample_id"] = "bad0#turn0"
    bad[0]["loss_mask"] = [1] * len(bad[0]["loss_mask"])  # ones over the prompt too
    bad[1]["sample_id"] = "bad1#turn0"
    bad[1]["output_len"] = bad[1]["output_len"] + 1  # disagrees with the mask
    rel = "shards/s00002/part-000000.parquet"
    (run_dir / rel).parent.mkdir()
    pq.write_table(pa.Table.from_pylist(bad, schema=SHARD_SCHEMA), run_dir / rel)
    db = sqlite3.connect(run_dir / "state.sqlite")
    db.execute("INSERT INTO parts(path, shard_id, rows, committed_at, seq, bytes) VALUES(?,?,?,?,?,?)",
               (rel, "s00002", 2, 0.0, 0, 0))
    db.commit()
    db.close()
    s = compute_stats(run_dir)
    assert s.mask_check.mismatches == 2
    kinds = {(e.kind, e.path) for e in s.integrity_errors}
    assert ("mask_sum", rel) in kinds and ("mask_layout", rel) in kinds and ("mask_length", rel) in kinds
    assert any(f.key == "integrity" for f in s.flags)


def test_committed_part_missing_on_disk_is_reported(run_dir):
    (run_dir / "shards/s00001/part-000000.parquet").unlink()
    s = compute_stats(run_dir)
    assert s.parts.missing == ["shards/s00001/part-000000.parquet"]
    assert s.samples == 20
    assert any(e.kind == "missing_part" for e in s.integrity_errors)


def test_unreadable_run_dir_raises_with_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(StatsReadError, match=str(missing)) as info:
        compute_stats(missing)
    assert "No such file or directory" in str(info.value)
    with pytest.raises(StatsReadError, match="not a run dir"):
        compute_stats(tmp_path)


def test_empty_rule_matches_answer_shape_exactly():
    battery = [EMPTY, NORMAL, UNTERMINATED, MISSING, ABORTED, "", "OK", "a b c", "a b c d", "<think>\n\n",
               "foo<think>\n</think>OK", "<think> <think> </think>x", "\u00a0<think>\u2003</think>\u3000ok\u00a0!",
               "</think>hi", "<think></think></think>ok", "<think>\n\n</think>\n\n<|im_end|><|endoftext|>",
               "<think></think>é è", "<think></think>ab_c d", "<think></think><|bad token|>", "<think>\n</think>x\n<think>y",
               "<think>\n\n</think>\n\n答案是4", "<think>\n\n</think>\n\n４２ ok", "<think>\x1c</think>ok\x85",
               "<think>\n\n</think>\n\nSure!<|im_end|>", "<think>\n\n</think>\n\nYes, 42.<|im_end|>"]
    pieces = ["<think>", "</think>", "\n", " ", "OK", ".", "!", "<|im_end|>", "<|x|>", "ab", "é", "\u00a0", "42", "_", "<", "|>"]
    rng = random.Random(7)
    battery += ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 8))) for _ in range(3000)]
    arr = pa.array(battery)
    got_empty = empty_answer_mask(arr).to_pylist()
    got_think = think_codes(arr)
    names = ("present", "missing", "unterminated")
    for text, e, t in zip(battery, got_empty, got_think):
        assert e == is_empty_answer(text), repr(text)
        assert names[t] == think_state(text), repr(text)
    # the same battery with the prompt opening the block on a random half of the rows (Qwen3.5/3.6 style)
    opened = np.array([rng.random() < 0.5 for _ in battery])
    got_empty = empty_answer_mask(arr, opened).to_pylist()
    got_think = think_codes(arr, opened)
    for text, o, e, t in zip(battery, opened, got_empty, got_think):
        assert e == is_empty_answer(text, bool(o)), (repr(text), o)
        assert names[t] == think_state(text, bool(o)), (repr(text), o)


def test_log2_histogram_bins():
    bins = log2_histogram(np.array([0, 1, 2, 3, 4, 7, 8, 6, 1000]))
    assert [(b.label, b.count) for b in bins][:5] == [("0", 1), ("1", 1), ("2-3", 2), ("4-7", 3), ("8-15", 1)]
    assert bins[-1].label == "512-1023" and bins[-1].count == 1


def test_cli_report_shows_histogram_and_flags(run_dir, capsys):
    code = cli_main(["stats", str(run_dir)])
    out = capsys.readouterr().out
    assert code == 1  # empty share 20% > 5%
    assert "loss-mask sum histogram" in out and "█" in out
    assert "FLAG" in out and "empty answers" in out and "20.0%" in out
    assert "by source" in out and "a.jsonl" in out and "gpu1" in out and "s00001" in out
    code = cli_main(["stats", str(run_dir), "--empty-threshold", "0.5"])
    assert code == 0 and "no quality flag raised" in capsys.readouterr().out


def _comparable(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in ("generated_at", "elapsed_s")}


def test_cli_json_equals_compute_stats(run_dir, capsys):
    code = cli_main(["stats", str(run_dir), "--json", "--train-max-length", "64"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["schema"] == STATS_SCHEMA
    assert _comparable(data) == _comparable(compute_stats(run_dir, train_max_length=64).to_dict())


def test_cli_host_dir_runs_the_engine_on_the_host(run_dir, capsys):
    code = cli_main(["stats", f"local:{run_dir}", "--json", "--python", sys.executable])
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert code == 1, out.err
    assert _comparable(data) | {"run_dir": None} == _comparable(compute_stats(run_dir).to_dict()) | {"run_dir": None}


def test_cli_unreadable_dir_exits_2_naming_the_path(tmp_path, capsys):
    missing = tmp_path / "no-such-run"
    assert cli_main(["stats", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err.replace("\n", "") and "No such file or directory" in err
    assert cli_main(["stats", f"local:{missing}", "--python", sys.executable]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err.replace("\n", "")


@pytest.mark.sshd
def test_cli_host_dir_over_real_ssh(run_dir, sshd, capsys):
    code = cli_main(["stats", f"{sshd.alias}:{run_dir}", "--json", "--python", sys.executable,
                     "--ssh-config", str(sshd.ssh_config_path)])
    out = capsys.readouterr()
    assert code == 1, out.err
    assert _comparable(json.loads(out.out)) == _comparable(compute_stats(run_dir).to_dict())


def test_sampled_mask_check_reads_the_head_of_parts(run_dir, rows, monkeypatch):
    import engine.store.stats_parts as stats_parts

    monkeypatch.setattr(stats_parts, "MASK_CHECK_HEAD_ROWS", 5)
    s = compute_stats(run_dir, mask_check="sample")
    assert (s.mask_check.mode, s.mask_check.parts_checked, s.mask_check.rows_checked) == ("sample", 3, 15)
    assert s.mask_check.mismatches == 0 and any("first 5 rows" in n for n in s.notes)
    off = compute_stats(run_dir, mask_check="off")
    assert (off.mask_check.mode, off.mask_check.rows_checked) == ("off", 0)


def test_check_mask_on_a_sliced_array():
    from engine.store.stats_columns import check_mask

    mask = pa.array([[0, 1], [0, 0, 1, 1], [1], [0, 1, 1]], type=pa.list_(pa.uint8())).slice(1, 3)
    bad, errors = check_mask(mask, np.array([2, 0, 1]), np.array([2, 1, 2]), "p")
    assert (bad, errors) == (0, [])
    bad, errors = check_mask(mask, np.array([2, 0, 1]), np.array([2, 1, 1]), "p")
    assert bad == 1 and {e.kind for e in errors} == {"mask_sum", "mask_length"}
