"""How close a text export is to the stored ids: each row re-rendered with the model's chat template, re-tokenized
and compared with the shard's input_ids, each difference named by kind (token formats carry ids: not checked).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.text.render import Renderer

# kind -> what it means, in the order they are judged (a row is counted under each kind it shows)
KINDS = {
    "prompt": "the history renders to another prompt than the stored one",
    "boundary": "the prompt's text is the stored one, but its last token merges with the answer's first when "
                "re-tokenized (e.g. <think>\\n then \\n)",
    "end_added": "the answer was cut (no end-of-turn token) and the template closes it",
    "after_end": "the template writes text after the end-of-turn token (Qwen: \\n after <|im_end|>)",
    "text": "the template rewrites the answer's text (e.g. strips blank lines or spaces around the reasoning)",
    "retokenized": "same text, other ids: re-tokenizing merges or splits tokens the model generated "
                   "(e.g. \\n\\n after </think>)",
}


@dataclass
class Agreement:
    """Rows checked, rows whose re-rendered ids are the stored ids exactly, and the others by kind of difference."""
    checked: int = 0
    exact: int = 0
    differ: dict[str, int] = field(default_factory=dict)  # kind -> rows
    examples: dict[str, str] = field(default_factory=dict)  # kind -> the first sample id showing it
    prompt_exact: int = 0  # rows whose prompt part (the history and the generation prompt) re-renders exactly

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kinds": {k: KINDS[k] for k in self.differ}}

    def lines(self) -> list[str]:
        """What the export prints."""
        if not self.checked:
            return ["re-tokenized with the model's chat template: no row to check"]
        out = [f"re-tokenized with the model's chat template: {self.exact:,} of {self.checked:,} rows give the stored "
               f"ids exactly; the prompt part of {self.prompt_exact:,} (the token formats carry the ids themselves)"]
        for kind, n in sorted(self.differ.items(), key=lambda kv: -kv[1]):
            out.append(f"  {n:,} rows: {KINDS[kind]} (e.g. {self.examples[kind]})")
        return out


class AgreementCheck:
    """Accumulates an Agreement over the rows of an export, a batch (a shard's rows) at a time."""

    def __init__(self, renderer: Renderer, end_tokens: Sequence[str]):
        self.renderer = renderer
        self.end_tokens = [t for t in end_tokens if t]
        self.result = Agreement()

    def add(self, sample_ids: Sequence[str], conversations: Sequence[list[dict]], stored: Sequence[Sequence[int]],
            prompt_lens: Sequence[int]) -> None:
        """`conversations`: each row's messages with its final assistant turn as a trainer passes it to the template
        (reasoning under `reasoning_content`, or inline in the content)."""
        rendered = self.renderer.conversation_ids_many(conversations)
        for sid, ids, want, plen in zip(sample_ids, rendered, stored, prompt_lens):
            self._judge(sid, ids, list(want), int(plen))

    def _judge(self, sid: str, ids: list[int], want: list[int], plen: int) -> None:
        r = self.result
        r.checked += 1
        if ids == want:
            r.exact += 1
            r.prompt_exact += 1
            return
        decode = self.renderer.decode
        got_all, prompt_text = decode(ids), decode(want[:plen])
        want_text = decode(want)[len(prompt_text):]
        kinds = []
        aligned = ids[:plen] == want[:plen]
        if aligned:
            r.prompt_exact += 1
        else:
            kinds.append("boundary" if got_all.startswith(prompt_text) else "prompt")
        core = got_all[len(prompt_text):] if got_all.startswith(prompt_text) else decode(ids[plen:])
        if not any(want_text.endswith(t) for t in self.end_tokens):
            for t in self.end_tokens:
                cut = core.rstrip().rfind(t)
                if cut >= 0 and not core[cut + len(t):].strip():
                    kinds.append("end_added")
                    core = core[:cut]
                    break
        else:
            for t in self.end_tokens:
                cut = core.rfind(t)
                if cut >= 0 and core[cut + len(t):] and not core[cut + len(t):].strip():
                    kinds.append("after_end")
                    core = core[:cut + len(t)]
                    break
        if core != want_text:
            kinds.append("text")
        elif aligned and ids[plen:len(want)] != want[plen:]:
            kinds.append("retokenized")
        for kind in kinds or ["retokenized"]:
            r.differ[kind] = r.differ.get(kind, 0) + 1
            r.examples.setdefault(kind, sid)
