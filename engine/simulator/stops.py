"""Stop conditions applied to a planned output, and the stop trimming of `text` (contract 7.2).

After each token (0.5.5 schedule_batch.py:843-863): length, then stop/eos token ids, then stop strings and
`stop_regex` on the decoded tail; the matching token stays in `output_ids`. The detokenizer cuts the match from
`text` unless `no_stop_trim` (0.5.5 detokenizer_manager.py:120-145).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from engine.api.wire import FinishReason
from engine.simulator.generator import OutputPlan
from engine.simulator.protocol import bad_request

Decode = Callable[[Sequence[int], bool], str]  # (ids, skip_special_tokens) -> text


@dataclass(frozen=True)
class StopRules:
    token_ids: frozenset[int] = frozenset()
    strings: tuple[str, ...] = ()
    regexes: tuple[str, ...] = ()
    no_stop_trim: bool = False

    @property
    def custom(self) -> bool:
        """Whether anything beyond the model's eos can end the output."""
        return bool(self.token_ids or self.strings or self.regexes)


NO_RULES = StopRules()


def _str_list(value: Any, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(v for v in value if v)
    raise bad_request(f"{key} must be a string or a list of strings, got {value!r}.")


def rules_from_sampling(sp: dict[str, Any]) -> StopRules:
    """The stop rules of validated sampling params (a 400 naming the key when one is malformed)."""
    ids = sp.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                                             for i in ids)):
        raise bad_request(f"stop_token_ids must be a list of integers, got {ids!r}.")
    regexes = _str_list(sp.get("stop_regex"), "stop_regex")
    for pattern in regexes:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise bad_request(f"stop_regex {pattern!r} is not a valid regular expression: {exc}") from exc
    no_trim = sp.get("no_stop_trim", False)
    if not isinstance(no_trim, bool):
        raise bad_request(f"no_stop_trim must be a boolean, got {no_trim!r}.")
    rules = StopRules(frozenset(ids or ()), _str_list(sp.get("stop"), "stop"), regexes, no_trim)
    return rules if rules.custom or no_trim else NO_RULES


def _first_text_match(ids: Sequence[int], found: Callable[[str], Any], decode: Decode) -> int | None:
    """The index of the token after which `found(decoded prefix)` first holds (monotone in the prefix)."""
    if not ids or not found(decode(ids, False)):
        return None
    lo, hi = 0, len(ids) - 1  # the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if found(decode(ids[: mid + 1], False)):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _contains(s: str) -> Callable[[str], bool]:
    """The predicate "the text holds `s`"."""
    return lambda text: s in text


def apply_stops(plan: OutputPlan, rules: StopRules, decode: Decode,
                count_reasoning: Callable[[list[int], bool], int]) -> OutputPlan:
    """The plan cut at the first stop the rules match before its own end (its end keeps its own reason)."""
    if not rules.custom:
        return plan
    ids = plan.output_ids
    # (index, order of SGLang's checks, matched): a token check beats a string on the same token
    hits: list[tuple[int, int, Any]] = []
    for i, t in enumerate(ids):
        if t in rules.token_ids:
            hits.append((i, 0, t))
            break
    for s in rules.strings:
        k = _first_text_match(ids, _contains(s), decode)
        if k is not None:
            hits.append((k, 1, s))
    for pattern in rules.regexes:
        compiled = re.compile(pattern)
        k = _first_text_match(ids, compiled.search, decode)
        if k is not None:
            hits.append((k, 2, pattern))
    if not hits:
        return plan
    k, _, matched = min(hits, key=lambda h: (h[0], h[1]))
    last = len(ids) - 1
    if k == last and plan.finish_reason.get("type") != FinishReason.ABORT:
        # the plan ends on this token anyway: its eos (token ids are checked before strings) or the length
        # limit (checked before everything)
        return plan
    cut = list(ids[: k + 1])
    return dataclasses.replace(plan, output_ids=cut, finish_reason={"type": "stop", "matched": matched},
                               reasoning_tokens=count_reasoning(cut, plan.prompt_opened), text=None)


def answer_text(output_ids: Sequence[int], finish_reason: dict | None, *, skip_special_tokens: bool,
                no_stop_trim: bool, decode: Decode, prebuilt: str | None = None,
                special_piece: Callable[[int], str | None] = lambda _id: None) -> str:
    """`text` as the detokenizer sends it: the matched stop token / string cut unless `no_stop_trim`.

    `prebuilt` is the untrimmed text when the caller has it (the --sim-instant path): a matched special
    token is then cut from its end without decoding."""
    matched = (finish_reason or {}).get("matched") if (finish_reason or {}).get("type") == FinishReason.STOP else None
    # SGLang tests `if not matched`, so a matched id 0 is not trimmed either
    if no_stop_trim or not matched:
        return prebuilt if prebuilt is not None else decode(output_ids, skip_special_tokens)
    if isinstance(matched, int) and output_ids:
        piece = special_piece(matched) if prebuilt is not None else None
        if piece is not None and prebuilt is not None:
            if skip_special_tokens:
                return prebuilt  # a skipped special token is not in the text
            if prebuilt.endswith(piece):
                return prebuilt[: len(prebuilt) - len(piece)]
        return decode(output_ids[:-1], skip_special_tokens)
    text = prebuilt if prebuilt is not None else decode(output_ids, skip_special_tokens)
    if isinstance(matched, str):
        pos = text.find(matched)  # a regex pattern is looked up literally too, as SGLang does
        return text[:pos] if pos != -1 else text
    return text
