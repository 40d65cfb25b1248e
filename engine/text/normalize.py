"""One prompt row (a parsed JSON object) to chat messages, its id and source, or a RowError naming what is wrong;
the probes' host script applies the same rules (probes/host/prompt_rows.py).
"""
from __future__ import annotations

from typing import Any

from engine.text.row_errors import RowError

ID_FIELDS = ("id", "conversation_id", "uuid", "sample_id")
ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "system": "system",
}


def row_id(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return None
    for key in ID_FIELDS:
        value = obj.get(key)
        if value is None or value == "":
            continue
        if isinstance(value, (dict, list)):
            continue
        return str(value)
    return None


def normalize_row(obj: Any) -> tuple[tuple[dict, ...], str | None, str | None]:
    if not isinstance(obj, dict):
        raise RowError("not_object", f"not an object (a JSON {_json_type(obj)})")
    turns = None
    for key in ("messages", "conversations", "conversation"):
        if obj.get(key) is not None:
            turns = obj[key]
            field_name = key
            break
    if turns is None and isinstance(obj.get("prompt"), list):
        turns, field_name = obj["prompt"], "prompt"
    if turns is not None:
        messages = _normalize_turns(turns, field_name)
    elif "prompt" in obj:
        messages = _single_turn(obj, _require_text(obj["prompt"], "prompt"))
    elif "instruction" in obj:
        instruction = _require_text(obj["instruction"], "instruction")
        extra = obj.get("input")
        extra = "" if extra is None else _require_text(extra, "input")
        messages = _single_turn(obj, f"{instruction}\n\n{extra}" if extra.strip() else instruction)
    else:
        keys = ", ".join(sorted(map(str, obj))[:12]) or "none"
        raise RowError("no_conversation",
                        f"no conversation: expected 'messages', 'conversations', 'prompt' or 'instruction' (keys: {keys})")
    if not messages:
        raise RowError("empty_conversation", "empty conversation")
    if not any(m["role"] == "user" for m in messages):
        raise RowError("no_user_turn", "no user turn (roles: " + ", ".join(m["role"] for m in messages) + ")")
    source = obj.get("source")
    return tuple(messages), row_id(obj), source if isinstance(source, str) and source else None


def _single_turn(obj: dict, text: str) -> list[dict]:
    if not text.strip():
        raise RowError("empty_conversation", "empty conversation (the prompt text is empty)")
    messages = []
    system = obj.get("system")
    if system is not None:
        system = _require_text(system, "system")
        if system.strip():
            messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": text})
    return messages


def _normalize_turns(turns: Any, field_name: str) -> list[dict]:
    if not isinstance(turns, list):
        raise RowError("bad_conversation", f"'{field_name}' is not a list (a JSON {_json_type(turns)})")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowError("bad_conversation", f"{field_name}[{i}] is not an object (a JSON {_json_type(turn)})")
        role = turn.get("role", turn.get("from"))
        if not isinstance(role, str):
            raise RowError("unknown_role", f"{field_name}[{i}] has no role (expected 'role' or 'from')")
        norm = ROLE_ALIASES.get(role.strip().lower())
        if norm is None:
            raise RowError("unknown_role", f"unknown role {role!r} in {field_name}[{i}]"
                                            " (known: user/human, assistant/gpt/bot/model, system)")
        content = turn["content"] if "content" in turn else turn.get("value")
        messages.append({"role": norm, "content": _content_text(content, f"{field_name}[{i}]")})
    return messages


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                what = part.get("type") if isinstance(part, dict) else _json_type(part)
                raise RowError("non_string_content", f"non-string content in {where}: part {j} is {what!r}, not text")
        return "\n".join(texts)
    raise RowError("non_string_content", f"non-string content in {where} (a JSON {_json_type(content)})")


def _require_text(value: Any, where: str) -> str:
    return _content_text(value, f"'{where}'")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
