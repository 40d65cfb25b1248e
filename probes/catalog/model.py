"""Probes of the model directory: config, tokenizer, chat template, and whether its weights fit the GPUs.
"""
from __future__ import annotations

from typing import Any

from probes.catalog.gpu import gpu_memory_mib
from probes.catalog.output import (
    ScriptOutputError,
    gib,
    python_command,
    script_error_verdict,
    script_json,
    size_text,
)
from probes.catalog.probe import Findings, JudgeInput, Verdict
from probes.context import (
    ProbeContext,
)
from probes.model import CommandResult, Status

KV_HEADROOM = 0.85  # weights above this share of a GPU leave too little room for the KV cache


# ---------------------------------------------------------------------------------------------- model


def model_info(res: CommandResult) -> dict:
    return script_json(res, "model dir")


def missing_model_verdict(model: dict, expected: str, data: dict) -> Verdict:
    searched = model.get("hub_cache_searched")
    extra = f"; not in the Hugging Face cache either ({', '.join(searched)})" if searched else ""
    return Verdict(Status.FAIL, f"model dir {model.get('given')}: {model.get('error')}{extra}", expected,
                   model.get("error", ""), remedy="set model in the run config to the model directory on the host",
                   data=data)


def judge_model(res: CommandResult, inp: JudgeInput) -> Verdict:
    """config.json, tokenizer files and the chat template: what rendering prompts needs (weights: model.weights)."""
    try:
        info = model_info(res)
    except ScriptOutputError as exc:
        return script_error_verdict(exc, inp.ctx)
    ctx = inp.ctx
    model, tok = info.get("model", {}), info.get("tokenizer", {})
    path = model.get("path") or model.get("given")
    expected = "config.json, tokenizer files and a chat template"
    data: dict[str, Any] = {"model": model, "tokenizer": tok}
    if "path" not in model:
        return missing_model_verdict(model, expected, data)
    f = Findings()
    if not model.get("is_dir"):
        f.fail(f"model path {path} is not a directory")
        return f.verdict("", expected=expected, data=data)
    if model.get("list_error"):
        f.fail(f"cannot list {path}: {model['list_error']}")
    if model.get("config_error"):
        f.fail(f"{path}/config.json: {model['config_error']}", "the model dir needs the config.json of the model")
    cfg = model.get("config") or {}
    arch = ",".join(cfg.get("architectures") or []) or cfg.get("model_type") or "?"
    if "path" not in tok:
        f.fail(f"tokenizer {tok.get('given')}: {tok.get('error')}")
    elif not tok.get("files"):
        f.fail(f"no tokenizer files in {tok.get('path')} (looked for tokenizer.json, tokenizer_config.json, "
               "vocab.json+merges.txt, tokenizer.model)")
    if "path" in tok and not tok.get("chat_template"):
        f.fail(f"no chat template in {tok.get('path')} (tokenizer_config.json chat_template or chat_template.jinja)"
               + (f": {tok['chat_template_error']}" if tok.get("chat_template_error") else ""),
               "prompts are rendered with the model's own chat template; copy chat_template.jinja from the model repo")
    thinking = tok.get("thinking") or {}
    supports_thinking = bool(thinking.get("enable_thinking") or thinking.get("think_tag"))
    if tok.get("chat_template") and ctx.enable_thinking and not supports_thinking:
        f.warn("enable_thinking is on but the chat template never mentions enable_thinking or <think>")
    context = ctx.context_length or cfg.get("max_position_embeddings")
    if ctx.context_length and cfg.get("max_position_embeddings") and ctx.context_length > cfg["max_position_embeddings"]:
        f.warn(f"context_length {ctx.context_length} is above the model's max_position_embeddings "
               f"{cfg['max_position_embeddings']}")
    data.update(architecture=arch, context_length=context, supports_thinking=supports_thinking,
                chat_template_source=tok.get("chat_template_source"), path=path, tokenizer_path=tok.get("path"))
    summary = (f"{arch} at {path}: context {context}; tokenizer {tok.get('tokenizer_class') or '?'}; chat template "
               f"from {tok.get('chat_template_source')}, thinking {'yes' if supports_thinking else 'no'}")
    actual = (f"architecture {arch}; tokenizer files {tok.get('files')}; chat template {tok.get('chat_template_source')}")
    return f.verdict(summary, expected=expected, actual=actual, data=data)


def judge_weights(res: CommandResult, inp: JudgeInput) -> Verdict:
    """Weights present (every shard the index names) and their fit on the GPUs at tp_size."""
    try:
        info = model_info(res)
    except ScriptOutputError as exc:
        return script_error_verdict(exc, inp.ctx)
    ctx = inp.ctx
    model = info.get("model", {})
    path = model.get("path") or model.get("given")
    expected = f"weights in the model dir that fit the GPUs at tp_size {ctx.tp_size}"
    if "path" not in model or not model.get("is_dir"):
        # model.dir reports the path itself; a second FAIL for the same cause would be noise
        why = f"{path} is not a directory" if "path" in model else model.get("error") or f"{path} not found"
        return Verdict(Status.SKIP, f"no model dir to look in (see model.dir: {why})", expected, data={"model": model})
    f = Findings()
    weights = model.get("weights_bytes") or 0
    index = model.get("index") or {}
    if index.get("missing_shards"):
        f.fail(f"{index['name']} names {len(index['missing_shards'])} missing shard file(s) in {path}: "
               + ", ".join(index["missing_shards"][:5]), "finish downloading the model")
    if index.get("total_size") and not weights:
        weights = int(index["total_size"])
    if not weights:
        f.fail(f"no weights in {path} (no *.safetensors or *.bin files)",
               "download the weights into the model dir (huggingface-cli download MODEL --local-dir DIR)")
    gpus, source = gpu_memory_mib(inp)
    per_gpu = weights / max(1, ctx.tp_size)
    fit = None
    if weights and gpus:
        smallest = min(g["memory_total_mib"] for g in gpus) * (1 << 20)
        fit = {"weights_per_gpu": per_gpu, "gpu_memory": smallest, "share": per_gpu / smallest, "source": source}
        if per_gpu > smallest:
            f.fail(f"weights {gib(weights)} / tp {ctx.tp_size} = {gib(per_gpu)} per GPU exceed the GPU memory "
                   f"{gib(smallest)}", "raise workers.tp_size")
        elif per_gpu > KV_HEADROOM * smallest:
            f.warn(f"weights {gib(per_gpu)} per GPU leave little KV cache room on {gib(smallest)} GPUs",
                   "raise workers.tp_size")
    elif weights:
        why = ", ".join(f"{d} {inp.deps[d].status.value}" if d in inp.deps else f"{d} not run"
                        for d in ("gpu.nvidia_smi", "gpu.nvml"))
        f.warn(f"cannot check the fit on the GPUs: no GPU memory known ({why})")
    files = model.get("weights") or []
    fit_text = f"{gib(per_gpu)}/GPU at tp {ctx.tp_size} of {gib(fit['gpu_memory'])}" if fit else "fit unknown"
    return f.verdict(f"weights {gib(weights)} in {len(files)} file(s) at {path} ({fit_text})", expected=expected,
                     actual=f"weights {size_text(weights)} in {len(files)} file(s)",
                     data={"path": path, "weights": files, "weights_bytes": weights, "index": index, "fit": fit})




def model_dir_command(ctx: ProbeContext) -> str:
    return python_command(ctx, "model_dir", {"model": ctx.model, "tokenizer": ctx.tokenizer_path})
