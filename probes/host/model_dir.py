# A model directory as SGLang and transformers will read it: config, tokenizer, chat template, weights.
import glob
import json
import os
import re
import sys

args = json.loads(sys.argv[1])
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # engine.config.load.MODEL_SAMPLING_KEYS
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "special_tokens_map.json"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def err(exc):
    return "%s: %s" % (type(exc).__name__, exc)


def resolve(path):
    """A local dir, or a hub id found in the local Hugging Face cache (no network on the host)."""
    path = os.path.expanduser(path)
    info = {"given": path}
    try:
        os.stat(path)
        info["path"] = path
        return info
    except OSError as exc:
        info["error"] = str(exc)
    if HUB_ID.match(path) and not path.startswith(("/", ".")):
        roots = [os.environ.get("HF_HUB_CACHE"), os.path.join(os.environ.get("HF_HOME", ""), "hub") if os.environ.get("HF_HOME") else None,
                 os.path.expanduser("~/.cache/huggingface/hub")]
        searched = []
        for root in [r for r in roots if r]:
            snap_root = os.path.join(root, "models--" + path.replace("/", "--"), "snapshots")
            searched.append(snap_root)
            snaps = sorted(glob.glob(os.path.join(snap_root, "*")), key=os.path.getmtime)
            if snaps:
                info["path"] = snaps[-1]
                info["resolved_from_hub_cache"] = True
                return info
        info["hub_cache_searched"] = searched
    return info


def read_json(path, out, key):
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as exc:
        out[key] = err(exc)
        return None


def describe_model(path):
    out = {"path": path, "is_dir": os.path.isdir(path)}
    if not out["is_dir"]:
        return out
    try:
        entries = sorted(os.listdir(path))
    except OSError as exc:
        out["list_error"] = str(exc)
        return out
    out["entries"] = entries[:200]
    out["entry_count"] = len(entries)
    cfg = read_json(os.path.join(path, "config.json"), out, "config_error")
    if cfg is not None:
        text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
        out["config"] = {
            "architectures": cfg.get("architectures"),
            "model_type": cfg.get("model_type"),
            "max_position_embeddings": cfg.get("max_position_embeddings", text_cfg.get("max_position_embeddings")),
            "torch_dtype": cfg.get("torch_dtype", cfg.get("dtype")),
            "num_hidden_layers": cfg.get("num_hidden_layers", text_cfg.get("num_hidden_layers")),
            "hidden_size": cfg.get("hidden_size", text_cfg.get("hidden_size")),
        }
    # the model's recommended sampling: regen takes it for the [sampling] keys run.toml leaves out
    if os.path.exists(os.path.join(path, "generation_config.json")):
        gen = read_json(os.path.join(path, "generation_config.json"), out, "generation_config_error")
        if isinstance(gen, dict):
            out["generation_config"] = {k: gen[k] for k in SAMPLING_KEYS if k in gen}
    else:
        out["generation_config_error"] = "no generation_config.json in " + path
    weights = []
    for pattern in ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf"):
        for w in sorted(glob.glob(os.path.join(path, pattern))):
            name = os.path.basename(w)
            if name in ("training_args.bin",):
                continue
            try:
                weights.append({"name": name, "size": os.path.getsize(w)})
            except OSError as exc:
                weights.append({"name": name, "size": None, "error": str(exc)})
    out["weights"] = weights
    out["weights_bytes"] = sum(w["size"] or 0 for w in weights)
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index_path = os.path.join(path, index_name)
        if os.path.exists(index_path):
            index = read_json(index_path, out, "index_error")
            if isinstance(index, dict):
                shards = sorted(set((index.get("weight_map") or {}).values()))
                out["index"] = {"name": index_name, "total_size": (index.get("metadata") or {}).get("total_size"),
                                "shards": len(shards),
                                "missing_shards": [s for s in shards if not os.path.exists(os.path.join(path, s))]}
    return out


def describe_tokenizer(path):
    out = {"path": path, "files": []}
    if not os.path.isdir(path):
        return out
    out["files"] = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(path, f))]
    template = None
    tok_cfg = None
    if os.path.exists(os.path.join(path, "tokenizer_config.json")):
        tok_cfg = read_json(os.path.join(path, "tokenizer_config.json"), out, "tokenizer_config_error")
    if isinstance(tok_cfg, dict):
        ct = tok_cfg.get("chat_template")
        if isinstance(ct, list):  # named templates: [{"name": "default", "template": "..."}]
            ct = next((t.get("template") for t in ct if isinstance(t, dict) and t.get("name") == "default"), None)
        if isinstance(ct, str) and ct:
            template, out["chat_template_source"] = ct, "tokenizer_config.json"
        out["tokenizer_class"] = tok_cfg.get("tokenizer_class")
    for name in ("chat_template.jinja", "chat_template.json"):
        p = os.path.join(path, name)
        if template is None and os.path.exists(p):
            try:
                with open(p, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, ValueError) as exc:
                out["chat_template_error"] = err(exc)
                continue
            if name.endswith(".json"):
                try:
                    text = json.loads(text).get("chat_template", "")
                except (ValueError, AttributeError) as exc:
                    out["chat_template_error"] = err(exc)
                    continue
            template, out["chat_template_source"] = text, name
    out["chat_template"] = template is not None
    if template is not None:
        out["chat_template_chars"] = len(template)
        out["thinking"] = {"enable_thinking": "enable_thinking" in template, "think_tag": "<think>" in template}
    return out


result = {"model": resolve(args["model"])}
if "path" in result["model"]:
    result["model"].update(describe_model(result["model"]["path"]))
tok_arg = args.get("tokenizer") or args["model"]
if tok_arg == args["model"]:
    tok = {k: v for k, v in result["model"].items() if k in ("given", "path", "error", "resolved_from_hub_cache")}
else:
    tok = resolve(tok_arg)
if "path" in tok:
    tok.update(describe_tokenizer(tok["path"]))
result["tokenizer"] = tok
print(json.dumps(result))
