"""Conversations answered the way the engine answers them (turn by turn, each later turn rendered on the model's
own earlier answers), with turns of chosen shapes: normal, empty, cut inside the reasoning at max_new_tokens."""
from __future__ import annotations

import json
import random
from pathlib import Path

from engine.config.load import dump_toml
from engine.text.ingest import Conversation, iter_prompts
from engine.text.render import Renderer
from engine.store.names import shard_id_for
from engine.store.shard_store import ShardStore

KINDS = ("normal", "empty", "cut")


def answer_text(kind: str, opened: bool, rng: random.Random) -> tuple[str, str]:
    """(output text as the model writes it, finish_reason) for a turn of `kind`, after a prompt that opened
    `<think>` or not. Reasoning ends in blank lines and spaces on purpose: templates strip them."""
    words = " ".join(rng.choice(["step", "so", "check", "value", "wait", "ok"]) for _ in range(rng.randint(1, 12)))
    head = "" if opened else "<think>\n"
    if kind == "cut":
        return head + words + rng.choice(["", "\n", "\n\n", " "]), "length"
    if kind == "empty":
        return head + "\n</think>\n\nOK.<|im_end|>", "stop"
    return head + words + rng.choice(["\n", "\n\n\n", " \n"]) + "</think>\n\n" + words.capitalize() + ".<|im_end|>", "stop"


def answer_turns(renderer: Renderer, conv: Conversation, kinds: list[str], rng: random.Random) -> list[dict]:
    """The shard rows of conv's turns (one per user turn, `kinds[k]` the shape of turn k), made as the engine makes
    them: prompt = the template over the history of earlier answers (Renderer.history_answer of their ids)."""
    answers: dict[int, str] = {}
    rows = []
    for k in renderer.user_turns(conv, "all"):
        prompt = renderer.prompt_ids(renderer.build_messages(conv, k, answers, "all"))
        opened = renderer.opens_think(prompt)
        text, finish = answer_text(kinds[k], opened, rng)
        out = list(renderer.tokenizer(text, add_special_tokens=False).input_ids)
        answers[k] = renderer.history_answer(out, opened)
        rows.append({
            "sample_id": f"{conv.conversation_id}#turn{k}", "conversation_id": conv.conversation_id, "turn": k,
            "source": conv.source, "origin": conv.origin, "input_ids": prompt + out,
            "loss_mask": [0] * len(prompt) + [1] * len(out), "prompt_len": len(prompt), "output_len": len(out),
            "reasoning_tokens": renderer.reasoning_tokens(out, opened), "prompt_opened": opened,
            "finish_reason": finish, "completion_tokens": len(out), "cached_tokens": 0, "latency_s": 0.1,
            "worker": "gpu0", "text": renderer.decode(out)})
    return rows


def write_conversations(path: Path, convs: list[list[str]]) -> Path:
    """A messages-format prompt file: conversation i has the user turns convs[i] (source answers in between)."""
    with open(path, "w") as f:
        for i, users in enumerate(convs):
            msgs = []
            for j, u in enumerate(users):
                if j:
                    msgs.append({"role": "assistant", "content": "the source's old answer"})
                msgs.append({"role": "user", "content": u})
            f.write(json.dumps({"id": f"c{i}", "messages": msgs}) + "\n")
    return path


def answered_run(tmp_path: Path, model: Path, shapes: list[list[str]], seed: int = 0) -> tuple[Path, dict[str, dict]]:
    """A run dir whose committed shard holds conversations answered turn by turn with the given shapes (one list
    of turn kinds per conversation), through the store's own commit. Returns it and its rows by sample id."""
    from tests.test_engine_run import make_config

    run_dir = tmp_path / "run"
    prompts = write_conversations(tmp_path / "chats.jsonl",
                                  [[f"Question {i}.{k}: what is {k} plus {i}?" for k in range(len(kinds))]
                                   for i, kinds in enumerate(shapes)])
    cfg = make_config(run_dir, model, prompts=1)
    cfg = cfg.model_copy(update=dict(prompts=(str(prompts),), turns="all", shard_size=max(10, len(shapes))))
    run_dir.mkdir()
    (run_dir / "run.toml").write_text(dump_toml(cfg))
    renderer = Renderer(str(model), enable_thinking=True)
    rng = random.Random(seed)
    convs = [e for e in iter_prompts(cfg.prompts, cfg.prompt_format) if isinstance(e, Conversation)]
    rows = [r for conv, kinds in zip(convs, shapes) for r in answer_turns(renderer, conv, kinds, rng)]
    with ShardStore(run_dir) as store:
        store.ensure_shards({shard_id_for(0, cfg.shard_size): len(shapes)})
        store.commit(shard_id_for(0, cfg.shard_size), rows)
    return run_dir, {r["sample_id"]: r for r in rows}
