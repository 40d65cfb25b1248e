"""`regen export`: every format read back the way its trainer reads it, the filters' counts, the manifest, --verify."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from console.cli import main as cli_main
from engine.config.load import dump_toml
from engine.text.ingest import Conversation, iter_prompts
from engine.text.render import Renderer
from engine.store.shard_store import ShardStore
from tests.test_engine_run import SupervisorProc, make_config, read_rows

# -- the consumers' conventions -------------------------------------------------------------------


def read_pretokenized_jsonl(path: Path, max_length: int, min_supervised: int = 2) -> list[dict]:
    """SpecForge's prompt_builder / speculators' prepare_data rules for a JSONL file: the first record decides
    whether the file is pre-tokenized (it has input_ids); then loss_mask is required, 0/1 and the same length;
    rows are cut to max_length; rows left with fewer than 2 supervised tokens are dropped (silently, there)."""
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    assert "input_ids" in first, "the first record decides: not pre-tokenized"
    rows = []
    for line in lines:
        r = json.loads(line)
        ids, mask = r["input_ids"], r["loss_mask"]
        assert len(ids) == len(mask), f"{r['id']}: input_ids and loss_mask differ in length"
        assert set(mask) <= {0, 1}, f"{r['id']}: loss_mask values other than 0/1"
        ids, mask = ids[:max_length], mask[:max_length]
        if sum(mask) < min_supervised:
            continue
        rows.append({**r, "input_ids": ids, "loss_mask": mask})
    return rows


def input_order(cfg) -> dict[str, int]:
    return {e.conversation_id: e.index for e in iter_prompts(cfg.prompts, cfg.prompt_format)
            if isinstance(e, Conversation)}


def export(run_dir: Path, out: Path, fmt: str, *extra: str) -> dict:
    code = cli_main(["export", str(run_dir), "--format", fmt, "--out", str(out), "--json", *extra])
    assert code == 0
    return json.loads((out / "manifest.json").read_text())


# -- a finished multi-turn run (FastChat-style demo prompts) ---------------------------------------


def _finished_run(tmp_path_factory, model_dir: Path):
    run_dir = tmp_path_factory.mktemp("export") / "run"
    cfg = make_config(run_dir, model_dir, prompts=60)
    sup = SupervisorProc(run_dir).start(cfg)
    try:
        assert sup.wait(180) == 0, sup.log_text()[-3000:]
    finally:
        sup.cleanup()
    rows = read_rows(run_dir)
    assert any(r["turn"] > 0 for r in rows), "the demo prompts have multi-turn conversations"
    renderer = Renderer(cfg.tokenizer_path, enable_thinking=cfg.enable_thinking, context_length=cfg.context_length)
    return run_dir, cfg, {r["sample_id"]: r for r in rows}, renderer


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_model_dir):
    return _finished_run(tmp_path_factory, tiny_model_dir)


@pytest.fixture(scope="module")
def finished_run_35(tmp_path_factory, tiny35_model_dir):
    """The same run with a Qwen3.5-style template: the prompt opens <think>, the answers only close it."""
    return _finished_run(tmp_path_factory, tiny35_model_dir)


def test_tokens_jsonl_reads_back_with_specforge_and_speculators_rules(finished_run, tmp_path, capsys):
    run_dir, cfg, shard, _ = finished_run
    out = tmp_path / "tokens"
    export(run_dir, out, "tokens-jsonl")
    summary = json.loads(capsys.readouterr().out)
    rows = read_pretokenized_jsonl(out / "tokens.jsonl", max_length=10**6)
    assert len(rows) == summary["kept"] == len(shard) - sum(summary["dropped"].values())
    for r in rows:
        s = shard[r["id"]]
        assert r["input_ids"] == s["input_ids"], f"{r['id']}: ids differ from the shard's"
        assert r["loss_mask"] == [0] * s["prompt_len"] + [1] * s["output_len"]
        assert r["primary_id"] == s["conversation_id"]
    order = input_order(cfg)
    keys = [(order[r["primary_id"]], r["metadata"]["turn"]) for r in rows]
    assert keys == sorted(keys), "rows are in input order of conversations, then turn"


def test_tokens_jsonl_cut_at_max_length_leaves_nothing_for_the_trainer_to_drop(finished_run, tmp_path, capsys):
    run_dir, _, shard, _ = finished_run
    out = tmp_path / "cut"
    n = 40
    export(run_dir, out, "tokens-jsonl", "--max-length", str(n))
    summary = json.loads(capsys.readouterr().out)
    raw = [json.loads(line) for line in (out / "tokens.jsonl").read_text().splitlines()]
    trained = read_pretokenized_jsonl(out / "tokens.jsonl", max_length=n)
    assert len(trained) == len(raw), "the trainer would drop exported rows in silence"
    assert all(len(r["input_ids"]) <= n and sum(r["loss_mask"]) >= 2 for r in raw)
    for r in raw:
        s = shard[r["id"]]
        assert r["input_ids"] == s["input_ids"][:n]
    lost = sum(shard[r["id"]]["output_len"] - sum(r["loss_mask"]) for r in raw)
    assert summary["supervised_lost"] == lost and summary["rows_cut"] > 0
    assert summary["dropped"].get("min_supervised", 0) > 0  # prompts of >= 39 tokens: nothing left to learn


def test_tokens_jsonl_warns_about_rows_a_trainer_drops_in_silence(finished_run, tmp_path, capsys):
    run_dir, _, _, _ = finished_run
    code = cli_main(["export", str(run_dir), "--format", "tokens-jsonl", "--out", str(tmp_path / "w"),
                     "--max-length", "40", "--min-supervised", "0"])
    text = capsys.readouterr().out
    assert code == 0
    assert "fewer than 2 supervised tokens: SpecForge (DFlash family) drops such rows silently" in " ".join(text.split())
    assert "supervised tokens lost" in text


def test_hf_loads_with_datasets_and_labels_ignore_the_prompt(finished_run, tmp_path):
    datasets = pytest.importorskip("datasets")
    run_dir, _, shard, _ = finished_run
    out = tmp_path / "hf"
    manifest = export(run_dir, out, "hf", "--split-rows", "25")
    assert len(manifest["files"]) > 1 and all(f["rows"] <= 25 for f in manifest["files"])
    ds = datasets.load_dataset("parquet", data_files=str(out / "*.parquet"), split="train",
                               cache_dir=str(tmp_path / "cache"))
    assert len(ds) == manifest["counts"]["kept"]
    for r in ds:
        s = shard[r["id"]]
        assert r["input_ids"] == s["input_ids"]
        assert r["loss_mask"] == [0] * s["prompt_len"] + [1] * s["output_len"]
        assert r["labels"] == [-100] * s["prompt_len"] + s["input_ids"][s["prompt_len"]:]


def test_messages_parquet_loads_with_datasets_reasoning_inline(finished_run, tmp_path):
    datasets = pytest.importorskip("datasets")
    run_dir, _, shard, renderer = finished_run
    out = tmp_path / "mp"
    export(run_dir, out, "messages-parquet")
    ds = datasets.load_dataset("parquet", data_files=str(out / "*.parquet"), split="train",
                               cache_dir=str(tmp_path / "cache"))
    assert len(ds) > 0
    for r in ds:
        last = r["messages"][-1]
        assert last["role"] == "assistant"
        s = shard[r["id"]]
        assert last["content"] == renderer.history_answer(s["input_ids"][s["prompt_len"]:])


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_conversations_jsonl_re_renders_to_the_shard_prompt_ids(family, request, tmp_path):
    run_dir, _, shard, renderer = request.getfixturevalue("finished_run" if family == "qwen3" else "finished_run_35")
    out = tmp_path / "conv"
    export(run_dir, out, "conversations-jsonl", "--reasoning-key", "thinking")
    rows = [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]
    first_turns = later = 0
    for r in rows:
        s = shard[r["id"]]
        history, final = r["conversations"][:-1], r["conversations"][-1]
        assert final["role"] == "assistant" and "thinking" in final and "reasoning_content" not in final
        prompt = renderer.prompt_ids(history)
        assert prompt == s["input_ids"][: s["prompt_len"]], f"{r['id']}: the re-rendered prompt differs"
        # the whole conversation through the template renders the shard's answer text (ids are not compared
        # here: re-tokenizing text need not give the ids the model generated, which is why tokens-jsonl exists)
        full = renderer.tokenizer.apply_chat_template(
            history + [{"role": "assistant", "content": final["content"], "reasoning_content": final["thinking"]}],
            tokenize=False, enable_thinking=True)
        if family == "qwen3":
            assert full.startswith(renderer.prompt_text(history) + s["text"]), f"{r['id']}: the rendered answer differs"
        else:  # this template trims the reasoning's spaces when it renders it: compare the split itself
            assert s["text"] == f"{final['thinking']}\n</think>\n\n{final['content']}<|im_end|>", r["id"]
        first_turns += s["turn"] == 0
        later += s["turn"] > 0
    assert first_turns and later


def test_messages_jsonl_has_modelopt_rows(finished_run, tmp_path):
    run_dir, _, shard, renderer = finished_run
    out = tmp_path / "mj"
    export(run_dir, out, "messages-jsonl")
    rows = [json.loads(line) for line in (out / "messages.jsonl").read_text().splitlines()]
    assert rows and all(set(r) == {"sample_id", "conversation_id", "turn", "messages"} for r in rows)
    for r in rows:
        # the row's own id is sample_id; conversation_id is the conversation's, shared by its turns
        assert r["sample_id"] == f"{r['conversation_id']}#turn{r['turn']}"
        s = shard[r["sample_id"]]
        final = r["messages"][-1]["content"]
        assert final.startswith("<think>\n") and final == renderer.history_answer(s["input_ids"][s["prompt_len"]:])


def test_manifest_records_what_made_the_data_and_verify_passes_then_fails(finished_run, tmp_path, capsys):
    run_dir, cfg, _, _ = finished_run
    run_manifest = json.loads((run_dir / "manifest.json").read_text())
    assert run_manifest["kind"] == "run" and run_manifest["counts"]["samples"] == len(finished_run[2])
    out = tmp_path / "v"
    m = export(run_dir, out, "tokens-jsonl", "--split-rows", "30")
    capsys.readouterr()
    assert m["model"] == cfg.model and m["enable_thinking"] is True and m["config_hash"] == cfg.content_hash()
    assert m["chat_template_sha256"] and "tokenizer.json" in m["tokenizer_files"]
    assert m["sampling"]["temperature"] == cfg.sampling.temperature
    assert [Path(p["path"]).name for p in m["prompt_files"]] == ["chat_a.jsonl", "chat_b.jsonl"]
    assert all(p["size"] > 0 and len(p["sha256_head_tail"]) == 64 for p in m["prompt_files"])
    assert sum(f["rows"] for f in m["files"]) == m["counts"]["kept"] and m["regen_version"]

    assert cli_main(["export", "--verify", str(out)]) == 0
    assert "match manifest.json" in capsys.readouterr().out
    second = out / m["files"][1]["path"]
    second.write_text(second.read_text().replace('"loss_mask":[0', '"loss_mask":[1', 1))
    (out / "stray.jsonl").write_text("{}\n")
    assert cli_main(["export", "--verify", str(out)]) == 1
    said = " ".join(capsys.readouterr().out.split())
    assert f"{second.name}: sha256" in said and "(the file changed after the export)" in said
    assert "stray.jsonl: in the export directory but not in its manifest" in said
    assert cli_main(["export", "--verify", str(tmp_path)]) == 2
    assert "no manifest" in capsys.readouterr().err


def test_over_ssh_transport_the_export_runs_on_the_host(finished_run, tmp_path, capsys):
    run_dir, _, _, _ = finished_run
    out = tmp_path / "remote"
    code = cli_main(["export", f"local:{run_dir}", "--format", "hf", "--out", str(out), "--json",
                     "--python", sys.executable])
    assert code == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    assert summary["files"] and (out / "manifest.json").is_file()


def test_verify_over_the_transport_reads_the_manifest_on_the_host(finished_run, tmp_path, capsys):
    run_dir, _, _, _ = finished_run
    out = tmp_path / "remote-verify"
    export(run_dir, out, "tokens-jsonl")
    capsys.readouterr()
    # the manifest names the run dir, whose deployed engine (if any) does the check on the host
    assert json.loads((out / "manifest.json").read_text())["run_dir"] == str(run_dir)
    assert cli_main(["export", "--verify", f"local:{out}", "--python", sys.executable]) == 0, capsys.readouterr().err
    assert "rows match manifest.json" in capsys.readouterr().out
    (out / "tokens.jsonl").write_text("{}\n")
    assert cli_main(["export", "--verify", f"local:{out}", "--python", sys.executable]) == 1
    assert "the file changed after the export" in " ".join(capsys.readouterr().out.split())


def test_refuses_a_non_empty_out_dir_naming_the_fix(finished_run, tmp_path, capsys):
    run_dir, _, _, _ = finished_run
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old.jsonl").write_text("{}\n")
    assert cli_main(["export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "full")]) == 2
    assert "directory is not empty; give a new or empty directory" in capsys.readouterr().err


# -- filters, counted per reason --------------------------------------------------------------------


def _row(sid: str, origin: str, text: str, finish: str = "stop", prompt: int = 5, output: int = 6) -> dict:
    return {"sample_id": sid + "#turn0", "conversation_id": sid, "turn": 0, "source": "chat_a.jsonl", "origin": origin,
            "input_ids": list(range(1, prompt + output + 1)), "loss_mask": [0] * prompt + [1] * output,
            "prompt_len": prompt, "output_len": output, "reasoning_tokens": 2, "prompt_opened": False, "finish_reason": finish,
            "completion_tokens": output, "cached_tokens": 0, "latency_s": 0.1, "worker": "gpu0", "text": text}


GOOD = "<think>\nsome reasoning here\n</think>\n\nA real answer.<|im_end|>"


def crafted_run(tmp_path: Path, model: Path, parts: list[list[dict]]) -> Path:
    """A run dir whose committed parts are `parts` (the store's own commit), with a run.toml and prompt files."""
    run_dir = tmp_path / "run"
    cfg = make_config(run_dir, model, prompts=10)
    run_dir.mkdir()
    (run_dir / "run.toml").write_text(dump_toml(cfg))
    with ShardStore(run_dir) as store:
        store.ensure_shards({"s00000": 10})
        for rows in parts:
            store.commit("s00000", rows)
    return run_dir


def test_filters_drop_by_default_and_count_each_reason(tmp_path, tiny_model_dir, capsys):
    good = GOOD
    rows = [
        _row("c9", "chat_a.jsonl:9", good),
        _row("c1", "chat_a.jsonl:1", good),
        _row("c2", "chat_a.jsonl:2", "<think>\nstill going", finish="length"),
        _row("c3", "chat_a.jsonl:3", "<think>\n\n</think>\n\nOK.<|im_end|>"),
        _row("c4", "chat_a.jsonl:4", good, finish="abort"),
        _row("c5", "chat_a.jsonl:5", "An answer without reasoning at all.<|im_end|>"),
        _row("c6", "chat_a.jsonl:6", "<think>\nnever closed but stopped"),
        _row("c7", "chat_a.jsonl:7", good, output=1),
    ]
    run_dir = crafted_run(tmp_path, tiny_model_dir, [rows[:4], rows[4:]])
    out = tmp_path / "out"
    assert cli_main(["export", str(run_dir), "--format", "tokens-jsonl", "--out", str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    for line in ("drop truncated (finish_reason length) (default; --keep length to keep)",
                 "drop empty answers", "drop reasoning block missing", "drop reasoning block unterminated",
                 "drop rows with fewer than 2 supervised tokens (default"):
        assert line in said
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["dropped"] == {"aborted": 1, "length": 1, "empty": 1, "thinking_missing": 1,
                                      "thinking_unterminated": 1, "min_supervised": 1}
    kept = [json.loads(line)["id"] for line in (out / "tokens.jsonl").read_text().splitlines()]
    assert kept == ["c1#turn0", "c9#turn0"], "input order, whatever the order of commits"

    out2 = tmp_path / "out2"
    assert cli_main(["export", str(run_dir), "--format", "tokens-jsonl", "--out", str(out2), "--json",
                     "--keep", "length,empty,aborted,thinking", "--min-supervised", "1"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kept"] == 8 and summary["dropped"] == {}
    assert any("fewer than 2 supervised tokens" in w for w in summary["warnings"])


def test_export_of_a_run_in_progress_takes_what_was_committed(tmp_path, tiny_model_dir, capsys):
    run_dir = crafted_run(tmp_path, tiny_model_dir, [[_row("c1", "chat_a.jsonl:1", GOOD)]])
    # a part being written (not committed yet) is not read, nor is a leftover of a crash
    committed = next((run_dir / "shards" / "s00000").glob("part-*.parquet"))
    pq.write_table(pq.read_table(committed), run_dir / "shards/s00000/part-000009.parquet")
    assert cli_main(["export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "o"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 1


def test_chat_formats_refuse_prompt_files_that_changed_naming_the_way_out(tmp_path, tiny_model_dir, capsys):
    run_dir = crafted_run(tmp_path, tiny_model_dir, [[_row("c1", "chat_a.jsonl:1", GOOD)]])  # not the file's row 1
    out = tmp_path / "conv"
    assert cli_main(["export", str(run_dir), "--format", "conversations-jsonl", "--out", str(out)]) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "sample 'c1#turn0' came from chat_a.jsonl:1" in said and "the prompt files changed since the run" in said
    assert "or export a token format (tokens-jsonl, hf), which needs no prompts" in said
    assert f"{out} holds a partial export without a manifest: delete it" in said


def test_bad_options_name_the_option(tmp_path, capsys):
    assert cli_main(["export", str(tmp_path), "--format", "hf", "--out", str(tmp_path / "o"),
                     "--keep", "everything"]) == 2
    assert "--keep everything: must be among aborted, length, repetition, empty, thinking" in capsys.readouterr().err
    assert cli_main(["export", str(tmp_path), "--format", "hf"]) == 2
    assert "--out DIR is required" in capsys.readouterr().err


def test_a_shard_compacted_under_the_export_is_read_as_the_snapshot_had_it(tmp_path, tiny_model_dir):
    """The export's snapshot lists a shard's parts; the supervisor compacts the shard (and a later part joins it
    first) before the export reads them: the rows read are the snapshot's, from the shard file's first rows."""
    from engine.export.source import iter_shards, open_snapshot
    run_dir = crafted_run(tmp_path, tiny_model_dir, [[_row("c1", "chat_a.jsonl:1", GOOD)],
                                                      [_row("c2", "chat_a.jsonl:2", GOOD)]])
    snap = open_snapshot(run_dir)
    with ShardStore(run_dir) as store:
        store.commit("s00000", [_row("c3", "chat_a.jsonl:3", GOOD)])  # after the snapshot: not in the export
        assert store.compact("s00000").parts_removed == 3
    (shard,) = list(iter_shards(snap, ["sample_id", "origin", "turn"]))
    assert sorted(shard.table.column("sample_id").to_pylist()) == ["c1#turn0", "c2#turn0"]
