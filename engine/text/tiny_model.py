"""A small Qwen-style model directory built locally (byte-level BPE tokenizer, chat template, config), for `regen
demo`, the SGLang simulator and the tests: the real transformers loading code runs without downloading anything.

Two chat template families (TEMPLATES): "qwen3" (the model opens `<think>` itself) and "qwen3.5" (the generation
prompt opens it); both drop the reasoning of assistant turns before the last user message, as the real ones do.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]  # added, but not "special" (as in Qwen3)

QWEN3_CHAT_TEMPLATE = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if message.role == "user" or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Qwen3.5/3.6's template, reduced to text messages (no tools, no images): contents are trimmed; an
# assistant turn after the last user message keeps its think block, any earlier one is only its answer;
# the generation prompt opens the think block (closed and empty when enable_thinking is false).
QWEN35_CHAT_TEMPLATE = """{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
    {%- if not ns.found and message.role == "user" %}
        {%- set ns.found = true %}
        {%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content|trim %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if message.role == "user" or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}"""

TEMPLATES = {"qwen3": QWEN3_CHAT_TEMPLATE, "qwen3.5": QWEN35_CHAT_TEMPLATE}

WORDS = (
    "the model answer question reason step first then so because we need to check value "
    "number list function code python return result compute sum product prime even odd "
    "string array loop index error test case input output data file line token length "
    "think about this carefully let me verify again wait actually correct wrong maybe "
    "therefore hence final answer is equals plus minus times divided square root of two "
    "three four five six seven eight nine ten hundred thousand million user asks for a "
    "simple explanation example here how what why when where which who can could should "
    "would will shall must may might be been being have has had do does did make made "
    "write read open close start stop run train model weights layer attention head batch "
    "gpu memory cache speed fast slow quickly good better best bad worse worst ok yes no"
).split()


def corpus(n_sentences: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        k = rng.randint(4, 16)
        words = [rng.choice(WORDS) for _ in range(k)]
        sent = " ".join(words).capitalize() + rng.choice([".", "?", "!", ":", ","])
        if rng.random() < 0.2:
            sent += f" {rng.randint(0, 99999)} = {rng.randint(0, 999)}*{rng.randint(0, 99)}"
        out.append(sent)
    out += ["\n", "\n\n", "<think>\n", "\n</think>\n\n", "OK.", "Hello", "# Title", "```python\n", "```"]
    return out


MODEL_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_hidden_layers": 64,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def build_tiny_model(path: str | os.PathLike, *, template: str = "qwen3", vocab_size: int = 2000,
                     context_length: int = 40960) -> Path:
    """Write a Qwen-style model dir (tokenizer + chat template of the family `template`, config, no
    weights) at `path`.

    Idempotent: an existing complete directory built for the same family is left as is.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if template not in TEMPLATES:
        raise ValueError(f"template family {template!r}: must be one of {', '.join(TEMPLATES)}")
    path = Path(path)
    marker = path / ".regen-tiny-model"
    stamp = f"built by regen's engine.text.tiny_model; tokenizer and config only, no weights\ntemplate={template}\n"
    if marker.exists() and _marker_family(marker.read_text()) == template:
        return path
    path.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=context_length,
        clean_up_tokenization_spaces=False,
    )
    fast.add_tokens(THINK_TOKENS, special_tokens=False)
    fast.chat_template = TEMPLATES[template]
    fast.save_pretrained(str(path))

    eos = [fast.convert_tokens_to_ids("<|im_end|>"), fast.convert_tokens_to_ids("<|endoftext|>")]
    config = dict(MODEL_CONFIG, vocab_size=len(fast), max_position_embeddings=context_length,
                  eos_token_id=eos[0], bos_token_id=eos[1])
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}, indent=2))
    marker.write_text(stamp)
    return path


def _marker_family(text: str) -> str:
    """The family a marker names; markers written before families existed are Qwen3's."""
    for line in text.splitlines():
        if line.startswith("template="):
            return line.split("=", 1)[1]
    return "qwen3"
