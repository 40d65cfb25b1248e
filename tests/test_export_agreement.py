"""Honest text formats: each text export reports how many rows re-tokenize to the stored ids with the model's own
template and what differs by kind; and docs/export.md's trainer advice, checked against SpecForge's template definitions
(recorded below as facts, read from its repository), reproduces the stored prompt ids where it says it does."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from console.cli import main as cli_main
from engine.text.render import Renderer
from tests.history_fixtures import answered_run
from tests.test_history_as_seen import DEFECT

pytestmark = pytest.mark.timeout(120)
EXPORT_DOC = Path(__file__).resolve().parents[1] / "docs" / "export.md"
KEEP_ALL = ("--keep", "length,thinking,empty", "--min-supervised", "0")


def _export(run_dir, out, fmt, capsys, *extra) -> tuple[str, dict]:
    assert cli_main(["export", str(run_dir), "--format", fmt, "--out", str(out), *extra]) == 0
    said = " ".join(capsys.readouterr().out.split())
    return said, json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize("fmt", ["conversations-jsonl", "messages-jsonl", "messages-parquet"])
def test_a_text_export_says_how_many_rows_re_tokenize_to_the_stored_ids(family_model_dir, tmp_path, capsys, fmt):
    run_dir, rows = answered_run(tmp_path, family_model_dir, DEFECT)
    said, manifest = _export(run_dir, tmp_path / "out", fmt, capsys, *KEEP_ALL)
    a = manifest["agreement"]
    n = len(rows)
    assert a["checked"] == n
    assert f"re-tokenized with the model's chat template: {a['exact']:,} of {n:,} rows give the stored ids exactly" \
        in said
    differ = a["differ"]
    # the history is the model's: the prompt text always comes back (its last token may merge with the answer's)
    assert "prompt" not in differ
    assert a["prompt_exact"] + differ.get("boundary", 0) == n
    cut = sum(r["finish_reason"] == "length" for r in rows.values())
    assert differ["end_added"] == cut, "every cut answer is closed by the template, and counted"
    assert differ["after_end"] == n - cut, "Qwen's templates write \\n after <|im_end|>: every finished row"
    assert a["exact"] == 0  # so no Qwen-family text row gives the stored ids back: the token formats do
    for kind, count in differ.items():
        assert f"{count:,} rows: {a['kinds'][kind]}" in said


def test_token_formats_carry_the_ids_and_report_no_agreement(tiny_model_dir, tmp_path, capsys):
    run_dir, _ = answered_run(tmp_path, tiny_model_dir, DEFECT)
    said, manifest = _export(run_dir, tmp_path / "tok", "tokens-jsonl", capsys, *KEEP_ALL)
    assert manifest["agreement"] == {} and "re-tokenized" not in said


# --- SpecForge, as its repository defines it (sgl-project/SpecForge specforge/data/template.py and parse.py) --------
# Facts, not code: a conversations file (`data.train_data_path`) is rendered with the MODEL's own chat template
# (tokenizer.apply_chat_template(messages, add_generation_prompt=False), enable_thinking=True for the thinking
# parser), after a system message with the registry entry's system_prompt is put first when the conversation has
# none and the prompt is not empty; the thinking parser keeps role, content, tool_calls and reasoning_content; the
# loss mask is a regex from the entry's assistant_header to its end_of_turn_token, so supervision starts right
# after the header.
SPECFORGE_TEMPLATES = {
    "qwen3.5": {"assistant_header": "<|im_start|>assistant\n<think>\n", "system_prompt": "",
                "end_of_turn_token": "<|im_end|>\n", "parser": "thinking", "enable_thinking": True},
    "qwen3-thinking": {"assistant_header": "<|im_start|>assistant\n", "system_prompt": "You are a helpful assistant.",
                       "end_of_turn_token": "<|im_end|>\n", "parser": "thinking", "enable_thinking": True},
    "qwen3-next-thinking": {"assistant_header": "<|im_start|>assistant\n<think>\n",
                            "system_prompt": "You are a helpful assistant.", "end_of_turn_token": "<|im_end|>\n",
                            "parser": "thinking", "enable_thinking": True},
    # not in SpecForge's registry: qwen3-thinking's fields without its system prompt, registered by the user
    # (TEMPLATE_REGISTRY.register("qwen3-regen", ChatTemplate(...))): what a plain Qwen3 model needs
    "custom: qwen3-thinking, system_prompt None": {"assistant_header": "<|im_start|>assistant\n", "system_prompt": None,
                                                   "end_of_turn_token": "<|im_end|>\n", "parser": "thinking",
                                                   "enable_thinking": True},
}

# per template family and SpecForge template: (the unsupervised part is the stored prompt, every generated token is
# supervised); docs/export.md's table says the same
EXPECTED = {
    ("qwen3", "qwen3.5"): (False, False),  # the header swallows the <think>\n the model generated: not supervised
    ("qwen3", "qwen3-thinking"): (False, True),  # a system prompt the model never saw
    ("qwen3", "qwen3-next-thinking"): (False, False),
    ("qwen3", "custom: qwen3-thinking, system_prompt None"): (True, True),
    ("qwen3.5", "qwen3.5"): (True, True),  # the advised one: <think>\n is the prompt's
    ("qwen3.5", "qwen3-thinking"): (False, True),
    ("qwen3.5", "qwen3-next-thinking"): (False, True),
    ("qwen3.5", "custom: qwen3-thinking, system_prompt None"): (False, True),  # the prompt's <think>\n supervised
}


def specforge_prefix(renderer: Renderer, conversation: list[dict], template: dict) -> str:
    """The rendered text SpecForge leaves unsupervised before the last assistant turn's content (its regex's start)."""
    messages = [{k: v for k, v in m.items() if k in ("role", "content", "reasoning_content")} for m in conversation]
    if template["system_prompt"] and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": template["system_prompt"]}, *messages]
    text = renderer.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                                  enable_thinking=template["enable_thinking"])
    start = text.rfind(template["assistant_header"])
    assert start >= 0, "SpecForge's regex finds the assistant turn"
    return text[:start + len(template["assistant_header"])]


@pytest.mark.parametrize("template", list(SPECFORGE_TEMPLATES))
def test_specforge_templates_reproduce_the_stored_prompt_where_the_export_doc_says(family_model_dir, tmp_path, template):
    family = "qwen3.5" if "3.5" in family_model_dir.name else "qwen3"
    run_dir, rows = answered_run(tmp_path, family_model_dir, DEFECT)
    assert cli_main(["export", str(run_dir), "--format", "conversations-jsonl", "--out", str(tmp_path / "c")]) == 0
    renderer = Renderer(str(family_model_dir), enable_thinking=True)
    exported = [json.loads(line) for line in (tmp_path / "c" / "conversations.jsonl").read_text().splitlines()]
    assert exported
    prompt_ok = gen_ok = True
    for r in exported:
        row = rows[r["id"]]
        prefix = specforge_prefix(renderer, r["conversations"], SPECFORGE_TEMPLATES[template])
        stored_prompt = renderer.decode(row["input_ids"][:row["prompt_len"]])
        prompt_ok &= renderer.tokenizer(prefix, add_special_tokens=False).input_ids == row["input_ids"][:row["prompt_len"]]
        # every generated token supervised: SpecForge's unsupervised tail (after the last user turn) is no longer
        # than the stored prompt's generation prompt
        eot = "<|im_end|>\n"
        gen_ok &= stored_prompt[stored_prompt.rfind(eot) + len(eot):].startswith(prefix[prefix.rfind(eot) + len(eot):])
    assert (prompt_ok, gen_ok) == EXPECTED[(family, template)]


def test_the_export_doc_gives_the_tested_specforge_setting_per_family():
    text = " ".join(EXPORT_DOC.read_text().split())
    assert "| Qwen3.5 / Qwen3.6 style (the prompt opens `<think>`) | `chat_template: qwen3.5` |" in text
    assert "| Qwen3 (the model opens `<think>`) | `prompts_path` with `tokens-jsonl`" in text
    assert "`qwen3-thinking` puts the system prompt \"You are a helpful assistant.\"" in text
