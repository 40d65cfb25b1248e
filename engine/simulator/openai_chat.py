"""POST /v1/chat/completions: the chat template of the real tokenizer, the same generator, OpenAI shapes."""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from engine.simulator.protocol import ApiError, GenerateItem, openai_error, validate_sampling
from engine.simulator.request import RequestState
from engine.simulator.responses import json_response

if TYPE_CHECKING:
    from engine.simulator.request_flow import RequestFlow
    from engine.simulator.server import SimServer

FORCED_REASONING_PARSERS = ("qwen3-thinking", "deepseek-r1")
# OpenAI field -> SGLang sampling key
_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                    "repetition_penalty": "repetition_penalty", "stop": "stop", "stop_token_ids": "stop_token_ids",
                    "min_tokens": "min_new_tokens", "ignore_eos": "ignore_eos", "n": "n",
                    "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "no_stop_trim",
                    "regex": "regex", "ebnf": "ebnf", "seed": "sampling_seed"}


def split_reasoning(text: str, *, force: bool = False) -> tuple[str | None, str]:
    """Qwen3Detector non-stream parse: (reasoning_text, normal_text)."""
    if "<think>" not in text and not force:
        return None, text
    body = text.replace("<think>", "", 1).strip()
    if "</think>" not in body:
        return body, ""  # truncated thinking: everything is reasoning
    reasoning, _, rest = body.partition("</think>")
    return reasoning.strip(), rest.strip()


def finish_name(reason: dict | None) -> str | None:
    if reason is None:
        return None
    return {"stop": "stop", "length": "length", "abort": "abort"}.get(reason["type"], reason["type"])


class ChatHandler:
    def __init__(self, server: "SimServer", flow: "RequestFlow"):
        self.server = server
        self.flow = flow

    def _item(self, body: dict) -> tuple[GenerateItem, dict]:
        s = self.server
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise openai_error("messages must be a non-empty list of message objects")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise openai_error("chat_template_kwargs must be an object")
        try:
            prompt = s.loaded_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as exc:  # jinja errors: the user's messages do not fit the template
            raise openai_error(f"Failed to apply the chat template: {type(exc).__name__}: {exc}") from exc
        ids = s.loaded_tokenizer.encode(prompt, add_special_tokens=False)
        params: dict[str, Any] = {}
        for field, key in _SAMPLING_FIELDS.items():
            if body.get(field) is not None:
                params[key] = body[field]
        params["max_new_tokens"] = body.get("max_completion_tokens", body.get("max_tokens"))
        try:
            sampling = validate_sampling(params, s.profile)
        except ApiError as exc:
            err = exc.body.get("error")
            raise openai_error(err["message"] if isinstance(err, dict) else str(err)) from exc
        if sampling["n"] != 1:
            raise openai_error("The simulator answers n=1 chat completions only; send n=1.")
        rid = body.get("rid")
        item = GenerateItem(rid if isinstance(rid, str) else uuid.uuid4().hex, isinstance(rid, str), ids, sampling)
        return item, kwargs

    async def handle(self, request: web.Request) -> web.StreamResponse:
        s = self.server
        err = self.flow.unavailable()
        if err is not None:
            raise err
        if request.content_type != "application/json":
            raise openai_error(f"Content-Type must be application/json, got {request.content_type!r}")
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise openai_error(f"The request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise openai_error("The request body must be a JSON object.")
        item, _ = self._item(body)
        try:
            s.intake.check_request([item])
        except ApiError as exc:
            raise openai_error(exc.body["error"]["message"]) from exc
        reqs = await self.flow.submit([item])
        req = reqs[0]
        separate = bool(s.cfg.reasoning_parser) and body.get("separate_reasoning", True)
        force = s.cfg.reasoning_parser in FORCED_REASONING_PARSERS
        model = body.get("model") or s.cfg.model_name
        created = int(time.time())
        try:
            if body.get("stream"):
                return await self._stream(request, req, body, separate, force, model, created)
            await self.flow.run(reqs)
            text = self.flow.text_of(req)
            reasoning, content = split_reasoning(text, force=force) if separate else (None, text)
            return json_response({
                "id": req.rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0,
                             "message": {"role": "assistant", "content": content,
                                         "reasoning_content": reasoning, "tool_calls": None},
                             "logprobs": None, "finish_reason": finish_name(req.finish_reason),
                             "matched_stop": (req.finish_reason or {}).get("matched")}],
                "usage": self._usage(req), "metadata": None})
        finally:
            self.flow.release(reqs)

    def _usage(self, req) -> dict:
        n = len(req.output_ids or ())
        return {"prompt_tokens": req.prompt_len, "completion_tokens": n, "total_tokens": req.prompt_len + n,
                "prompt_tokens_details": None,
                # filled from meta_info.reasoning_tokens from 0.5.10; 0 in 0.5.5 (contract 2.5)
                "reasoning_tokens": self.server.loaded_generator.reasoning_count(req.output_ids or [], req.plan.prompt_opened)
                if self.server.profile.reports_reasoning_tokens else 0}

    async def _stream(self, request, req, body, separate, force, model, created) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(delta: dict, finish: str | None = None, matched=None, usage=None, choices=True) -> None:
            chunk = {"id": req.rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                                  "matched_stop": matched}] if choices else [],
                     "usage": usage}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")

        await send({"role": "assistant", "content": ""})
        sent_reasoning = sent_content = ""
        gen = self.server.loaded_generator
        if self.server.cfg.sim_instant:
            await self.flow.run([req])
            steps = [len(req.output_ids)]
        else:
            req.stream = True
            self.server.started_scheduler.submit(req)
            steps = None
        text = ""
        sent_ids = 0
        while True:
            if steps is None:
                await req.progress.wait()
                req.progress.clear()
            finished = req.state == RequestState.FINISHED
            ids = req.output_ids if finished else req.plan.output_ids[: self.server.started_scheduler.generated(req)]
            if len(ids) > sent_ids:
                text += gen.decode(ids[sent_ids:], req.skip_special_tokens)
                sent_ids = len(ids)
            reasoning, content = split_reasoning(text, force=force) if separate else (None, text)
            delta = {}
            if reasoning and reasoning != sent_reasoning and reasoning.startswith(sent_reasoning):
                delta["reasoning_content"] = reasoning[len(sent_reasoning):]
                sent_reasoning = reasoning
            if content and content != sent_content and content.startswith(sent_content):
                delta["content"] = content[len(sent_content):]
                sent_content = content
            if delta and not finished:
                await send(delta)
            if finished:
                await send(delta, finish_name(req.finish_reason), (req.finish_reason or {}).get("matched"))
                break
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({}, usage=self._usage(req), choices=False)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
