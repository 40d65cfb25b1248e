import pytest

from engine.config.load import ConfigError, changed_content_fields, config_from_dict, dump_toml, load_config


def base(**kw):
    d = {"run_dir": "/tmp/r", "model": "/m", "prompts": ["/p/*.jsonl"]}
    d.update(kw)
    return d


def test_defaults_are_qwen3_thinking():
    cfg = config_from_dict(base())
    s = cfg.sampling.as_sglang()
    assert (s["temperature"], s["top_p"], s["top_k"], s["min_p"], s["max_new_tokens"]) == (0.6, 0.95, 20, 0.0, 32768)
    assert cfg.workers.host == "127.0.0.1"


def test_roundtrip_toml(tmp_path):
    cfg = config_from_dict(base(workers={"gpus": [0, 1, 2, 3], "tp_size": 2}, sampling={"temperature": 0.7}))
    p = tmp_path / "run.toml"
    p.write_text(dump_toml(cfg))
    again = load_config(p)
    assert again.content_hash() == cfg.content_hash()
    assert again.workers.groups() == [(0, 1), (2, 3)]


def test_changed_fields_named():
    a = config_from_dict(base())
    b = config_from_dict(base(sampling={"temperature": 0.1}, shard_size=7, dispatch={"max_retries": 9}))
    assert changed_content_fields(a.content_fields(), b.content_fields()) == ["sampling.temperature", "shard_size"]


@pytest.mark.parametrize(
    "data,needle",
    [
        ({"model": "/m", "prompts": ["x"]}, "run_dir: is required and missing"),
        (base(turns="some"), "turns: \"some\": must be one of 'all', 'last' or 'first'"),
        (base(bogus=1), "bogus: unknown key"),
        (base(workers={"gpus": [0, 1, 2], "tp_size": 2}), "not a multiple"),
        # SGLang's /health takes >= 1 s (contract 7.4): a 1 s wait would kill every healthy server as hung
        (base(workers={"health_timeout_s": 1.0}), "[workers] health_timeout_s: 1.0: must be > 1"),
    ],
)
def test_bad_configs(data, needle):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert needle in str(e.value)


def test_unreadable_config_names_path(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "nope.toml")
    assert "nope.toml" in str(e.value) and "No such file" in str(e.value)


def test_tiny_model_template(tiny_tokenizer):
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nr1\n</think>\n\na1"},
        {"role": "user", "content": "q2"},
    ]
    text = tiny_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert "r1" not in text  # earlier turns' reasoning is dropped
    assert text.endswith("<|im_start|>assistant\n")
    off = tiny_tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")


def test_a_seed_without_deterministic_inference_is_refused_naming_both_fixes(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('run_dir = "/tmp/r"\nmodel = "/m"\nprompts = ["/p/*.jsonl"]\n\n[sampling]\nseed = 7\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "[sampling] seed: 7" in msg and "ignores" in msg
    assert 'workers.extra_args = [..., "--enable-deterministic-inference"]' in msg and "remove sampling.seed" in msg


@pytest.mark.parametrize("workers", [
    {"extra_args": ["--log-level", "debug", "--enable-deterministic-inference"]},
    {"launch": "{python} -m sglang.launch_server --model-path {model} --host {host} --port {port} --tp-size {tp}"
               " --enable-metrics --enable-deterministic-inference"},
])
def test_a_seed_with_the_flag_in_the_launch_line_or_extra_args_is_sent(workers):
    cfg = config_from_dict(base(sampling={"seed": 7}, workers=workers))
    assert cfg.sampling.as_sglang()["sampling_seed"] == 7
    assert "sampling_seed" not in config_from_dict(base(workers=workers)).sampling.as_sglang()
