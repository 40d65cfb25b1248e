"""The count cache (run_dir/count_cache.json) and the feed's seek to the first incomplete shard.

Real files (JSONL, gzip JSONL, JSON array, Parquet, several files), the real tokenizer and work
plan, a real shard store: the cache is reused while the prompt files are unchanged, counted again
(with a log line saying why) when a file or a counting field changes, ignored loudly when damaged,
and a stream started from a saved position yields exactly the conversations (ids, indices, rows)
of the full stream from there on.
"""
from __future__ import annotations

import gzip
import json
import logging
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.store import count_cache
from engine.config.load import RunConfig
from engine.text.ingest import Conversation, iter_prompts
from engine.store.rejects import RejectLog
from engine.text.render import Renderer
from engine.store.shard_store import ShardStore
from engine.run.feed import Feed
from engine.run.ledger import Ledger
from engine.run.prompt_count import PromptCount
from tests.ledger_stubs import StubWing


def conv_row(i: int, turns: int = 1) -> dict:
    msgs = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"question {i}.{t}"})
        if t < turns - 1:
            msgs.append({"role": "assistant", "content": f"answer {i}.{t}"})
    return {"id": f"c{i}", "messages": msgs}


def jsonl_lines(n: int) -> list[bytes]:
    """n rows with bad rows between them: malformed JSON, an unknown role, blank lines, and
    duplicate ids (one of a much earlier row, near the end) to check skip lists across a seek."""
    lines = []
    for i in range(n):
        lines.append(json.dumps(conv_row(i, turns=1 + i % 3)).encode())
        if i % 7 == 3:
            lines.append(b'{"id": "broken", "messages": [')
        if i % 11 == 5:
            lines.append(b"")
        if i % 13 == 8:
            lines.append(json.dumps({"id": f"r{i}", "messages": [{"role": "alien", "content": "x"}]}).encode())
        if i in (n - 5, n - 2):
            lines.append(json.dumps(conv_row(1)).encode())  # duplicate id of row 1 (in the first shard)
    return lines


def write_jsonl(path: Path, n: int, gz: bool = False) -> Path:
    data = b"\xef\xbb\xbf" + b"\n".join(jsonl_lines(n)) + b"\n"  # with a BOM
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


def write_json_array(path: Path, n: int) -> Path:
    rows = [conv_row(i, turns=1 + i % 2) for i in range(n)]
    rows.insert(5, {"id": "bad", "prompt": 7})
    rows.insert(n - 3, conv_row(2))  # a duplicate of an early id, late in the file
    path.write_text(json.dumps(rows, indent=1))
    return path


def write_parquet(path: Path, n: int) -> Path:
    ids = [f"p{i}" for i in range(n)] + ["p3"]  # the last row duplicates an early one
    prompts = [f"parquet prompt {i}" for i in range(n + 1)]
    pq.write_table(pa.table({"id": ids, "prompt": prompts}), path, row_group_size=7)
    return path


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    return Renderer(str(tiny_model_dir), enable_thinking=True)


def make_cfg(run_dir: Path, prompts: list[Path], model: Path, **kw) -> RunConfig:
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = RunConfig(run_dir=str(run_dir), model=str(model), prompts=tuple(str(p) for p in prompts),
                    turns="all", shard_size=4)
    return cfg.model_copy(update=kw)


class Plan:
    """The feed's counting pass over a run dir and the ledger opened on it, as the supervisor makes them at a start."""

    def __init__(self, cfg: RunConfig, renderer: Renderer):
        self.cfg = cfg
        self.store = ShardStore(Path(cfg.run_dir))
        self.rejects = RejectLog(Path(cfg.run_dir))
        self.prompts = PromptCount(cfg, renderer, self.rejects)
        self.feed = Feed(cfg, renderer, self.prompts)

    def count(self) -> tuple[Feed, list]:
        bad = self.prompts.count_stream()
        self.prompts.finish_count(bad)
        wing = StubWing()
        ledger = Ledger(self.cfg, self.prompts.planned, self.store, self.rejects, feed=wing, events=wing)
        ledger.open()
        self.feed.attach(ledger)
        return self.feed, bad

    def close(self) -> None:
        self.feed.close()
        self.rejects.close()
        self.store.close()


def count(cfg, renderer):
    p = Plan(cfg, renderer)
    try:
        plan, bad = p.count()
        shards = {sid: (c.total, c.conversations, c.first_index, c.end_index) for sid, c in plan.prompts.planned.items()}
        return plan, bad, shards
    finally:
        p.close()


def reject_lines(run_dir: Path) -> list[str]:
    return (run_dir / "rejects.jsonl").read_text().splitlines()


def test_count_is_cached_and_reused_without_duplicate_rejects(tmp_path, tiny_model_dir, renderer, caplog):
    cfg = make_cfg(tmp_path / "run", [write_jsonl(tmp_path / "p.jsonl", 60)], tiny_model_dir)
    caplog.set_level(logging.INFO, logger="regen.feed")
    plan1, bad1, shards1 = count(cfg, renderer)
    assert bad1 and plan1.prompts.input_rejects == len(bad1)
    assert "count cache: not used: no count cache yet" in caplog.text
    assert (tmp_path / "run" / count_cache.CACHE_FILE).exists()
    logged = reject_lines(tmp_path / "run")
    assert len(logged) == len(bad1)

    caplog.clear()
    plan2, bad2, shards2 = count(cfg, renderer)
    assert bad2 == []  # already in rejects.jsonl: not handed out again
    assert shards2 == shards1 and plan2.prompts.input_rejects == plan1.prompts.input_rejects
    assert "count cache: 15 shards" in caplog.text and "(count cache)" in plan2.prompts.counted()
    assert reject_lines(tmp_path / "run") == logged


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "json", "parquet", "two-files"])
def test_a_stream_from_a_saved_start_is_the_full_stream_from_there(tmp_path, tiny_model_dir, renderer, kind):
    if kind == "jsonl":
        files = [write_jsonl(tmp_path / "p.jsonl", 50)]
    elif kind == "jsonl.gz":
        files = [write_jsonl(tmp_path / "p.jsonl.gz", 50, gz=True)]
    elif kind == "json":
        files = [write_json_array(tmp_path / "p.json", 40)]
    elif kind == "parquet":
        files = [write_parquet(tmp_path / "p.parquet", 40)]
    else:
        files = [write_jsonl(tmp_path / "a.jsonl", 30), write_parquet(tmp_path / "b.parquet", 30)]
    cfg = make_cfg(tmp_path / "run", files, tiny_model_dir)
    full = [c for c in iter_prompts(cfg.prompts) if isinstance(c, Conversation)]
    for cached in (False, True):  # the starts recorded by this count, then the ones read from the cache
        p = Plan(cfg, renderer)
        try:
            plan, _ = p.count()
            assert plan.prompts._count_from_cache is cached
            assert plan.prompts._seekable and len(plan.prompts._starts) == len(plan.prompts.planned) > 3
            for sid, counts in plan.prompts.planned.items():
                got = []
                for conv in plan.prompts.stream_from(counts.first_index):
                    got.append(conv)
                    if len(got) == 2 * cfg.shard_size:
                        break
                want = full[counts.first_index:counts.first_index + 2 * cfg.shard_size]
                assert [(c.conversation_id, c.index, c.origin, c.messages) for c in got] == \
                       [(c.conversation_id, c.index, c.origin, c.messages) for c in want], sid
        finally:
            p.close()


def test_the_feed_starts_at_the_first_incomplete_shard(tmp_path, tiny_model_dir, renderer, caplog):
    cfg = make_cfg(tmp_path / "run", [write_jsonl(tmp_path / "p.jsonl", 40)], tiny_model_dir)
    count(cfg, renderer)
    caplog.set_level(logging.INFO, logger="regen.feed")
    p = Plan(cfg, renderer)
    try:
        plan, _ = p.count()
        for sid in sorted(plan.prompts.planned)[:6]:
            plan.prompts.planned[sid].done = plan.prompts.planned[sid].total  # as if committed
        first = plan.prompts.planned[sorted(plan.prompts.planned)[6]].first_index
        source = plan._next_source()
        conv = next(source)
        assert conv.index == first
        assert f"feed starts at conversation {first} (shard s00006)" in caplog.text
    finally:
        p.close()


def test_a_changed_prompt_file_is_counted_again_with_the_reason(tmp_path, tiny_model_dir, renderer, caplog):
    path = write_jsonl(tmp_path / "p.jsonl", 40)
    cfg = make_cfg(tmp_path / "run", [path], tiny_model_dir)
    _, _, before = count(cfg, renderer)
    caplog.set_level(logging.INFO, logger="regen.feed")

    with open(path, "ab") as f:  # grows: size changes
        f.write(json.dumps(conv_row(1000, turns=2)).encode() + b"\n")
    _, _, after = count(cfg, renderer)
    assert "count cache: not used: prompt file" in caplog.text and "changed (size" in caplog.text
    assert sum(v[1] for v in after.values()) == sum(v[1] for v in before.values()) + 1

    # same size, mtime put back: the ctime and the sampled content still tell
    caplog.clear()
    st = os.stat(path)
    data = path.read_bytes().replace(b"question 3.0", b"question X.0")
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    count(cfg, renderer)
    assert "count cache: not used: prompt file" in caplog.text and "ctime_ns" in caplog.text

    caplog.clear()
    count(cfg, renderer)
    assert "count cache: 11 shards" in caplog.text  # recounted (41 conversations) -> cached again


def test_a_counting_config_change_is_counted_again(tmp_path, tiny_model_dir, renderer, caplog):
    path = write_jsonl(tmp_path / "p.jsonl", 40)
    cfg = make_cfg(tmp_path / "run", [path], tiny_model_dir)
    _, _, all_turns = count(cfg, renderer)
    caplog.set_level(logging.INFO, logger="regen.feed")
    _, _, last_turn = count(cfg.model_copy(update=dict(turns="last")), renderer)
    assert "count cache: not used: config changed since the count: turns 'all' -> 'last'" in caplog.text
    assert sum(v[0] for v in last_turn.values()) < sum(v[0] for v in all_turns.values())


@pytest.mark.parametrize("damage", ["garbage", "truncated", "edited", "inconsistent"])
def test_a_damaged_cache_is_ignored_loudly_and_replaced(tmp_path, tiny_model_dir, renderer, caplog, damage):
    cfg = make_cfg(tmp_path / "run", [write_jsonl(tmp_path / "p.jsonl", 40)], tiny_model_dir)
    _, _, good = count(cfg, renderer)
    cache = tmp_path / "run" / count_cache.CACHE_FILE
    doc = json.loads(cache.read_text())
    if damage == "garbage":
        cache.write_bytes(b"\x00\xffnot json")
    elif damage == "truncated":
        cache.write_text(cache.read_text()[:100])
    elif damage == "edited":  # a number changed by hand: the checksum no longer matches
        doc["data"]["shards"][0][2] += 1
        cache.write_text(json.dumps(doc))
    else:  # checksum recomputed, but the shards do not add up: still refused
        doc["data"]["shards"][1][3] += 1
        doc["sha256"] = count_cache._checksum(doc["key"], doc["data"])
        cache.write_text(json.dumps(doc))
    caplog.set_level(logging.INFO, logger="regen.feed")
    plan, bad, shards = count(cfg, renderer)
    assert not plan.prompts._count_from_cache and shards == good and bad
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "count cache: IGNORED" in r.message]
    assert len(warnings) == 1, caplog.text
    caplog.clear()
    plan, _, shards = count(cfg, renderer)  # the recount wrote a good cache again
    assert plan.prompts._count_from_cache and shards == good


def test_a_lost_reject_log_is_counted_again(tmp_path, tiny_model_dir, renderer, caplog):
    cfg = make_cfg(tmp_path / "run", [write_jsonl(tmp_path / "p.jsonl", 40)], tiny_model_dir)
    _, bad, _ = count(cfg, renderer)
    (tmp_path / "run" / "rejects.jsonl").unlink()
    caplog.set_level(logging.INFO, logger="regen.feed")
    plan, bad2, _ = count(cfg, renderer)
    assert not plan.prompts._count_from_cache and len(bad2) == len(bad)
    assert "fewer than the" in caplog.text
    assert len(reject_lines(tmp_path / "run")) == len(bad)


def test_a_wrong_saved_start_falls_back_to_the_full_stream(tmp_path, tiny_model_dir, renderer, caplog):
    cfg = make_cfg(tmp_path / "run", [write_jsonl(tmp_path / "p.jsonl", 40)], tiny_model_dir)
    count(cfg, renderer)
    cache = tmp_path / "run" / count_cache.CACHE_FILE
    doc = json.loads(cache.read_text())
    doc["data"]["shards"][5][6] = doc["data"]["shards"][4][6]  # shard 5 "starts" where shard 4 does
    doc["sha256"] = count_cache._checksum(doc["key"], doc["data"])
    cache.write_text(json.dumps(doc))
    caplog.set_level(logging.INFO, logger="regen.feed")
    p = Plan(cfg, renderer)
    try:
        plan, _ = p.count()
        assert plan.prompts._count_from_cache
        first = plan.prompts.planned["s00005"].first_index
        got = [c.index for c, _ in zip(plan.prompts.stream_from(first), range(first + 4))]
        assert got == list(range(first + 4))  # the full stream, from index 0
        assert "count cache: shard s00005 should start with conversation" in caplog.text
    finally:
        p.close()
