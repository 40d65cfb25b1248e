"""Refusals run-wide: a server refusing requests for one reason again and again is a config mistake, not bad samples.

The watch trips once STREAK settled samples in a row were refused for one reason (numbers in the words ignored), or
more than half of the last WINDOW were refused or failed; the trip names the server's words and the run.toml key.
"""
from __future__ import annotations

import collections
import re
from dataclasses import dataclass

STREAK = 20
WINDOW = 200
SHOWN_SAMPLES = 10

# words of a server's refusal -> the run.toml key most likely behind it (first match wins)
LIKELY_KEYS: tuple[tuple[str, str], ...] = (
    ("sampling_seed", "[sampling] seed"),
    ("max_new_tokens", "[sampling] max_new_tokens"),
    ("min_new_tokens", "[sampling] max_new_tokens"),
    ("repetition_penalty", "[sampling] repetition_penalty"),
    ("presence_penalty", "[sampling] presence_penalty"),
    ("frequency_penalty", "[sampling] (a penalty regen does not send: check the server's version)"),
    ("temperature", "[sampling] temperature"),
    ("top_p", "[sampling] top_p"),
    ("top_k", "[sampling] top_k"),
    ("min_p", "[sampling] min_p"),
    ("context length", "context_length / [sampling] max_new_tokens / [workers] extra_args (--context-length)"),
    ("maximum allowed length", "context_length / [workers] extra_args (--context-length, --max-total-tokens)"),
    ("unknown field", "the server's SGLang version (regen sends a key it does not know: check `regen probe`)"),
    ("api key", "[workers] api_key"),
    ("unauthorized", "[workers] api_key"),
)


def likely_key(reason: str) -> str:
    low = reason.lower()
    return next((key for words, key in LIKELY_KEYS if words in low), "the server's log (no run.toml key is named)")


def server_words(reason: str) -> str:
    """The server's own message, without the dispatcher's `rejected by SGLang (HTTP 400): ` lead."""
    return re.sub(r"^rejected by SGLang \([^)]*\): ", "", reason)


def reason_class(reason: str) -> str:
    """The reason without its numbers and sample-specific figures."""
    return re.sub(r"\d+(\.\d+)?", "#", reason)


@dataclass(frozen=True)
class RefusalTrip:
    reason: str  # the server's words, from the last refusal of the kind that tripped
    rule: str  # which rule tripped, with its figures
    samples: tuple[str, ...]  # every refused or failed sample the watch holds (generated again after the fix)
    key: str  # the run.toml key the words point at

    def text(self) -> str:
        return f"servers refuse the requests: {self.reason} ({self.rule})"

    def evidence(self) -> str:
        shown = ", ".join(self.samples[:SHOWN_SAMPLES]) + (f" and {len(self.samples) - SHOWN_SAMPLES} more"
                                                            if len(self.samples) > SHOWN_SAMPLES else "")
        return (f"server said: {self.reason}\nsamples: {shown}\nlikely config key: {self.key}\n"
                "dispatch stopped run-wide: nothing more is sent; the samples the servers refused or failed in this "
                "start are not counted as settled and are generated again by the next start")


class RefusalWatch:
    def __init__(self, streak: int = STREAK, window: int = WINDOW):
        self._streak_needed = streak
        self._recent: collections.deque[str | None] = collections.deque(maxlen=window)  # reason class, None: ok
        self._refused: collections.OrderedDict[str, str] = collections.OrderedDict()  # sample -> kind, in the window
        self._streak = 0
        self._streak_class = ""
        self.last_reason = ""
        self.tripped: RefusalTrip | None = None

    def ok(self, count: int = 1) -> None:
        for _ in range(count):
            self._push(None)
        self._streak, self._streak_class = 0, ""

    def refused(self, sample_id: str, kind: str, reason: str) -> RefusalTrip | None:
        """A sample not generated (kind rejected | failed) for `reason`, the server's words; the trip when this one
        trips the watch."""
        cls = reason_class(reason)
        self._push(cls)
        self._refused[sample_id] = kind
        reason = server_words(reason)
        self.last_reason = reason
        self._streak = self._streak + 1 if cls == self._streak_class else 1
        self._streak_class = cls
        if self.tripped is not None:
            return None
        bad = sum(1 for r in self._recent if r is not None)
        if self._streak >= self._streak_needed:
            rule = f"{self._streak} in a row for one reason"
        elif len(self._recent) == self._recent.maxlen and bad * 2 > len(self._recent):
            rule = f"{bad} of the last {len(self._recent)} settled samples refused or failed"
        else:
            return None
        self.tripped = RefusalTrip(reason, rule, tuple(self._refused), likely_key(reason))
        return self.tripped

    def _push(self, cls: str | None) -> None:
        if len(self._recent) == self._recent.maxlen and self._recent[0] is not None and self._refused:
            self._refused.popitem(last=False)  # the oldest refusal leaves the window with its slot
        self._recent.append(cls)
