"""Render conversations into prompt ids with the model's own tokenizer and chat template.

`prompt_ids` is exactly what SGLang builds for a chat request (apply_chat_template, then the tokenizer without special
tokens), so the ids sent and stored are the ones the model sees; turn k of a multi-turn conversation is rendered on the
model's own earlier answers, whole.
"""
from __future__ import annotations

import json
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.text.answer_shape import THINK_OPEN, prompt_opens_think
from engine.text.ingest import Conversation

if TYPE_CHECKING:
    from engine.text.bytelevel_decode import ByteTableDecoder

TURN_MODES = ("all", "last", "first")
_HUGE = 10**9  # transformers' "no limit" model_max_length is ~1e30


class RenderError(Exception):
    """The tokenizer / model dir cannot be used; the message names the path and the problem, `path` is it."""

    def __init__(self, message: str, path: str | Path | None = None):
        super().__init__(message)
        self.path = None if path is None else str(path)


def _text(value: object, call: str) -> str:
    """What `call` returns for one text: transformers annotates apply_chat_template and decode with every form they
    can return (ids, lists, a BatchEncoding), so the one form asked for is checked here."""
    if not isinstance(value, str):
        raise TypeError(f"the tokenizer's {call} returned {type(value).__name__}, not a str")
    return value


def sample_id(conversation_id: str, turn: int) -> str:
    return f"{conversation_id}#turn{turn}"


class Renderer:
    def __init__(self, tokenizer_path: str, *, enable_thinking: bool, context_length: int | None = None):
        from transformers import AutoTokenizer

        path = Path(tokenizer_path).expanduser()
        if not path.is_dir():
            try:
                path.stat()
                problem = "is not a directory (expected a local model dir with tokenizer files)"
            except OSError as exc:
                problem = str(exc)
            raise RenderError(f"tokenizer path {path}: {problem}", path)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise RenderError(f"tokenizer path {path}: cannot load the tokenizer: {exc}", path) from exc
        if not getattr(self.tokenizer, "chat_template", None):
            raise RenderError(f"tokenizer path {path}: the tokenizer has no chat template "
                              "(tokenizer_config.json 'chat_template' or chat_template.jinja)", path)
        self.path = path
        self.enable_thinking = enable_thinking
        # transformers' decode walks every id in Python (to_py_obj) before the Rust decode: on a
        # 4000-token answer that costs more than the decode itself. Without clean-up of spaces its
        # result is exactly the Rust tokenizer's, so call that directly, or (byte-level BPE, checked
        # to agree) a per-id bytes table, built on first use (engine.text.bytelevel_decode)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self._backend = (backend if backend is not None
                         and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False) else None)
        self._byte_table: ByteTableDecoder | None = None
        self._byte_table_built = False
        self.model_config = _read_json(path / "config.json")
        self.generation_config = _read_json(path / "generation_config.json")
        self.context_length = context_length or self._configured_context_length()
        self.eos_ids = self._eos_ids()
        self._eos_set = frozenset(self.eos_ids)
        self.think_open_id = self._single_token_id("<think>")
        self.think_close_id = self._single_token_id("</think>")
        # Qwen3.5/3.6, Thinking-2507 and R1-style templates open the think block in the generation prompt;
        # `opened_text` is that opening (from its <think>), what each prompt's tail is compared with
        probe = self.prompt_text([{"role": "user", "content": "x"}])
        self.prompt_opens_think = prompt_opens_think(probe)
        self.opened_text = probe[probe.rfind(THINK_OPEN):] if self.prompt_opens_think else THINK_OPEN + "\n"
        self._opened_ids = list(self.tokenizer(self.opened_text, add_special_tokens=False).input_ids)

    # --- configuration -----------------------------------------------------------------------

    def _configured_context_length(self) -> int:
        cfg = self.model_config or {}
        for section in (cfg, cfg.get("text_config") or {}):
            value = section.get("max_position_embeddings")
            if isinstance(value, int) and value > 0:
                return value
        value = getattr(self.tokenizer, "model_max_length", None)
        if isinstance(value, int) and 0 < value < _HUGE:
            return value
        raise RenderError(f"{self.path}: no context length: config.json has no max_position_embeddings and the "
                          "tokenizer no model_max_length; set context_length in run.toml", self.path)

    def _eos_ids(self) -> list[int]:
        value = (self.generation_config or {}).get("eos_token_id")
        if value is None:
            value = (self.model_config or {}).get("eos_token_id")
        if value is None:
            value = self.tokenizer.eos_token_id
        if value is None:
            raise RenderError(f"{self.path}: no eos token id in generation_config.json, config.json or the tokenizer",
                              self.path)
        ids = [value] if isinstance(value, int) else list(value)
        return list(dict.fromkeys(int(i) for i in ids))

    def _single_token_id(self, token: str) -> int | None:
        ids = self.tokenizer.encode(token, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    # --- turns and messages ------------------------------------------------------------------

    def user_turns(self, conv: Conversation, mode: str) -> list[int]:
        n = sum(1 for m in conv.messages if m["role"] == "user")
        if mode not in TURN_MODES:
            raise ValueError(f"turns mode {mode!r}: must be one of {', '.join(TURN_MODES)}")
        if n == 0:
            return []
        if mode == "all":
            return list(range(n))
        return [n - 1] if mode == "last" else [0]

    def build_messages(self, conv: Conversation, turn: int, answers: Mapping[int, str], mode: str) -> list[dict]:
        """History up to and including user turn `turn`. In mode "all" the assistant message(s)
        after each earlier user turn k are replaced by one message with answers[k]."""
        out: list[dict] = []
        k = -1
        replaced = False  # for the current earlier turn, the regenerated answer is already in
        for m in conv.messages:
            role = m["role"]
            if role == "user":
                if mode == "all" and k >= 0 and not replaced:
                    out.append(self._answer_message(conv, k, answers))
                k += 1
                replaced = False
                if k > turn:
                    break
                out.append({"role": "user", "content": m["content"]})
                if k == turn:
                    break
            elif role == "assistant":
                if mode == "all":
                    if k >= 0 and not replaced:
                        out.append(self._answer_message(conv, k, answers))
                        replaced = True
                    elif k < 0:
                        out.append({"role": "assistant", "content": m["content"]})  # before any user turn
                else:
                    out.append({"role": "assistant", "content": m["content"]})
            else:
                out.append({"role": role, "content": m["content"]})
        if k < turn:
            raise ValueError(f"conversation {conv.conversation_id} has {k + 1} user turns; turn {turn} does not exist")
        return out

    @staticmethod
    def _answer_message(conv: Conversation, k: int, answers: Mapping[int, str]) -> dict:
        if k not in answers:
            raise KeyError(f"conversation {conv.conversation_id}: turn {k}'s regenerated answer is needed "
                           f"for the next turn's history but is not there (have turns {sorted(answers)})")
        return {"role": "assistant", "content": answers[k]}

    # --- tokens ------------------------------------------------------------------------------

    def prompt_text(self, messages: list[dict]) -> str:
        return _text(self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=self.enable_thinking
        ), "apply_chat_template(tokenize=False)")

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return list(self.tokenizer(self.prompt_text(messages), add_special_tokens=False).input_ids)

    def prompt_ids_many(self, messages_list: Sequence[list[dict]]) -> list[list[int]]:
        """prompt_ids for several conversations at once (the Rust tokenizer encodes the batch in parallel)."""
        if not messages_list:
            return []
        # one batched apply_chat_template: the same per-conversation render, without its per-call overhead
        texts = self.tokenizer.apply_chat_template(
            list(messages_list), tokenize=False, add_generation_prompt=True, enable_thinking=self.enable_thinking)
        backend = self._backend_for_ids()
        if backend is not None:
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False).input_ids]

    def conversation_ids_many(self, messages_list: Sequence[list[dict]]) -> list[list[int]]:
        """Whole conversations (the last message an assistant turn) rendered as a trainer renders them: the template
        without a generation prompt, then tokenized; batched as prompt_ids_many."""
        if not messages_list:
            return []
        texts = self.tokenizer.apply_chat_template(
            list(messages_list), tokenize=False, add_generation_prompt=False, enable_thinking=self.enable_thinking)
        backend = self._backend_for_ids()
        if backend is not None:
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False).input_ids]

    def _backend_for_ids(self):
        """The Rust tokenizer when calling it directly gives exactly the ids of tokenizer(texts,
        add_special_tokens=False): no truncation or padding set on it, special tokens handled as
        the tokenizer would set them. transformers' call then does that same encode_batch; the
        _fast variant skips the character offsets nobody reads here (~1/3 of the encode) and its
        conversion of every field to lists. Else None: the caller goes through the tokenizer."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or not hasattr(backend, "encode_batch_fast"):
            return None
        split = bool(getattr(self.tokenizer, "split_special_tokens", False))
        if backend.truncation is not None or backend.padding is not None or backend.encode_special_tokens != split:
            return None
        return backend

    def opens_think(self, prompt_ids: Sequence[int]) -> bool:
        """Whether this rendered prompt ends inside an opened think block: the answer starts with reasoning
        and only closes it. Decided once per sample, here; every later rule takes the result."""
        k = len(self._opened_ids)
        return 0 < k <= len(prompt_ids) and list(prompt_ids[-k:]) == self._opened_ids

    def max_new_tokens_for(self, prompt_ids: Sequence[int], max_new_tokens: int) -> int:
        """The largest max_new_tokens <= the configured one that SGLang accepts (0: prompt too long)."""
        return max(0, min(max_new_tokens, self.context_length - len(prompt_ids) - 1))

    def decode(self, ids: Sequence[int] | array) -> str:
        """decode(ids, skip_special_tokens=False): a list of ids, or an int32 array('i') of them."""
        if self._backend is None:
            return _text(self.tokenizer.decode(list(ids), skip_special_tokens=False), "decode")
        table = self._table()
        text = table.decode(ids) if table is not None else None
        return text if text is not None else self._backend.decode(list(ids), skip_special_tokens=False)

    def answer_text(self, ids32: array, server_text: object, matched_stop: object = None) -> tuple[str, bool]:
        """The answer's text, decode(ids32) for the output ids as an int32 array('i'): SGLang's own
        `text` for them (it decodes every answer already; a second decode here was ~1/8 of the
        engine's CPU per answer) when its UTF-8 byte count is the ids' (the count tells a text that is
        not theirs, e.g. one decoded with the special tokens skipped), else decoded here. Also whether
        a server text was there and was not taken where it could be judged (the caller alerts)."""
        if isinstance(server_text, str):
            table = self._table()
            if table is not None:
                # SGLang cuts the stop token it matched (finish_reason.matched, an id) from its text
                stop_last = bool(len(ids32)) and (ids32[-1] in self._eos_set or ids32[-1] == matched_stop)
                text = table.adopt(server_text, ids32, trimmed_last=stop_last)
                if text is not None:
                    return text, False
                refused = "\ufffd" not in server_text and table.checkable(ids32)
                return self.decode(ids32), refused
        return self.decode(ids32), False

    def _table(self) -> ByteTableDecoder | None:
        if not self._byte_table_built and self._backend is not None:
            from engine.text.bytelevel_decode import ByteTableDecoder

            self._byte_table = ByteTableDecoder.build(self._backend)
            self._byte_table_built = True
        return self._byte_table

    def strip_eos(self, output_ids: Sequence[int]) -> list[int]:
        ids = list(output_ids)
        while ids and ids[-1] in self._eos_set:
            ids.pop()
        return ids

    def history_answer(self, output_ids: Sequence[int], prompt_opened: bool = False) -> str:
        """The assistant message a later turn's history holds: the answer as the model wrote it, after
        the think opening its prompt held when `prompt_opened`."""
        text = self.decode(self.strip_eos(output_ids))
        return self.opened_text + text if prompt_opened else text

    def history_content(self, answer: str) -> str:
        """What the chat template writes for an earlier assistant turn whose message is `answer` (a history
        answer): the text between that turn's header and its end-of-turn, exactly as it sat in the next turn's
        prompt. Qwen-family templates drop a closed reasoning block there and keep a block cut before its
        `</think>` raw; Qwen3.5's also trims. Found by rendering the turn, so any template's rule holds; writing
        this text back as the message renders the same prompt again (the templates' rules are idempotent)."""
        head, tail = self._history_frame()
        text = _text(self.tokenizer.apply_chat_template(_framed(answer), tokenize=False, add_generation_prompt=False,
                                                        enable_thinking=self.enable_thinking),
                     "apply_chat_template(tokenize=False)")
        if len(text) < len(head) + len(tail) or not text.startswith(head) or not text.endswith(tail):
            raise RenderError(f"{self.path}: the chat template renders an earlier assistant turn in a way regen cannot "
                              "cut out of its frame (header and end-of-turn differ with its content)", self.path)
        return text[len(head):len(text) - len(tail)]

    def _history_frame(self) -> tuple[str, str]:
        """The text the template writes before and after an earlier assistant turn's content (found once)."""
        frame = getattr(self, "_frame", None)
        if frame is None:
            text = _text(self.tokenizer.apply_chat_template(_framed(_SENTINEL), tokenize=False,
                                                            add_generation_prompt=False,
                                                            enable_thinking=self.enable_thinking),
                         "apply_chat_template(tokenize=False)")
            if text.count(_SENTINEL) != 1:
                raise RenderError(f"{self.path}: the chat template does not write an earlier assistant turn's "
                                  "content as given; regen cannot tell what its history held", self.path)
            head, _, tail = text.partition(_SENTINEL)
            frame = self._frame = (head, tail)
        return frame

    def reasoning_tokens(self, output_ids: Sequence[int] | array, prompt_opened: bool = False) -> int:
        """Tokens inside <think>..</think> (to the end when unclosed; eos excluded); when the prompt opened
        the block, from the first output token. An int32 array('i') of the ids is searched in numpy."""
        if self.think_close_id is None and self.think_open_id is None:
            return 0
        ids = output_ids  # no copy: trailing eos ids are cut off by the search bound n
        n = len(ids)
        eos = self._eos_set
        while n and ids[n - 1] in eos:
            n -= 1
        if isinstance(ids, array) and ids.typecode == "i":
            find = _finder(np.frombuffer(ids, dtype=np.intc))
        else:
            find = _list_finder(ids)
        start = 0 if prompt_opened else None
        if start is None and self.think_open_id is not None:
            start = find(self.think_open_id, 0, n)
            if start is not None:
                start += 1
        close = None
        if self.think_close_id is not None:
            close = find(self.think_close_id, start or 0, n)
        if start is None:
            # no block opened: a lone </think> still closes one (a prompt-opened block the caller did not name)
            return close if close is not None else 0
        return (close if close is not None else n) - start


_SENTINEL = "REGENHISTORYSENTINEL"  # no spaces, no tags: every template writes it as given


def _framed(answer: str) -> list[dict]:
    """An assistant message between two user messages: how every earlier turn of a history sits."""
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer},
            {"role": "user", "content": "q"}]


def _list_finder(ids: Sequence[int]):
    """find(value, lo, hi): the first index of value in ids[lo:hi], or None (list.index)."""
    def find(value: int, lo: int, hi: int) -> int | None:
        try:
            return ids.index(value, lo, hi)
        except ValueError:
            return None
    return find


def _finder(a: np.ndarray):
    """The same search over an int32 numpy view."""
    def find(value: int, lo: int, hi: int) -> int | None:
        if hi <= lo:
            return None
        hits = a[lo:hi] == value
        k = int(hits.argmax())
        return lo + k if hits[k] else None
    return find


def _read_json(path: Path) -> dict | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None  # optional files: callers fall back to the tokenizer's own values
    except OSError as exc:
        raise RenderError(f"cannot read {path}: {exc}", path) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RenderError(f"{path}: not valid JSON: {exc}", path) from exc
    if not isinstance(data, dict):
        raise RenderError(f"{path}: expected a JSON object", path)
    return data
