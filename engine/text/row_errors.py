"""A prompt row refused (Reject, with a one-line excerpt of it), why (RowError), and a prompt file that cannot be
read (PromptFileError, with where a missing one might be).
"""
from __future__ import annotations

from dataclasses import dataclass

from probes.host.candidates import Search, describe, find_candidates

EXCERPT_CHARS = 200


@dataclass(frozen=True)
class Reject:
    file: str
    line: int | None
    row: int | None
    reason: str  # human text, e.g. "malformed JSON: Expecting ',' delimiter: line 1 column 9 (char 8)"
    excerpt: str
    conversation_id: str | None = None
    kind: str = ""  # stable category for counting: malformed_json, unknown_role, duplicate_id, ...

    @property
    def category(self) -> str:
        return self.kind or self.reason

    def to_dict(self) -> dict:
        return {
            "file": self.file,
            "line": self.line,
            "row": self.row,
            "reason": self.reason,
            "kind": self.category,
            "excerpt": self.excerpt,
            "conversation_id": self.conversation_id,
        }


class PromptFileError(Exception):
    """A prompt path that cannot be read: names the path and carries the OS error text; for a path that is
    not there, where it looked for the file and what it found (the same finder as `regen probe`'s)."""

    def __init__(self, path: str, os_error: str | None, detail: str = "", candidates: Search | None = None):
        self.path = str(path)
        self.os_error = os_error
        self.detail = detail
        self.candidates = candidates
        parts = [f"prompt file {self.path}"]
        if detail:
            parts.append(detail)
        if os_error:
            parts.append(os_error)
        lines = [": ".join(parts)]
        if candidates is not None:
            lines += ["  " + line for line in describe(candidates)]
        super().__init__("\n".join(lines))

    @classmethod
    def not_found(cls, pattern: str, os_error: str | None, detail: str = "") -> PromptFileError:
        """For a path or glob that names no file: searches for candidates (bounded: 2 s)."""
        return cls(pattern, os_error, detail, candidates=find_candidates(pattern))


class RowError(Exception):
    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


def excerpt(text: str) -> str:
    text = " ".join(text[: EXCERPT_CHARS * 4].split())  # one line, whatever the file's layout
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "…"
