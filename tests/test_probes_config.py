"""Probes that need a run config: model dir, prompts, ports, run dir resume."""
from __future__ import annotations

import dataclasses
import json
import os
import socket

import pyarrow as pa
import pyarrow.parquet as pq

from probes.model import Status
from tests.sshd_fixtures import free_port_base
from tests.test_probes_fakes import (add_weights, config_context, gpu_env, openai, run_local, sharegpt,
                                     write_jsonl)


# ---------------------------------------------------------------------------------------------- model.dir


def test_model_without_weights_fails_with_path(tiny_model_dir, tmp_path):
    ctx = config_context(tmp_path, tiny_model_dir, [])
    res = run_local(ctx, {"model.dir", "model.weights"})
    r = res["model.weights"]
    assert r.status is Status.FAIL
    assert r.summary == f"no weights in {tiny_model_dir} (no *.safetensors or *.bin files)"
    assert r.remedy.startswith("download the weights into the model dir")
    m = res["model.dir"]  # config, tokenizer and template are fine: that probe passes
    assert m.status is Status.PASS, m.summary
    assert m.data["architecture"] == "Qwen3ForCausalLM"
    assert m.data["supports_thinking"] is True


def test_model_pass_with_weights_on_fake_gpus(model_copy, tmp_path, monkeypatch):
    gpu_env(monkeypatch, tmp_path)
    add_weights(model_copy, 64 << 30)  # 64 GiB: 32 GiB per GPU at tp 2 on 140 GiB H200s
    ctx = config_context(tmp_path, model_copy, [], tp_size=2)
    res = run_local(ctx, {"model.dir", "model.weights", "gpu.nvidia_smi"})
    r = res["model.weights"]
    assert r.status is Status.PASS, r.summary
    assert r.summary == f"weights 64.0 GiB in 1 file(s) at {model_copy} (32.0 GiB/GPU at tp 2 of 140.4 GiB)"
    assert r.data["fit"]["source"] == "gpu.nvidia_smi"
    m = res["model.dir"]
    assert m.status is Status.PASS, m.summary
    assert m.summary.startswith(f"Qwen3ForCausalLM at {model_copy}: context ")
    assert "chat template from tokenizer_config.json, thinking yes" in m.summary or \
        "chat template from chat_template.jinja, thinking yes" in m.summary


def test_model_too_big_for_tp_fails_and_unknown_gpu_warns(model_copy, tmp_path, monkeypatch):
    add_weights(model_copy, 300 << 30)
    ctx = config_context(tmp_path, model_copy, [], tp_size=1, gpus=(0,))
    r = run_local(ctx, {"model.weights"})["model.weights"]  # this machine: no GPU facts
    assert r.status is Status.WARN
    assert "cannot check the fit on the GPUs" in r.summary
    gpu_env(monkeypatch, tmp_path)
    r = run_local(ctx, {"model.weights", "gpu.nvidia_smi"})["model.weights"]
    assert r.status is Status.FAIL
    assert "weights 300.0 GiB / tp 1 = 300.0 GiB per GPU exceed the GPU memory 140.4 GiB" in r.summary
    assert r.remedy == "raise workers.tp_size"


def test_model_missing_dir_and_missing_template_and_shards(model_copy, tmp_path):
    missing = tmp_path / "nope" / "Qwen3-32B"
    res = run_local(config_context(tmp_path, missing, []), {"model.dir", "model.weights"})
    r = res["model.dir"]
    assert r.status is Status.FAIL
    assert r.summary == f"model dir {missing}: [Errno 2] No such file or directory: '{missing}'"
    w = res["model.weights"]  # one cause, one FAIL: the weights probe points at model.dir
    assert w.status is Status.SKIP
    assert w.summary == f"no model dir to look in (see model.dir: [Errno 2] No such file or directory: '{missing}')"

    tok_cfg = json.loads((model_copy / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (model_copy / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    for name in ("chat_template.jinja", "chat_template.json"):
        if (model_copy / name).exists():
            (model_copy / name).unlink()
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 1000}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                          "b": "model-00002-of-00002.safetensors"}}))
    res = run_local(config_context(tmp_path, model_copy, []), {"model.dir", "model.weights"})
    assert res["model.dir"].status is Status.FAIL
    assert "no chat template in" in res["model.dir"].summary
    assert res["model.weights"].status is Status.FAIL
    assert "names 2 missing shard file(s)" in res["model.weights"].summary


# ---------------------------------------------------------------------------------------------- prompts


def test_prompt_paths_pass_and_glob(tiny_model_dir, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "a.jsonl", [sharegpt(i) for i in range(3)])
    write_jsonl(data / "b.jsonl", [openai(i) for i in range(2)])
    r = run_local(config_context(tmp_path, tiny_model_dir, [str(data / "*.jsonl")]), {"prompts.paths"})["prompts.paths"]
    assert r.status is Status.PASS
    assert r.summary.startswith("2 file(s)")
    assert [f["path"] for f in r.data["files"]] == [str(data / "a.jsonl"), str(data / "b.jsonl")]


def test_missing_prompts_file_names_path_error_and_candidates(tiny_model_dir, tmp_path):
    data = tmp_path / "datasets" / "sharegpt"
    data.mkdir(parents=True)
    write_jsonl(data / "sharegpt_train.jsonl", [sharegpt(0)])
    write_jsonl(tmp_path / "datasets" / "other.parquet.jsonl", [sharegpt(0)])
    (tmp_path / "datasets" / "notes.txt").write_text("not a prompt file")
    wanted = tmp_path / "datasets" / "sharegpt" / "sharegpt_train_v2.jsonl"
    ctx = config_context(tmp_path, tiny_model_dir, [str(wanted)], run_dir=str(tmp_path / "datasets"))
    res = run_local(ctx)
    r = res["prompts.paths"]
    assert r.status is Status.FAIL
    assert f"[Errno 2] No such file or directory: '{wanted}'" in r.summary
    assert str(wanted) in r.summary
    cands = r.data["candidates"]["files"]
    assert cands[0]["path"] == str(data / "sharegpt_train.jsonl")  # the most similar name first
    assert cands[0]["size"] > 0
    assert all(not c["path"].endswith(".txt") for c in cands)
    assert str(data) in r.data["candidates"]["searched"]
    assert "candidates, best first:" in r.actual
    assert res["prompts.format"].status is Status.SKIP
    assert res["prompts.format"].summary == "needs prompts.paths, which is FAIL"


def test_prompt_glob_matching_nothing_and_directory(tiny_model_dir, tmp_path):
    (tmp_path / "d").mkdir()
    ctx = config_context(tmp_path, tiny_model_dir, [str(tmp_path / "d" / "*.jsonl"), str(tmp_path / "d")])
    r = run_local(ctx, {"prompts.paths"})["prompts.paths"]
    assert r.status is Status.FAIL
    assert "glob matched no files" in r.summary
    assert "is a directory (use a glob such as" in r.summary
    assert f"[Errno 21] Is a directory: '{tmp_path / 'd'}'" in r.summary


def test_prompt_format_shapes_sources_and_answers(tiny_model_dir, tmp_path):
    write_jsonl(tmp_path / "sg.jsonl", [sharegpt(i, turns=2) for i in range(4)])
    (tmp_path / "oa.json").write_text(json.dumps([openai(i) for i in range(3)]))
    table = pa.table({"id": ["p0", "p1"], "prompt": ["hello there", "write a poem"]})
    pq.write_table(table, tmp_path / "pq.parquet")
    ctx = config_context(tmp_path, tiny_model_dir, [str(tmp_path / "sg.jsonl"), str(tmp_path / "oa.json"),
                                                    str(tmp_path / "pq.parquet")])
    r = run_local(ctx, {"prompts.format"})["prompts.format"]
    assert r.status is Status.PASS, r.summary
    d = r.data
    assert d["rows"] == 9 and d["good"] == 9
    assert d["shapes"] == {"sharegpt (conversations)": 4, "openai (messages)": 3, "prompt": 2}
    assert d["by_source"] == {"sg.jsonl": 4, "oa-src": 3, "pq.parquet": 2}
    assert abs(d["assistant_share"] - 4 / 9) < 1e-9
    formats = {os.path.basename(f["path"]): f["format"] for f in d["files"]}
    assert formats == {"sg.jsonl": "jsonl", "oa.json": "json", "pq.parquet": "parquet"}


def test_malformed_rows_reported_with_file_and_line(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = [
        json.dumps(sharegpt(0)).encode(),
        b'{"conversations": [{"from": "human", "value": "hi"}',  # line 2: bad JSON
        json.dumps({"text": "no conversation here"}).encode(),  # line 3: wrong shape
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',  # line 4: invalid UTF-8 (latin-1 byte)
        json.dumps({"messages": []}).encode(),  # line 5: empty conversation
        json.dumps({"messages": [{"role": "narrator", "content": "x"}]}).encode(),  # line 6: unknown role
        json.dumps(openai(7)).encode(),
    ]
    bad.write_bytes(b"\n".join(lines) + b"\n")
    r = run_local(config_context(tmp_path, tiny_model_dir, [str(bad)]), {"prompts.format"})["prompts.format"]
    assert r.status is Status.WARN
    where = {m["where"]: m for m in r.data["malformed"]}
    assert where[f"{bad}:2"]["kind"] == "malformed_json"
    assert where[f"{bad}:2"]["reason"].startswith("malformed JSON: Expecting ")
    assert where[f"{bad}:3"]["reason"].startswith("no conversation: expected 'messages', 'conversations'")
    at = lines[3].index(b"\xe9")
    assert where[f"{bad}:4"]["reason"] == f"invalid UTF-8 at byte {at}: invalid continuation byte"
    assert where[f"{bad}:5"]["reason"] == "empty conversation"
    assert where[f"{bad}:6"]["kind"] == "unknown_role"
    assert r.data["good"] == 2 and r.data["malformed_count"] == 5
    assert f"{bad}:2: malformed JSON" in r.actual
    assert r.summary.startswith("5 malformed row(s) of the 7 read, e.g. ")


def test_malformed_reasons_match_the_engine_reader(tiny_model_dir, tmp_path):
    """The probe's copy of the row rules and engine/text/ingest.py reject the same lines for the same kinds."""
    from engine.text.ingest import iter_prompts
    from engine.text.row_errors import Reject

    bad = tmp_path / "mixed.jsonl"
    rows = [sharegpt(0), {"text": "x"}, {"messages": []}, {"messages": [{"role": "assistant", "content": "a"}]},
            {"messages": [{"role": "user", "content": {"x": 1}}]}, {"prompt": "  "}, openai(1), [1, 2]]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{not json\n")
    engine = {r.line: r.category for r in iter_prompts([str(bad)]) if isinstance(r, Reject)}
    r = run_local(config_context(tmp_path, tiny_model_dir, [str(bad)]), {"prompts.format"})["prompts.format"]
    probe = {int(m["where"].rsplit(":", 1)[1]): m["kind"] for m in r.data["malformed"]}
    assert probe == engine


def test_file_with_no_good_rows_fails(tiny_model_dir, tmp_path):
    bad = write_jsonl(tmp_path / "wrong.jsonl", [{"question": "q", "answer": "a"}] * 3)
    r = run_local(config_context(tmp_path, tiny_model_dir, [str(bad)]), {"prompts.format"})["prompts.format"]
    assert r.status is Status.FAIL
    assert f"{bad}: none of the 3 rows read is a usable conversation (first: {bad}:1: no conversation" in r.summary


def test_prompt_tokens_through_the_chat_template(model_copy, tmp_path, tiny_tokenizer):
    add_weights(model_copy)
    f = write_jsonl(tmp_path / "p.jsonl", [sharegpt(i) for i in range(20)])
    ctx = config_context(tmp_path, model_copy, [str(f)], max_new_tokens=256)
    r = run_local(ctx, {"prompts.tokens"})["prompts.tokens"]
    assert r.status in (Status.PASS, Status.WARN), r.summary
    # the same number through transformers here: the last user turn, generation prompt, thinking on
    msgs = [{"role": "user", "content": "question 0.0: explain caching"}]
    text = tiny_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    expected = len(tiny_tokenizer.encode(text, add_special_tokens=False))
    assert r.data["max"] >= expected and r.data["count"] == 20
    assert f"prompt tokens p50 {r.data['p50']} / p90" in r.summary
    assert r.data["context_length"]


def test_prompt_tokens_run_without_weights_and_skip_without_tokenizer(tiny_model_dir, model_copy, tmp_path):
    # weights still downloading: the tokenizer and template are what prompt lengths depend on (issue 13, case 7)
    f = write_jsonl(tmp_path / "p.jsonl", [sharegpt(i) for i in range(4)])
    res = run_local(config_context(tmp_path, tiny_model_dir, [str(f)]), {"prompts.tokens", "model.weights"})
    assert res["model.weights"].status is Status.FAIL  # the tiny model has no weights
    assert res["model.dir"].status is Status.PASS
    r = res["prompts.tokens"]
    assert r.status is Status.PASS, r.summary
    assert r.summary.startswith("prompt tokens p50 ") and "over 4 rows" in r.summary
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        if (model_copy / name).exists():
            (model_copy / name).unlink()
    res = run_local(config_context(tmp_path, model_copy, [str(f)]), {"prompts.tokens"})
    assert res["model.dir"].status is Status.FAIL
    assert f"no tokenizer files in {model_copy}" in res["model.dir"].summary
    assert res["prompts.tokens"].status is Status.SKIP
    assert res["prompts.tokens"].summary == "needs model.dir, which is FAIL"


def test_prompt_tokens_over_context_warns(model_copy, tmp_path):
    add_weights(model_copy)
    f = write_jsonl(tmp_path / "p.jsonl", [sharegpt(i) for i in range(5)])
    ctx = config_context(tmp_path, model_copy, [str(f)], context_length=8, max_new_tokens=4)
    r = run_local(ctx, {"prompts.tokens"})["prompts.tokens"]
    assert r.status is Status.FAIL
    assert "half the prompts are over SGLang's input limit 2 (context 8; p50 " in r.summary


# ---------------------------------------------------------------------------------------------- ports


def test_ports_free_and_busy_with_holder(tiny_model_dir, tmp_path):
    busy = free_port_base(2)  # the next port must be free too: an ephemeral port (0) may have a taken neighbour
    with socket.socket() as s:
        s.bind(("127.0.0.1", busy))
        s.listen()
        ctx = config_context(tmp_path, tiny_model_dir, [], base_port=busy, gpus=(0, 1))
        r = run_local(ctx, {"ports"})["ports"]
        assert r.status is Status.FAIL
        assert f"port {busy} on 127.0.0.1 is busy ([Errno 98] Address already in use); held by pid {os.getpid()}" \
            in r.summary
        assert len(r.data["ports"]) == 2
    free_ctx = dataclasses.replace(ctx, base_port=busy)
    r = run_local(free_ctx, {"ports"})["ports"]
    assert r.status is Status.PASS, r.summary
    assert r.summary == f"ports {busy}..{busy + 1} free on 127.0.0.1"


# ---------------------------------------------------------------------------------------------- run_dir.resume


def _run_config(tmp_path, model, prompts, **sampling):
    from engine.config.load import config_from_dict

    return config_from_dict({"run_dir": str(tmp_path / "run"), "model": str(model), "prompts": prompts,
                             "sampling": sampling})


def test_a_live_supervisor_fails_a_start_but_is_this_runs_own_for_the_console_attached_to_it(tiny_model_dir, tmp_path):
    """`regen start` on a run dir a supervisor runs: FAIL (a rival). The TUI attached to that run asks the same probe
    (ctx.attached): the supervisor is the run's own, PASS, with its pid."""
    import os

    from console.host.preflight import context_from_config
    from engine.store.run_dir import prepare_run_dir

    cfg = _run_config(tmp_path, tiny_model_dir, [str(tmp_path / "p.jsonl")])
    prepare_run_dir(cfg)
    (tmp_path / "run" / "supervisor.pid").write_text(f"{os.getpid()}\n")  # a live process: this test's
    ctx = dataclasses.replace(context_from_config(cfg), python=config_context(tmp_path, tiny_model_dir, []).python)
    rival = run_local(ctx, {"run_dir.resume"})["run_dir.resume"]
    assert rival.status is Status.FAIL and f"a supervisor (pid {os.getpid()}) already runs this run dir" in rival.summary
    own = run_local(dataclasses.replace(ctx, attached=True), {"run_dir.resume"})["run_dir.resume"]
    assert own.status is Status.PASS and own.data["mode"] == "live"
    assert own.summary == f"live: this run's supervisor (pid {os.getpid()}) runs it; 0 samples committed"


def test_resume_new_resumable_and_changed(tiny_model_dir, tmp_path):
    from console.commands.probe import context_from_config
    from engine.store.run_dir import prepare_run_dir
    from engine.store.shard_store import ShardStore
    from tests.test_shard_store import make_row

    prompts = [str(tmp_path / "p.jsonl")]
    cfg = _run_config(tmp_path, tiny_model_dir, prompts)
    ctx = dataclasses.replace(context_from_config(cfg), python=config_context(tmp_path, tiny_model_dir, []).python)
    r = run_local(ctx, {"run_dir.resume"})["run_dir.resume"]
    assert r.status is Status.PASS and r.summary == f"new run: {tmp_path / 'run'} does not exist yet"

    prepare_run_dir(cfg)
    r = run_local(ctx, {"run_dir.resume"})["run_dir.resume"]
    assert r.status is Status.PASS
    assert r.summary.startswith(f"resumable: {tmp_path / 'run'} was started with the same content")
    assert r.data["mode"] == "resume"

    with ShardStore(tmp_path / "run") as store:  # data made under the old values (none: a change is accepted)
        store.ensure_shards({"s00000": 1})
        store.commit("s00000", [make_row("a")])
    changed = context_from_config(_run_config(tmp_path, tiny_model_dir, prompts, temperature=0.7))
    changed = dataclasses.replace(changed, python=ctx.python)
    r = run_local(changed, {"run_dir.resume"})["run_dir.resume"]
    assert r.status is Status.FAIL
    assert "not resumable" in r.summary and "sampling.temperature 0.6 -> 0.7" in r.summary


def test_resume_refuses_foreign_non_empty_dir(tiny_model_dir, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "thesis.pdf").write_text("x")
    r = run_local(config_context(tmp_path, tiny_model_dir, []), {"run_dir.resume"})["run_dir.resume"]
    assert r.status is Status.FAIL
    assert "is not empty and is not a regen run dir" in r.summary and "thesis.pdf" in r.summary


# ---------------------------------------------------------------------------------------------- disk.run_dir


def test_disk_run_dir_nearest_parent_and_estimate(tiny_model_dir, tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [sharegpt(i) for i in range(50)])
    ctx = config_context(tmp_path, tiny_model_dir, [str(f)], run_dir=str(tmp_path / "a" / "b" / "run"))
    res = run_local(ctx, {"disk.run_dir", "prompts.format"})
    r = res["disk.run_dir"]
    assert r.status is Status.PASS, r.summary
    assert r.data["path"] == str(tmp_path)  # nearest existing parent
    assert "estimate: 50 rows x 1.00 turns" in r.data["need_basis"]
    huge = dataclasses.replace(ctx, disk_need_bytes=10**18)
    r = run_local(huge, {"disk.run_dir"})["disk.run_dir"]
    assert r.status is Status.FAIL and "below the need of" in r.summary


def test_json_array_and_parquet_malformed_rows(tiny_model_dir, tmp_path):
    arr = tmp_path / "arr.json"
    arr.write_text('[' + json.dumps(openai(0)) + ', {"messages": "not a list"}, ' + json.dumps(openai(2)) + ', {"mess')
    table = pa.table({"id": ["a", "b"], "messages": [[{"role": "user", "content": "hi"}], []]})
    pq.write_table(table, tmp_path / "t.parquet")
    ctx = config_context(tmp_path, tiny_model_dir, [str(arr), str(tmp_path / "t.parquet")])
    r = run_local(ctx, {"prompts.format"})["prompts.format"]
    assert r.status is Status.WARN
    where = {m["where"]: m for m in r.data["malformed"]}
    assert where[f"{arr}:row1"]["reason"] == "'messages' is not a list (a JSON string)"
    assert where[f"{arr}:row3"]["kind"] == "malformed_json"
    assert "reading of this file stopped here" in where[f"{arr}:row3"]["reason"]
    assert where[f"{tmp_path / 't.parquet'}:row1"]["reason"] == "empty conversation"
    assert r.data["good"] == 3


def test_gzipped_jsonl_is_read_to_its_end(tiny_model_dir, tmp_path):
    import gzip

    path = tmp_path / "big.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for i in range(300):
            f.write(json.dumps(sharegpt(i)) + "\n")
    ctx = config_context(tmp_path, tiny_model_dir, [str(path)], sample_rows=50)
    r = run_local(ctx, {"prompts.format"})["prompts.format"]
    assert r.status is Status.PASS, r.summary
    assert r.data["read"] == 300 and r.data["rows"] == 300 and r.data["complete"]  # every row, not a sample
    assert r.summary.startswith("read 300 of 300 rows (every row) in 1 file(s)")


def test_missing_host_libraries_fail_with_their_import_error(model_copy, tmp_path, monkeypatch):
    """A host env whose transformers / pyarrow cannot be imported: the probes say so in the library's words."""
    add_weights(model_copy)
    broken = tmp_path / "broken"
    (broken / "pyarrow").mkdir(parents=True)
    (broken / "pyarrow" / "__init__.py").write_text("raise ImportError('libarrow.so.2600: cannot open shared object file')\n")
    (broken / "transformers.py").write_text("raise ModuleNotFoundError(\"No module named 'transformers'\")\n")
    monkeypatch.setenv("PYTHONPATH", str(broken))
    pq.write_table(pa.table({"prompt": ["hi"]}), tmp_path / "t.parquet")
    jl = write_jsonl(tmp_path / "p.jsonl", [sharegpt(0)])
    ctx = config_context(tmp_path, model_copy, [str(tmp_path / "t.parquet")])
    r = run_local(ctx, {"prompts.format"})["prompts.format"]
    assert r.status is Status.FAIL
    assert r.summary == (f"{tmp_path / 't.parquet'}: cannot read Parquet without pyarrow: "
                         "ImportError: libarrow.so.2600: cannot open shared object file")
    ctx = config_context(tmp_path, model_copy, [str(jl)])
    r = run_local(ctx, {"prompts.tokens"})["prompts.tokens"]
    assert r.status is Status.FAIL
    assert r.summary == "cannot import transformers: ModuleNotFoundError: No module named 'transformers'"
    assert "install transformers" in r.remedy


def test_empty_prompt_file_is_named(tiny_model_dir, tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [sharegpt(0)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = run_local(config_context(tmp_path, tiny_model_dir, [str(good), str(empty)]), {"prompts.format"})["prompts.format"]
    assert r.status is Status.WARN
    assert r.summary == f"{empty}: the file is empty (0 bytes, no rows)"
    r = run_local(config_context(tmp_path, tiny_model_dir, [str(empty)]), {"prompts.format"})["prompts.format"]
    assert r.status is Status.FAIL
    assert "no usable conversation in any prompt file" in r.summary


def test_long_answers_cut_warning_and_separate_tokenizer_dir(model_copy, tiny_model_dir, tmp_path):
    add_weights(model_copy)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model_copy / name).unlink(missing_ok=True)
    f = write_jsonl(tmp_path / "p.jsonl", [sharegpt(i) for i in range(5)])
    ctx = config_context(tmp_path, model_copy, [str(f)], tokenizer=str(tiny_model_dir), context_length=4096,
                         max_new_tokens=4090)
    res = run_local(ctx, {"prompts.tokens"})
    assert res["model.dir"].data["tokenizer_path"] == str(tiny_model_dir)
    r = res["prompts.tokens"]
    assert r.status is Status.WARN
    assert f"+ max_new_tokens 4090 > context 4096: long answers will be cut" in r.summary


# ---------------------------------------------------------------------------------------------- sampling.seed


def fake_sglang(root, *, seed_field: bool, flag: bool):
    """An sglang package tree with only the two source files the probe reads (it never imports sglang)."""
    pkg = root / "sglang"
    (pkg / "srt" / "sampling").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the seed probe must not import sglang')\n")
    (pkg / "srt" / "sampling" / "sampling_params.py").write_text(
        "class SamplingParams:\n    def __init__(self, max_new_tokens=128" + (", sampling_seed=None" if seed_field else "")
        + "):\n        pass\n")
    (pkg / "srt" / "server_args.py").write_text(
        "class ServerArgs:\n    random_seed = None\n" + ("    enable_deterministic_inference = False\n" if flag else ""))
    return root


FLAG = "--enable-deterministic-inference"


def test_seed_probe_passes_with_the_flag_and_an_sglang_that_takes_the_seed(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(fake_sglang(tmp_path / "libs", seed_field=True, flag=True)))
    ctx = config_context(tmp_path, tiny_model_dir, [], sampling_seed=7, launch_args=(FLAG,))
    r = run_local(ctx, {"sampling.seed"})["sampling.seed"]
    assert r.status is Status.PASS, r.summary
    assert "sampling.seed = 7 is honoured" in r.summary


def test_seed_probe_warns_when_the_servers_will_ignore_the_seed(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(fake_sglang(tmp_path / "libs", seed_field=True, flag=True)))
    ctx = config_context(tmp_path, tiny_model_dir, [], sampling_seed=7, launch_args=("--log-level", "debug"))
    r = run_local(ctx, {"sampling.seed"})["sampling.seed"]
    assert r.status is Status.WARN
    assert "the servers will ignore sampling.seed = 7" in r.summary
    assert f'add "{FLAG}" to workers.extra_args' in r.remedy and "remove sampling.seed" in r.remedy


def test_seed_probe_fails_on_an_sglang_without_sampling_seed(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(fake_sglang(tmp_path / "libs", seed_field=False, flag=False)))
    ctx = config_context(tmp_path, tiny_model_dir, [], sampling_seed=7, launch_args=(FLAG,))
    r = run_local(ctx, {"sampling.seed"})["sampling.seed"]
    assert r.status is Status.FAIL
    assert "SamplingParams has no sampling_seed" in r.summary and "HTTP 500" in r.summary
    assert "remove sampling.seed" in r.remedy


def test_seed_probe_runs_only_with_a_seed_and_skips_in_a_rehearsal(tiny_model_dir, tmp_path):
    from probes.catalog import probes_for

    assert "sampling.seed" not in [p.id for p in probes_for(config_context(tmp_path, tiny_model_dir, []))]
    ctx = config_context(tmp_path, tiny_model_dir, [], sampling_seed=7, launch_args=(FLAG,),
                         launch="{python} -m engine.simulator --model-path {model} --port {port}")
    r = run_local(ctx, {"sampling.seed"})["sampling.seed"]
    assert r.status is Status.SKIP and "rehearsal" in r.summary


def test_seed_probe_is_asked_of_gpu_hosts_only_when_a_seed_is_set(tiny_model_dir, tmp_path):
    from console.commands.probe import GPU_HOST_PROBES
    from probes.catalog import UnknownProbe, probes_for

    without = config_context(tmp_path, tiny_model_dir, [])
    assert "sampling.seed" not in [p.id for p in probes_for(without, set(GPU_HOST_PROBES))]
    seeded = dataclasses.replace(without, sampling_seed=7)
    assert "sampling.seed" in [p.id for p in probes_for(seeded, set(GPU_HOST_PROBES))]
    try:
        probes_for(without, {"sampling.seed"})
    except UnknownProbe as exc:
        assert "nothing to check for this run config" in str(exc)
    else:
        raise AssertionError("--only sampling.seed without a seed ran nothing and said nothing")
