"""SGLang's request validation and response shapes for /generate (0.5.5 texts, 0.5.10/0.5.23 where noted)."""
from __future__ import annotations

import uuid
from array import array
from dataclasses import dataclass
from typing import Any

from engine.simulator.profiles import Profile

# sglang/srt/sampling/sampling_params.py (0.5.5 + the 0.5.23 additions), with SGLang's defaults
SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "stop_regex": None,
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "no_stop_trim": False, "custom_params": None, "stream_interval": None, "logit_bias": None,
    "sampling_seed": 42, "beam_width": None, "watermark": None, "choice": None,
}


class ApiError(Exception):
    """An HTTP error answer: status and the exact JSON body SGLang sends."""

    def __init__(self, status: int, body: Any):
        super().__init__(str(body))
        self.status = status
        self.body = body


def bad_request(message: str) -> ApiError:
    return ApiError(400, {"error": {"message": message}})


def openai_error(message: str, status: int = 400, err_type: str = "BadRequestError") -> ApiError:
    return ApiError(status, {"object": "error", "message": message, "type": err_type, "param": None, "code": status})


def validate_sampling(params: Any, profile: Profile) -> dict[str, Any]:
    """Merged with SGLang's defaults; unknown keys are a 400 as in 0.5.23, ranges as SamplingParams.verify()."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise bad_request(f"sampling_params must be an object, got {type(params).__name__}")
    unknown = [k for k in params if k not in SAMPLING_DEFAULTS]
    if unknown:
        expected = ", ".join(f"`{k}`" for k in SAMPLING_DEFAULTS)
        raise ApiError(400, {"error": f"unknown field `{unknown[0]}`, expected one of {expected}"})
    sp = dict(SAMPLING_DEFAULTS)
    sp.update({k: v for k, v in params.items()})
    for key in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if not isinstance(sp[key], (int, float)) or isinstance(sp[key], bool):
            raise bad_request(f"{key} must be a number, got {sp[key]!r}.")
    for key in ("top_k", "min_new_tokens", "n"):
        if not isinstance(sp[key], int) or isinstance(sp[key], bool):
            raise bad_request(f"{key} must be an integer, got {sp[key]!r}.")
    if sp["max_new_tokens"] is not None and (not isinstance(sp["max_new_tokens"], int)
                                             or isinstance(sp["max_new_tokens"], bool)):
        raise bad_request(f"max_new_tokens must be an integer or null, got {sp['max_new_tokens']!r}.")
    if sp["temperature"] < 0.0:
        raise bad_request(f"temperature must be non-negative, got {sp['temperature']}.")
    if not 0.0 < sp["top_p"] <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {sp['top_p']}.")
    if not 0.0 <= sp["min_p"] <= 1.0:
        raise bad_request(f"min_p must be in [0, 1], got {sp['min_p']}.")
    if sp["top_k"] < 1 and sp["top_k"] != -1:
        raise bad_request(f"top_k must be -1 (disable), or at least 1, got {sp['top_k']}.")
    if not -2.0 <= sp["frequency_penalty"] <= 2.0:
        raise bad_request(f"frequency_penalty must be in [-2, 2], got {sp['frequency_penalty']}.")
    if not -2.0 <= sp["presence_penalty"] <= 2.0:
        raise bad_request(f"presence_penalty must be in [-2, 2], got {sp['presence_penalty']}.")
    if profile.repetition_penalty_excludes_zero:
        if not 0.0 < sp["repetition_penalty"] <= 2.0:
            # 0.5.12+ words (0.5.23 sampling/sampling_params.py:275-278)
            raise bad_request(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {sp['repetition_penalty']}.")
    elif not 0.0 <= sp["repetition_penalty"] <= 2.0:
        raise bad_request(f"repetition_penalty must be in [0, 2], got {sp['repetition_penalty']}.")
    seed = sp["sampling_seed"]
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise bad_request(f"sampling_seed must be an integer, got {seed!r}.")
    if sp["max_new_tokens"] is not None and sp["max_new_tokens"] < 0:
        raise bad_request(f"max_new_tokens must be at least 0, got {sp['max_new_tokens']}.")
    if sp["min_new_tokens"] < 0 or (sp["max_new_tokens"] is not None and sp["min_new_tokens"] > sp["max_new_tokens"]):
        raise bad_request(f"min_new_tokens must be in [0, max_new_tokens], got {sp['min_new_tokens']}.")
    if sp["n"] < 1:
        raise bad_request(f"n must be at least 1, got {sp['n']}.")
    if sum(sp[k] is not None for k in ("json_schema", "regex", "ebnf")) > 1:
        raise bad_request("Only one of regex, json_schema, or ebnf can be set.")
    if not isinstance(sp["skip_special_tokens"], bool):
        raise bad_request(f"skip_special_tokens must be a boolean, got {sp['skip_special_tokens']!r}.")
    return sp


def check_context(prompt_len: int, max_new_tokens: int | None, context_len: int) -> None:
    """TokenizerManager._validate_one_request (0.5.5)."""
    if prompt_len >= context_len:
        raise bad_request(f"The input ({prompt_len} tokens) is longer than the model's context length "
                          f"({context_len} tokens).")
    if max_new_tokens is not None and prompt_len + max_new_tokens >= context_len:
        total = prompt_len + max_new_tokens
        raise bad_request(
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
            f"You requested a total of {total} tokens: {prompt_len} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
            "messages or the completion to fit within the limit.")


@dataclass
class GenerateItem:
    rid: str
    rid_given: bool
    prompt_ids: list[int]
    sampling: dict[str, Any]
    priority: int | None = None  # the request's priority (--enable-priority-scheduling)


def _is_id_list(value: Any) -> bool:
    """A list of token ids (checked in C: array() rejects floats, strings and out-of-range values)."""
    if not isinstance(value, list):
        return False
    try:
        array("q", value)
    except (TypeError, OverflowError):
        return False
    return True


def parse_generate(body: Any, encode, profile: Profile) -> tuple[list[GenerateItem], bool]:
    """Expand a GenerateReqInput into single items; returns (items, is_batch)."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    for unsupported in ("return_logprob", "return_hidden_states", "return_entropy"):
        if body.get(unsupported):
            raise bad_request(f"{unsupported} is not supported by the SGLang simulator (it has no model weights); "
                              "send it only to a real server.")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        if body.get("input_embeds") is not None:
            raise bad_request("input_embeds is not supported by the simulator (no model weights).")
        raise bad_request("Either text, input_ids or input_embeds should be provided.")
    if text is not None:
        if isinstance(text, str):
            prompts, batch = [encode(text)], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, batch = [encode(t) for t in text], True
        else:
            raise bad_request("text must be a string or a non-empty list of strings.")
    else:
        if _is_id_list(input_ids) and input_ids:
            prompts, batch = [list(input_ids)], False
        elif isinstance(input_ids, list) and input_ids and all(_is_id_list(x) and x for x in input_ids):
            prompts, batch = [list(x) for x in input_ids], True
        else:
            raise bad_request("input_ids must be a non-empty list of token ids or a list of such lists.")
    raw_sp = body.get("sampling_params")
    if isinstance(raw_sp, list):
        if len(raw_sp) != len(prompts):
            raise bad_request(f"sampling_params has {len(raw_sp)} entries for {len(prompts)} prompts.")
        sps = [validate_sampling(p, profile) for p in raw_sp]
    else:
        sp = validate_sampling(raw_sp, profile)
        sps = [sp] * len(prompts)
    priority = body.get("priority")
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
        raise bad_request(f"priority must be an integer, got {priority!r}.")
    rid = body.get("rid")
    n = sps[0]["n"]
    if n > 1 and not batch:
        # SGLang expands n>1 into a batch whose sub-requests get fresh uuids
        return [GenerateItem(uuid.uuid4().hex, False, prompts[0], dict(sps[0], n=1), priority) for _ in range(n)], True
    if isinstance(rid, list):
        if len(rid) != len(prompts) or not all(isinstance(r, str) for r in rid):
            raise bad_request("The rid should be a list of strings with the same length as the batch.")
        rids, given = list(rid), True
    elif isinstance(rid, str):
        rids, given = ([f"{rid}_{i}" for i in range(len(prompts))] if batch else [rid]), True
    elif rid is None:
        rids, given = [uuid.uuid4().hex for _ in prompts], False
    else:
        raise bad_request(f"rid must be a string or a list of strings, got {type(rid).__name__}.")
    return [GenerateItem(r, given, p, s, priority) for r, p, s in zip(rids, prompts, sps)], batch
